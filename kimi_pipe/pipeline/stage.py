"""The one protocol every pipeline stage implements, and what the runner hands it.

A stage is small: a name, the files it reads, the files it writes, whether its outputs are
complete, and `run`. The runner (`pipeline.runner`) composes stages from a pipeline config,
skips complete ones, re-runs incomplete ones (each stage resumes its own half-done work) and
times them. A stage reads its settings from the composed config, with the pipeline's
per-stage overrides already applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from omegaconf import DictConfig


@dataclass
class StageContext:
    """What a stage sees: the composed config (overrides applied), the run directory, and the
    results of the stages before it (by name; results of skipped stages come from their
    completion markers)."""

    cfg: DictConfig
    run_dir: Path
    results: Mapping[str, dict[str, Any]] = field(default_factory=dict)

    def result(self, stage: str) -> dict[str, Any]:
        if stage not in self.results:
            raise KeyError(f"stage {stage!r} did not run before this one (pipeline order?)")
        return self.results[stage]


@runtime_checkable
class Stage(Protocol):
    """One step of a pipeline. `run` must be resumable: the runner calls it again after a
    crash, and it must then finish the work instead of redoing or duplicating it."""

    name: str

    def reads(self, ctx: StageContext) -> list[Path]:
        """Files or directories the stage needs (checked to exist before it runs)."""
        ...

    def writes(self, ctx: StageContext) -> list[Path]:
        """Files or directories the stage produces (the summary shows where they are)."""
        ...

    def is_complete(self, ctx: StageContext) -> bool:
        """True when the outputs are whole: the runner may then skip the stage."""
        ...

    def run(self, ctx: StageContext) -> dict[str, Any]:
        """Do (or finish) the work; return a JSON-able summary."""
        ...
