"""speculators' offline layout: a `datasets` dataset of rows + `hidden_states/hs_{i}.safetensors`.

Rows `input_ids`, `loss_mask`, `seq_len` (torch format, in the shuffled order: its
`--train-data-ratio` takes the first rows for training); `hs_i` holds `hidden_states` [L, 4, H]
(the three aux states, then the final state PRE-norm: speculators applies the verifier norm)
and `token_ids` [L], which its `ArrowDataset` checks against row i's `input_ids`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import torch
from safetensors.torch import save_file

from kimi_pipe.errors import ConfigError, StoreError
from kimi_pipe.exporters.base import ExportContext, Exporter
from kimi_pipe.store import atomic
from kimi_pipe.store.arrow_rows import save_rows
from kimi_pipe.store.conventions import PRE_NORM
from kimi_pipe.store.hidden_store import FP8, FP8_MAX, FP8_TORCH

SPECULATORS_STATES = "hidden_states"
# hs-connectors' FP8 layout, read by speculators' `--hidden-states-backend fp8` (FP8Transfer):
# `hidden_states` float8_e4m3fn [L, k+1, H] and `hidden_states_scales` float32 [L, 1, 1],
# one scale per token over all its states, amax / 448; value = fp8 value x scale.
FP8_SCALES_KEY = "hidden_states_scales"
FP8_SCALE_LAYOUT = (
    "per_token: hidden_states_scales [L, 1, 1] float32, amax over the token's k+1 states / 448 "
    "(hs-connectors' FP8 layout, speculators --hidden-states-backend fp8)"
)


def speculators_path(output: Path, index: int) -> Path:
    return output / SPECULATORS_STATES / f"hs_{index}.safetensors"


ROW_COLUMNS = ("input_ids", "loss_mask", "seq_len")


def _write_rows(out: Path, rows: Iterable[dict[str, Any]]) -> None:
    """The Arrow rows speculators' ArrowDataset reads with load_from_disk(data_path),
    streamed (kimi_pipe/store/arrow_rows.py): memory follows a batch of rows."""
    from datasets import load_from_disk  # optional dep: datasets (extract extra)

    staging = out / ".rows.tmp"
    # Its loader compares token_ids with the row's input_ids as tensors: store torch format,
    # as its own prepare_data does.
    save_rows(rows, staging, {k: [] for k in ROW_COLUMNS}, torch_format=True)
    for old in out.glob("data-*.arrow"):
        old.unlink()
    for item in staging.iterdir():
        atomic.replace(item, out / item.name)
    staging.rmdir()
    load_from_disk(str(out))  # fail here, not in the trainer, if the rows do not load


def _ids(ids: list[int]) -> str:
    return " ".join(str(i) for i in ids)


class SpeculatorsExporter(Exporter):
    name = "speculators"
    title = "speculators (vLLM) offline layout"
    final_state = PRE_NORM  # the trainer applies verifier_norm itself

    needs_rows = True

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        super().__init__(settings)
        # Row i must be hs_i: a skipped sample leaves no row, and later rows keep their
        # file index, so rows are written by index (gaps are refused in finish). They are
        # streamed to disk as they come; nothing is written in finish if a sample was skipped.
        self._file: IO[str] | None = None
        self._scratch = Path(".rows.jsonl.tmp")

    @property
    def fp8(self) -> bool:
        dtype = self.settings.get("dtype")
        if dtype not in (None, FP8):
            raise ConfigError(f"export.dtype={dtype!r}: null (the store's) or {FP8!r}")
        return dtype == FP8

    def sample_path(self, output: Path, index: int) -> Path:
        return speculators_path(output, index)

    def write_sample(self, output: Path, index: int, sample: dict[str, torch.Tensor]) -> None:
        aux = sample["aux_hidden_state"]
        final = sample["hidden_state"]
        length, hidden = final.shape
        # [L, k*H] -> [L, k, H], then the final state as the last of the k + 1 states.
        states = torch.cat([aux.reshape(length, -1, hidden), final.unsqueeze(1)], dim=1)
        tensors = {"token_ids": sample["input_ids"].to(torch.int64).contiguous()}
        if self.fp8:
            x = states.float()
            scale = (x.abs().amax(dim=(1, 2), keepdim=True) / FP8_MAX).clamp_min(1e-12)
            tensors["hidden_states"] = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_TORCH)
            tensors[FP8_SCALES_KEY] = scale.contiguous()
        else:
            tensors["hidden_states"] = states.contiguous()
        path = self.sample_path(output, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic.atomic_path(path) as tmp:
            save_file(tensors, str(tmp))

    def start(self, ctx: ExportContext) -> None:
        self._scratch = ctx.output / ".rows.jsonl.tmp"
        self._file = open(self._scratch, "w")  # noqa: SIM115  (closed in finish)

    def add_row(self, index: int, sample_id: str, input_ids: list[int], mask: list[int]) -> None:
        # A scratch JSON line per row, turned into Arrow batches in finish (after the
        # skipped-sample check): memory follows a row here, a batch there.
        assert self._file is not None, "start() first"
        self._file.write(json.dumps([input_ids, mask]) + "\n")

    def _scratch_rows(self) -> Iterator[dict[str, Any]]:
        with open(self._scratch) as f:
            for line in f:
                ids, mask = json.loads(line)
                yield {"input_ids": ids, "loss_mask": mask, "seq_len": len(ids)}

    def finish(self, ctx: ExportContext, counts: dict[str, int], tokens: dict[str, int]) -> dict:
        if counts["skipped_non_finite"]:
            if self._file is not None:
                self._file.close()
                self._scratch.unlink(missing_ok=True)
            # speculators maps row i to hs_i: a hole would pair rows with the wrong states.
            raise StoreError(
                f"{counts['skipped_non_finite']} samples have NaN/inf states; speculators pairs "
                "row i with hs_i, so remove them from the store (or re-extract) and export again"
            )
        if self._file is None:
            self.start(ctx)
        assert self._file is not None
        self._file.close()
        try:
            _write_rows(ctx.output, self._scratch_rows())
        finally:
            self._scratch.unlink(missing_ok=True)
        return {}

    def dataset_bytes(self, samples: int, tokens: int) -> int:
        # input_ids and loss_mask int64 a token, offsets and seq_len a row.
        return 16 * tokens + 32 * samples

    def files(self, ctx: ExportContext) -> dict[str, Any]:
        h = ctx.manifest["hidden_size"]
        k = len(ctx.conventions["output_layer_ids"])
        dtype = "float8_e4m3fn" if self.fp8 else ctx.manifest["dtype"]
        tensors: dict[str, Any] = {
            "hidden_states": [f"L, {k + 1}, {h}", dtype],
            "token_ids": ["L", "int64"],
        }
        if self.fp8:
            tensors[FP8_SCALES_KEY] = ["L, 1, 1", "float32"]
        return {
            "files": "data-*.arrow (datasets rows) + hidden_states/hs_*.safetensors",
            "compression": None,
            "tensors": tensors,
            "rows": {"input_ids": "int64 list", "loss_mask": "int64 list", "seq_len": "int"},
            **self.states_description(
                ctx, dtype, "input_of_layer", FP8_SCALE_LAYOUT if self.fp8 else None
            ),
        }

    def card_layout(self, summary: dict[str, Any]) -> list[str]:
        f = summary["files"]
        k = len(summary["conventions"]["output_layer_ids"])
        return [
            "This directory is a `datasets` dataset (`load_from_disk`): rows `input_ids`,",
            "`loss_mask`, `seq_len`, in the shuffled order. Row i's states are",
            "`hidden_states/hs_i.safetensors`: `hidden_states`"
            f" [{f['tensors']['hidden_states'][0]}]",
            f"({f['dtype']}; the {k} auxiliary states, then the final state PRE-norm: speculators",
            "applies the verifier's norm itself) and `token_ids` [L] int64, equal to row i's",
            "`input_ids`.",
            *(
                [
                    f"The states are fp8: `{FP8_SCALES_KEY}` [L, 1, 1] float32 holds one scale per",
                    "token (amax over its states / 448); speculators reads them with",
                    "`--hidden-states-backend fp8` (its FP8Transfer: value = fp8 value x scale).",
                ]
                if f["scale_layout"]
                else []
            ),
        ]

    def card_training(self, summary: dict[str, Any]) -> list[str]:
        c, out = summary["conventions"], summary["output"]
        model = summary.get("target_model_path") or "TARGET_MODEL_DIR"
        longest = summary["tokens"]["max_len"]
        capture, output_ids = c["capture_layer_ids"], c["output_layer_ids"]
        return [
            "speculators (`pip install speculators`), offline (states already here):",
            "",
            "```bash",
            f"speculators train --verifier-name-or-path {model} --data-path {out} \\",
            f"    --speculator-type eagle3 --target-layer-ids {_ids(capture)} \\",
            f"    --on-missing raise --total-seq-len {max(longest, 1)}"
            + (" --hidden-states-backend fp8" if summary["files"]["scale_layout"] else ""),
            "```",
            "",
            f'`--target-layer-ids` are input-of-layer ids ({capture} = "output of layer"',
            f"{output_ids} + 1). `--train-data-ratio` (default 0.9) takes the first 90 % of the",
            "rows for training and the rest for validation; the rows are already shuffled.",
        ]
