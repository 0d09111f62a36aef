"""SpecForge's offline contracts for the DFlash family (DFlash, DFlash2, Domino) and DSpark.

SpecForge's offline reader takes one contract per strategy and validates it instead of
adapting (its docs/basic_usage/data_preparation.md, "Prepare offline target features"; the
reader: `specforge/algorithms/common/dflash_family_data.py`). Files are laid out as its
capture script writes them, `rows_{g}-{g+2000}/data_{i}.ckpt` (or `.ckpt.gz`), one
`torch.save` dict per sample:

* `dflash` (strategies dflash, domino; DFlash2 and D-PACE train with `strategy: dflash`):
  `input_ids` [L] int64, `loss_mask` [L] int64, `hidden_states` [1, L, k*H]: the outputs of the
  k target layers the drafter's config names (`dflash_config.target_layer_ids`, "output of
  layer" ids), concatenated in that order. No final state.
* `dspark`: the same plus `target_last_hidden_states` [1, L, H], the target's last hidden
  state after the final norm (SpecForge's SGLang capture keeps "the post-norm last hidden").

The layers come from `export.draft_config` (the drafter's config.json, the file its trainer
reads) or `export.layer_ids`; without either, every layer of the store in store order. A
sample whose loss mask has no two consecutive supervised tokens is left out
(`skipped_no_consecutive_loss`): SpecForge's normaliser raises on it. The states stay in the
store's read dtype (bf16): its DFlash-family reader and training step do not cast features,
so fp8 files would reach the drafter as they are; an fp8 store is dequantized here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from kimi_pipe.errors import ConfigError
from kimi_pipe.exporters.base import ExportContext, Exporter, save_torch
from kimi_pipe.exporters.specforge import specforge_path
from kimi_pipe.store.conventions import POST_NORM

NO_CONSECUTIVE_LOSS = "no_consecutive_loss"


def has_consecutive_loss(mask: torch.Tensor) -> bool:
    """Two adjacent supervised positions (SpecForge's `has_consecutive_supervised_tokens`)."""
    m = mask.reshape(-1).to(torch.bool)
    return bool((m[:-1] & m[1:]).any()) if m.numel() > 1 else False


class DFlashExporter(Exporter):
    name = "dflash"
    title = "SpecForge DFlash family (DFlash, DFlash2, Domino) offline features"
    final_state: ClassVar[str | None] = None  # the DFlash family reads no final state
    strategies: tuple[str, ...] = ("dflash", "domino")

    @property
    def compress(self) -> bool:
        return bool(self.settings.get("compress", False))

    def check(self, ctx: ExportContext) -> dict[str, Any]:
        draft = getattr(self, "draft", None)
        if draft is not None and draft.family != "dflash":
            raise ConfigError(
                f"export.draft_config={draft.source} is an EAGLE-3 config "
                f"({draft.key}); format={self.name} needs a DFlash-family config "
                "(dflash_config.target_layer_ids)"
            )
        extras: dict[str, Any] = {"strategies": list(self.strategies)}
        if draft is not None:
            extras["draft_config"] = draft.manifest_entry()
        return extras

    def refuse_sample(self, sample: dict[str, torch.Tensor]) -> str | None:
        return None if has_consecutive_loss(sample["loss_mask"]) else NO_CONSECUTIVE_LOSS

    def sample_path(self, output: Path, index: int) -> Path:
        return specforge_path(output, index, compress=self.compress)

    def record(self, sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # clone(): a file must hold only its own rows, never a larger storage.
        return {
            "input_ids": sample["input_ids"].to(torch.int64).clone(),
            "loss_mask": sample["loss_mask"].to(torch.int64).clone(),
            "hidden_states": sample["aux_hidden_state"].unsqueeze(0).clone(),
        }

    def write_sample(self, output: Path, index: int, sample: dict[str, torch.Tensor]) -> None:
        save_torch(self.sample_path(output, index), self.record(sample), compress=self.compress)

    def tensors(self, ctx: ExportContext) -> dict[str, list[str]]:
        h = int(ctx.manifest["hidden_size"])
        k = len(ctx.output_ids())
        dtype = str(ctx.manifest["dtype"])
        return {
            "input_ids": ["L", "int64"],
            "loss_mask": ["L", "int64"],
            "hidden_states": [f"1, L, {k * h}", dtype],
        }

    def files(self, ctx: ExportContext) -> dict[str, Any]:
        name = "rows_*/data_*.ckpt" + (".gz" if self.compress else "")
        return {
            "files": name,
            "compression": "gzip" if self.compress else None,
            "tensors": self.tensors(ctx),
            "strategies": list(self.strategies),
            **self.states_description(ctx, str(ctx.manifest["dtype"])),
        }

    def finish(self, ctx: ExportContext, counts: dict[str, int], tokens: dict[str, int]) -> dict:
        pattern = "rows_*/data_*.ckpt" + (".gz" if self.compress else "")
        size = sum(p.stat().st_size for p in ctx.output.glob(pattern))
        return {
            "files_bytes": size,
            "bytes_per_token": round(size / tokens["total"], 1) if tokens["total"] else None,
        }

    def card_layout(self, summary: dict[str, Any]) -> list[str]:
        f = summary["files"]
        t = f["tensors"]
        parts = [f"`{k}` [{v[0]}] {v[1]}" for k, v in t.items()]
        lines = [
            f"Every `{f['files']}` is a `torch.save` dict: {', '.join(parts)}.",
            f"`hidden_states` concatenates the outputs of target layers {f['layer_ids']}",
            '("output of layer", as `dflash_config.target_layer_ids` names them), in that order.',
        ]
        if "target_last_hidden_states" in t:
            lines.append(
                "`target_last_hidden_states` is the target's last hidden state after the final"
                " norm."
            )
        skipped = summary["counts"].get(f"skipped_{NO_CONSECUTIVE_LOSS}", 0)
        lines.append(
            f"{skipped} sample(s) without two consecutive loss tokens were left out (SpecForge's"
            " normaliser rejects them)."
        )
        if summary.get("bytes_per_token"):
            lines.append(f"Files: {summary['bytes_per_token']} bytes per token.")
        return lines

    def card_training(self, summary: dict[str, Any]) -> list[str]:
        out = summary["output"]
        ids = summary["files"]["layer_ids"]
        strategies = " or ".join(f"`{s}`" for s in summary["files"]["strategies"])
        longest = summary["tokens"]["max_len"]
        return [
            "SpecForge (`specforge train --config RUN.yaml`), offline mode, with",
            f"`training.strategy` {strategies}, `data.hidden_states_path: {out}`,",
            f"`data.max_length` >= {max(longest, 1)} (longer samples are cut without a word) and",
            "`model.draft_model_config` a drafter config whose `dflash_config.target_layer_ids`",
            f"is {ids} (the layers in these files; SpecForge does not check them against the",
            "files' width beyond the projection's input size).",
        ]


class DSparkExporter(DFlashExporter):
    name = "dspark"
    title = "SpecForge DSpark offline features"
    # target_last_hidden_states: the post-norm last hidden
    final_state: ClassVar[str | None] = POST_NORM
    strategies = ("dspark",)

    def record(self, sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = super().record(sample)
        out["target_last_hidden_states"] = sample["hidden_state"].unsqueeze(0).clone()
        return out

    def tensors(self, ctx: ExportContext) -> dict[str, list[str]]:
        out = super().tensors(ctx)
        h = int(ctx.manifest["hidden_size"])
        out["target_last_hidden_states"] = [f"1, L, {h}", str(ctx.manifest["dtype"])]
        return out
