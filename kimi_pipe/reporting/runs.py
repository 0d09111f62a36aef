"""Reading finished generate runs for the report: which directories, their records (token
lists dropped), saved config, summary and attempt errors. Reads only what generate wrote.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimi_pipe.errors import MissingFile
from kimi_pipe.store.layout import ATTEMPT_ERRORS as ATTEMPT_ERRORS_FILE
from kimi_pipe.store.layout import PROBES_DIR, SERVING_AUTO_DIR, SUMMARY
from kimi_pipe.store.layout import RECORDS as RECORDS_FILE
from kimi_pipe.store.records import ReadStats, iter_records


@dataclass
class Run:
    name: str  # label in the report: the run directory relative to sweep_dir
    path: Path
    records: list[dict[str, Any]]
    config: dict[str, Any]  # .hydra/generate/config.yaml, {} when absent
    summary: dict[str, Any]  # summary.json, {} when absent
    attempt_errors: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: int = 0


def find_run_dirs(root: Path) -> list[Path]:
    """Every directory at or below `root` holding a records file, in a stable order."""
    if not root.exists():
        raise MissingFile(
            f"{root} does not exist; pass report.sweep_dir= a generate run directory or a "
            "sweep directory (made by `make sweep` or `python -m kimi_pipe generate`)"
        )
    # The probe stage's runs (<sweep_dir>/probes/<slug>/) and serving=auto's
    # (<run>/serving_auto/<slug>/) are probes, not provider runs.
    probes = {PROBES_DIR, SERVING_AUTO_DIR}
    found = sorted(
        {p.parent for p in root.rglob(RECORDS_FILE) if not probes & set(p.relative_to(root).parts)}
    )
    if not found:
        raise MissingFile(
            f"no {RECORDS_FILE} at or below {root}; run the generate stage or `make sweep` first"
        )
    return found


# How a run's saved config file is read (interpolations resolved where they can be; {} when
# the file is absent): given by the stage's door (kimi_pipe/stages/jobs/report.py).
ConfigReader = Callable[[Path], dict[str, Any]]

# Token lists are the bulk of a record and no figure needs them: dropped on load.
HEAVY_KEYS = ("prompt_ids", "output_ids", "loss_mask")


def load_run(path: Path, root: Path, read_config: ConfigReader) -> Run:
    read = ReadStats()  # torn last line (a crash mid-write) and corrupt lines are skipped
    by_id: dict[Any, dict[str, Any]] = {}
    for i, rec in enumerate(iter_records(path / RECORDS_FILE, read)):
        for key in HEAVY_KEYS:
            rec.pop(key, None)
        # A resumed run may hold a sample twice; the last record is the one that counts.
        by_id[rec.get("id", f"line-{i}")] = rec
    name = path.relative_to(root).as_posix() if path != root else path.name
    return Run(
        name=name or path.resolve().name,
        path=path,
        records=list(by_id.values()),
        # generate saves its config under .hydra/generate/ (one subdir per stage)
        config=read_config(path / ".hydra" / "generate" / "config.yaml")
        or read_config(path / ".hydra" / "config.yaml"),
        summary=_read_json(path / SUMMARY),
        attempt_errors=list(iter_records(path / ATTEMPT_ERRORS_FILE)),
        bad_lines=len(read.bad_lines) + int(read.torn_tail),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}
