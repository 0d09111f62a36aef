"""Pre-tokenized rows for online training: `tokens.jsonl` of {input_ids, loss_mask, id}."""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from kimi_pipe.exporters.base import ExportContext, Exporter
from kimi_pipe.store import atomic

TOKENS_FILE = "tokens.jsonl"


class TokensExporter(Exporter):
    name = "tokens"
    title = "pre-tokenized rows for online training"
    final_state = None  # no hidden states: the trainer's online path computes them

    needs_rows = True

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        super().__init__(settings)
        self._file: IO[str] | None = None
        self._tmp: Path | None = None

    def start(self, ctx: ExportContext) -> None:
        # One line per row as it comes (in file order): memory follows a row, not the run.
        self._tmp = ctx.output / f".{TOKENS_FILE}.tmp"
        self._file = open(self._tmp, "w")  # noqa: SIM115  (closed in finish)

    def add_row(self, index: int, sample_id: str, input_ids: list[int], mask: list[int]) -> None:
        assert self._file is not None, "start() first"
        self._file.write(json.dumps({"input_ids": input_ids, "loss_mask": mask, "id": sample_id}))
        self._file.write("\n")

    def finish(self, ctx: ExportContext, counts: dict[str, int], tokens: dict[str, int]) -> dict:
        if self._file is None:
            self.start(ctx)
        assert self._file is not None and self._tmp is not None
        self._file.close()
        atomic.replace(self._tmp, ctx.output / TOKENS_FILE)
        return {}

    def row_bytes(self, samples: int, tokens: int) -> dict[str, int]:
        # An id of up to 7 digits and ", " (9 bytes), a mask "1, " (3); keys and id per row.
        return {TOKENS_FILE: 12 * tokens + 256 * samples}

    def files(self, ctx: ExportContext) -> dict[str, Any]:
        return {
            "files": TOKENS_FILE,
            "compression": None,
            "rows": {"input_ids": "int list", "loss_mask": "int list", "id": "str"},
            "dtype": None,
            "scale_layout": None,
            "final_state": None,
            "layer_convention": None,
            "layer_ids": None,
        }

    def card_layout(self, summary: dict[str, Any]) -> list[str]:
        return [
            "`tokens.jsonl`: one JSON object a line, `input_ids`, `loss_mask` (same length) and "
            "`id`.",
            "No hidden states: the trainer's online path computes them with the target model.",
        ]

    def card_training(self, summary: dict[str, Any]) -> list[str]:
        c, out = summary["conventions"], summary["output"]
        model = summary.get("target_model_path") or "TARGET_MODEL_DIR"
        longest = summary["tokens"]["max_len"]
        capture = " ".join(str(i) for i in c["capture_layer_ids"])
        return [
            "speculators: `speculators prepare-data --model "
            f"{model} --data {out}/tokens.jsonl --output DIR` keeps these ids and masks (its",
            "pre-tokenized pass-through: no chat template, no render endpoint), then",
            f"`speculators train ... --target-layer-ids {capture}` generates the states",
            "through vLLM.",
            "",
            f"SpecForge: `data.prompts_path: {out}/tokens.jsonl` (its pre-tokenized online path:",
            "records with `input_ids` + `loss_mask` are used as they are, never re-tokenized; it",
            "needs an SGLang capture server, `deployment.mode: disaggregated`). Set",
            f"`data.max_length` >= {longest}: it cuts longer rows silently.",
        ]
