"""Small real stages for the runner's tests: they write files, slowly, and resume.

`Lines` appends `toy.n` numbered lines to `<run>/lines.txt`, one every `toy.delay_s`, each
flushed and fsynced, and on a re-run continues after the last whole line: a crash in the
middle must end, after a re-run, with every line exactly once. `Total` reads that file.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from kimi_pipe.pipeline.stage import StageContext


class Lines:
    name = "lines"
    settings = ("toy.n",)

    def reads(self, ctx: StageContext) -> list[Path]:
        return []

    def writes(self, ctx: StageContext) -> list[Path]:
        return [ctx.run_dir / "lines.txt"]

    def _n(self, ctx: StageContext) -> int:
        return int(OmegaConf.select(ctx.cfg, "toy.n", default=10))

    def _have(self, ctx: StageContext) -> list[str]:
        path = ctx.run_dir / "lines.txt"
        if not path.exists():
            return []
        text = path.read_text()
        whole = text[: text.rfind("\n") + 1]  # a torn last line is dropped and rewritten
        if whole != text:
            path.write_text(whole)
        return whole.splitlines()

    def is_complete(self, ctx: StageContext) -> bool:
        return len(self._have(ctx)) == self._n(ctx)

    def run(self, ctx: StageContext) -> dict[str, Any]:
        have = self._have(ctx)
        delay = float(OmegaConf.select(ctx.cfg, "toy.delay_s", default=0.0))
        with (ctx.run_dir / "lines.txt").open("a") as out:
            for i in range(len(have), self._n(ctx)):
                out.write(f"line {i}\n")
                out.flush()
                os.fsync(out.fileno())
                time.sleep(delay)
        return {"resumed_from": len(have), "lines": self._n(ctx)}


class Total:
    name = "total"
    settings = ("toy.n",)  # not toy.fail: failing is no part of the work

    def reads(self, ctx: StageContext) -> list[Path]:
        return [ctx.run_dir / "lines.txt"]

    def writes(self, ctx: StageContext) -> list[Path]:
        return [ctx.run_dir / "total.txt"]

    def is_complete(self, ctx: StageContext) -> bool:
        return (ctx.run_dir / "total.txt").exists()

    def run(self, ctx: StageContext) -> dict[str, Any]:
        if OmegaConf.select(ctx.cfg, "toy.fail", default=False):
            raise RuntimeError("told to fail")
        lines = (ctx.run_dir / "lines.txt").read_text().splitlines()
        (ctx.run_dir / "total.txt").write_text(f"{len(lines)}\n")
        return {"total": len(lines), "lines_said": ctx.result("lines")["lines"]}


class NotAStage:
    name = "broken"
