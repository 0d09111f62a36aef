"""`ExportJob`: what one export runs, built once at the stage's door
(kimi_pipe/stages/jobs/export.py); `run_export` reads nothing else."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ExportJob:
    """`format`, `stores`, `output`, `seed`, `target_model_path` and the `export` group."""

    fmt: str
    stores: tuple[str, ...]
    output: str | None
    seed: int = 0
    target_model_path: str | None = None
    # The format's own settings (conf/export/<fmt>.yaml overrides), never the engine's keys.
    settings: Mapping[str, Any] = field(default_factory=dict)
    accept: tuple[str, ...] | None = None
    workers: int = 1
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    push_to_hub: Mapping[str, Any] = field(default_factory=dict)
