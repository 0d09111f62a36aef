"""SpecForge's offline layout: `rows_{g}-{g+2000}/data_{i}.ckpt` + `specforge_train.yaml`.

Each file is a `torch.save` dict: `input_ids` [L] int64, `loss_mask` [L] int64, `hidden_state`
[1, L, H] POST-norm (its teacher is a bare lm_head), `aux_hidden_state` [1, L, 3H]. With
`export.compress=true` the files are gzip'ed `data_{i}.ckpt.gz`, which SpecForge's reader
accepts (its capture script's `--compress`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import safe_open

from kimi_pipe.errors import ConfigError, InputError, MissingFile
from kimi_pipe.exporters.base import ExportContext, Exporter, save_torch, write_atomic
from kimi_pipe.store.conventions import POST_NORM

ROWS_PER_DIR = 2000  # SpecForge's rows_{g}-{g+2000} grouping
SPECFORGE_CONFIG = "specforge_train.yaml"
SPECFORGE_DEFAULT_MAX_LENGTH = 2048  # data.max_length when a config does not set it


def specforge_path(output: Path, index: int, *, compress: bool = False) -> Path:
    g = index // ROWS_PER_DIR * ROWS_PER_DIR
    suffix = ".ckpt.gz" if compress else ".ckpt"
    return output / f"rows_{g}-{g + ROWS_PER_DIR}" / f"data_{index}{suffix}"


def checkpoint_weight_names(model_path: str | os.PathLike[str]) -> list[str]:
    """Tensor names of a Hugging Face checkpoint: its weight index, else its safetensors files."""
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict):
            raise InputError(f"{index} has no weight_map; is it a Hugging Face weight index?")
        return sorted(weight_map)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise MissingFile(
            f"{root} has neither model.safetensors.index.json nor *.safetensors: pass "
            "target_model_path=DIR, the target model's Hugging Face directory"
        )

    names: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.extend(handle.keys())
    return sorted(names)


def _pick_key(names: Sequence[str], suffix: str, what: str, model_path: str) -> str | None:
    found = [n for n in names if n == suffix or n.endswith("." + suffix)]
    if len(found) > 1:
        # A multimodal checkpoint: the language model's key is the one SpecForge needs.
        language = [n for n in found if "language_model" in n]
        found = language if len(language) == 1 else found
    if len(found) > 1:
        raise ConfigError(
            f"{model_path}: several {what} weights {found}; set it by hand in {SPECFORGE_CONFIG}"
        )
    return found[0] if found else None


def specforge_weight_keys(model_path: str | os.PathLike[str]) -> dict[str, str]:
    """SpecForge's model.embedding_key / model.lm_head_key, read from the checkpoint.

    Kimi K2.5 is a multimodal wrapper: its keys are `language_model.model.embed_tokens.weight`
    and `language_model.lm_head.weight`. A model with tied embeddings has no lm_head weight:
    the embedding is the head.
    """
    names = checkpoint_weight_names(model_path)
    embed = _pick_key(names, "embed_tokens.weight", "embedding", str(model_path))
    head = _pick_key(names, "lm_head.weight", "lm_head", str(model_path))
    if embed is None:
        raise InputError(f"{model_path}: no '*embed_tokens.weight' in the checkpoint")
    return {"embedding_key": embed, "lm_head_key": head or embed}


def specforge_config(
    *,
    output: Path,
    target_model_path: str | None,
    output_ids: list[int],
    max_length: int,
    dtype: str,
    weight_keys: dict[str, str] | None,
) -> str:
    """The `specforge train --config` YAML for this export (SpecForge 0.2.x schema)."""
    model: dict[str, Any] = {
        "target_model_path": target_model_path or "SET_ME_target_model_directory",
        "aux_hidden_state_layer_ids": list(output_ids),
        "torch_dtype": dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16",
    }
    if weight_keys:
        model.update(weight_keys)
    config = {
        "model": model,
        "data": {"hidden_states_path": str(output.resolve()), "max_length": int(max_length)},
        "training": {"strategy": "eagle3"},
        "output_dir": str(output.resolve() / "specforge_out"),
    }
    header = (
        "# Made by python -m kimi_pipe export format=specforge. Train with:\n"
        f"#   specforge train --config {output.resolve() / SPECFORGE_CONFIG}\n"
        "# aux_hidden_state_layer_ids: 'output of layer' ids (SpecForge's convention).\n"
        "# max_length >= the longest sample: SpecForge cuts longer samples without a word.\n"
    )
    if not weight_keys:
        header += (
            "# embedding_key / lm_head_key: not checked (no target_model_path); SpecForge's\n"
            "# defaults apply. Kimi K2.5 needs language_model.model.embed_tokens.weight and\n"
            "# language_model.lm_head.weight: rerun the export with target_model_path=DIR.\n"
        )
    if not target_model_path:
        header += "# target_model_path: unknown to the store; set it before training.\n"
    return header + yaml.safe_dump(config, sort_keys=False)


def _resolve_max_length(requested: int | None, longest: int) -> int:
    if requested is None:
        return max(longest, 1)
    if requested < longest:
        raise ConfigError(
            f"max_length={requested} is shorter than the longest exported sample ({longest} "
            "tokens): SpecForge would cut it silently. Pass max_length >= "
            f"{longest}, or re-extract with extract.max_len={requested}."
        )
    return requested


class SpecForgeExporter(Exporter):
    name = "specforge"
    title = "SpecForge offline layout"
    final_state = POST_NORM  # teacher = bare lm_head(hidden_state)

    @property
    def compress(self) -> bool:
        return bool(self.settings.get("compress", False))

    def check(self, ctx: ExportContext) -> dict[str, Any]:
        layers = ctx.output_ids()
        if len(layers) != 3:
            # SpecForge's EAGLE3 resolves exactly three capture layers (resolve_eagle_capture_
            # layers) and its drafter's input is 3H: a store holding several drafters' layers
            # is exported with the EAGLE-3 drafter's own config.
            raise ConfigError(
                f"format=specforge (EAGLE-3) writes exactly three aux layers; these would be "
                f"{layers}: pass export.draft_config=<the EAGLE-3 drafter's config.json> or "
                "export.layer_ids=[a,b,c]"
            )
        self.weight_keys = specforge_weight_keys(ctx.model_path) if ctx.model_path else None
        return {}

    def sample_path(self, output: Path, index: int) -> Path:
        return specforge_path(output, index, compress=self.compress)

    def write_sample(self, output: Path, index: int, sample: dict[str, torch.Tensor]) -> None:
        save_torch(
            self.sample_path(output, index),
            {
                # clone(): a file must hold only its own rows, never a larger storage.
                "input_ids": sample["input_ids"].to(torch.int64).clone(),
                "loss_mask": sample["loss_mask"].to(torch.int64).clone(),
                "hidden_state": sample["hidden_state"].unsqueeze(0).clone(),
                "aux_hidden_state": sample["aux_hidden_state"].unsqueeze(0).clone(),
            },
            compress=self.compress,
        )

    def finish(self, ctx: ExportContext, counts: dict[str, int], tokens: dict[str, int]) -> dict:
        requested = self.settings.get("max_length")
        length_cap = _resolve_max_length(
            int(requested) if requested is not None else None, tokens["max_len"]
        )
        write_atomic(
            ctx.output / SPECFORGE_CONFIG,
            specforge_config(
                output=ctx.output,
                target_model_path=ctx.model_path,
                output_ids=ctx.conventions["output_layer_ids"],
                max_length=length_cap,
                dtype=str(self.files(ctx)["dtype"]),
                weight_keys=self.weight_keys,
            ),
        )
        return {
            "specforge_config": SPECFORGE_CONFIG,
            "max_length": length_cap,
            "weight_keys": self.weight_keys,
            "weight_keys_source": (
                f"checkpoint index of {ctx.model_path}"
                if self.weight_keys
                else "not checked (no target_model_path): SpecForge's defaults"
            ),
        }

    def files(self, ctx: ExportContext) -> dict[str, Any]:
        h = ctx.manifest["hidden_size"]
        aux_h = ctx.manifest["aux_hidden_size"]
        dtype = ctx.manifest["dtype"]
        name = "rows_*/data_*.ckpt" + (".gz" if self.compress else "")
        return {
            "files": name,
            "compression": "gzip" if self.compress else None,
            "tensors": {
                "input_ids": ["L", "int64"],
                "loss_mask": ["L", "int64"],
                "hidden_state": [f"1, L, {h}", dtype],
                "aux_hidden_state": [f"1, L, {aux_h}", dtype],
            },
            **self.states_description(ctx, dtype),
        }

    def card_layout(self, summary: dict[str, Any]) -> list[str]:
        f = summary["files"]
        t = f["tensors"]
        gz = (
            " Files are gzip'ed (`.ckpt.gz`, `export.compress=true`); SpecForge's reader"
            " opens them as they are."
            if f["compression"]
            else ""
        )
        return [
            f"Every `{f['files']}` is a `torch.save` dict with `input_ids` [L] int64,",
            f"`loss_mask` [L] int64, `hidden_state` [{t['hidden_state'][0]}] (post-norm) and",
            f"`aux_hidden_state` [{t['aux_hidden_state'][0]}] ({f['dtype']}). SpecForge's",
            "offline reader walks the directory for `*.ckpt` and `*.ckpt.gz`",
            f"(`data.hidden_states_path`).{gz}",
        ]

    def card_training(self, summary: dict[str, Any]) -> list[str]:
        out = summary["output"]
        longest = summary["tokens"]["max_len"]
        output_ids = summary["conventions"]["output_layer_ids"]
        return [
            "SpecForge 0.2.x (`pip install specforge`):",
            "",
            "```bash",
            f"specforge train --config {out}/specforge_train.yaml",
            "```",
            "",
            "`specforge_train.yaml` (written beside the data) sets `data.hidden_states_path` to",
            f"this directory, `data.max_length` = {summary.get('max_length')} (the longest",
            f"sample is {longest} tokens; SpecForge's default 2048 cuts longer samples silently),",
            f"`model.target_model_path`, `model.aux_hidden_state_layer_ids` = {output_ids}",
            '("output of layer" ids, SpecForge\'s convention) and the lm_head / embedding keys',
            f"({summary.get('weight_keys_source')}: {_fmt(summary.get('weight_keys'))}).",
            "Its normaliser sets the last loss-mask position to 0; features are not cast, so",
            "the files are in the training dtype (bf16).",
        ]


def _fmt(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
