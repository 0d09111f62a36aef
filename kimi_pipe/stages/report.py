r"""Provider report: per-run fidelity, cost and speed from finished generate runs.

    python -m kimi_pipe report report.sweep_dir=runs/sweep/B5 [report.out_dir=DIR] \
        [report.min_ok_rate=0.95] [report.max_error_rate=0.10] [report.min_tool_valid_rate=0.95] \
        [report.ignore_quantizations=[fp4,nvfp4,mxfp4,fp6]] [report.rank_step=0.02]
    make report sweep_dir=runs/sweep/B5                          # the same

A Hydra app over the shared config; its settings are the `report` group
(conf/report/default.yaml). `report.sweep_dir` is one generate run directory (it holds
`records.jsonl`) or any directory above several of them (a sweep, or `runs/<dataset>`).
Writes `report.md`, `report.json` and PNG charts into `report.out_dir` (default:
`sweep_dir`) and ends with a recommended OpenRouter `provider` routing block. Reads only
what generate wrote; needs no network and no model, and writes no run directory of its own.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from kimi_pipe.errors import ConfigError
from kimi_pipe.reporting.recommend import Policy
from kimi_pipe.reporting.report import (  # noqa: F401  (the report's names, as callers know them)
    Recommendation,
    build_report,
)
from kimi_pipe.stages.command import compose_command
from kimi_pipe.stages.help import HELP
from kimi_pipe.stages.jobs.report import read_saved_config
from kimi_pipe.stages.jobs.report import report_settings as settings_of
from kimi_pipe.store.layout import REPORT_JSON


def run_stage(cfg: Any, run_dir: Path | None = None) -> dict[str, Any]:
    """The stage entry: the report over the run directory's runs (else `report.sweep_dir`),
    written beside them (else into `report.out_dir`)."""
    settings = settings_of(cfg)
    if run_dir is not None:
        where, out = Path(run_dir), Path(run_dir)
    elif settings.sweep_dir:
        where = Path(settings.sweep_dir)
        out = Path(settings.out_dir or settings.sweep_dir)
    else:
        raise ConfigError("report.sweep_dir=PATH is required (a run or sweep directory)")
    path = build_report(where, out, settings.policy(), read_config=read_saved_config)
    data = json.loads((out / REPORT_JSON).read_text(encoding="utf-8"))
    return {"report": str(path), "routing": data.get("routing")}


# The command line before it was a Hydra app: `sweep_dir=X` is now `report.sweep_dir=X`.
MOVED = {
    key: f"report.{key}" for key in ("sweep_dir", "out_dir", *(f.name for f in fields(Policy)))
}


def main(argv: list[str] | None = None) -> int:
    return compose_command(lambda cfg: run_stage(cfg), argv, help=HELP["report"], moved=MOVED)


if __name__ == "__main__":
    raise SystemExit(main())
