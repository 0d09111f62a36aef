"""Reviewable golden snapshots: one text file per case under snapshots/, each id beside the
text it decodes to, so a diff shows `163586  "<|im_end|>"` rather than a bare number."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode

from kimi_pipe.core.models import Model
from kimi_pipe.core.reconstruction import Reconstruction

SNAPSHOT_ROOT = Path(__file__).resolve().parent.parent / "snapshots"


class TokenSnapshot(SingleFileSnapshotExtension):
    _write_mode = WriteMode.TEXT
    file_extension = "txt"

    @classmethod
    def dirname(cls, *, test_location: Any) -> str:
        return str(SNAPSHOT_ROOT / test_location.basename)


def _runs(values: list[int]) -> str:
    """Run-length text of a mask: `0x22 1x9`."""
    out: list[str] = []
    for value in values:
        if out and out[-1].startswith(f"{value}x"):
            out[-1] = f"{value}x{int(out[-1].split('x')[1]) + 1}"
        else:
            out.append(f"{value}x1")
    return " ".join(out)


def render_snapshot(model: Model, case: dict[str, Any], result: Reconstruction) -> str:
    piece = model.tokenizer.piece
    lines = [
        f"# {case['id']}: {case.get('what', '')}",
        f"model: {model.name}",
        f"ok: {str(result.ok).lower()}",
        f"issues: {json.dumps(result.issues)}",
        f"completion_tokens: reported {result.completion_tokens_reported}, "
        f"reconstructed {result.completion_tokens_reconstructed}",
        f"loss_mask: {_runs(result.loss_mask)}",
        f"## prompt_ids ({len(result.prompt_ids)})",
        *(f"{i:>7}  {json.dumps(piece(i), ensure_ascii=False)}" for i in result.prompt_ids),
        f"## output_ids ({len(result.output_ids)})",
        *(f"{i:>7}  {json.dumps(piece(i), ensure_ascii=False)}" for i in result.output_ids),
    ]
    return "\n".join(lines) + "\n"
