"""The one table of stages: what each reads, writes and depends on, as data.

Every built-in stage is a module of `kimi_pipe.stages` with the same shape:

- `run_stage(cfg, run_dir) -> dict` does (or finishes) the work and returns a JSON-able summary;
- `main(argv)` is its command line (`kimi_pipe.stages.command`);
- optionally `inputs(cfg, run_dir)`, `outputs(cfg, run_dir)`, `is_complete(cfg, run_dir)` and
  `complete_note(cfg, run_dir)` where the entry's plain file lists do not say enough.

`STAGE_TABLE` below is read by the runner (pipelines) and by the `kimi-pipe` command (its
stage list and the extras it checks). A new stage is one module plus one entry here; a stage
of your own needs no entry: name it `module:Class` (a class with the `Stage` protocol) in a
pipeline's `stages:` list.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from kimi_pipe.errors import ConfigError
from kimi_pipe.pipeline.stage import Stage, StageContext
from kimi_pipe.plugins import load_target
from kimi_pipe.store.layout import (
    AUDIT_JSON,
    AUDIT_MD,
    RECONSTRUCTED,
    RECORDS,
    REPORT_JSON,
    REPORT_MD,
)

_GENERATE = ("litellm", "httpx", "datasets", "numpy")
_EXTRACT = ("torch", "transformers", "safetensors", "accelerate", "datasets", "numpy")
_REPORT = ("matplotlib", "jsonschema")


@dataclass(frozen=True)
class StageEntry:
    """One stage as data."""

    name: str
    module: str  # the stage module (run_stage + main)
    summary: str  # one line for `kimi-pipe --help`
    extra: str = ""  # the pip extra that brings its dependencies ("" = the base install)
    # Top-level modules it imports, checked before it runs (a missing one names the extra).
    needs: tuple[str, ...] = ()
    # Config keys that define its work: a finished stage re-runs when one changed.
    settings: tuple[str, ...] | None = None
    reads: tuple[str, ...] = ()  # files in the run directory it needs
    writes: tuple[str, ...] = ()  # files in the run directory it makes
    # Config keys filled from an earlier stage's result when empty: {"stores": "extract.store"}.
    from_results: Mapping[str, str] = field(default_factory=dict)
    in_pipelines: bool = True  # False: a command only (demo, run)
    command: bool = True  # False: a pipeline step only (no `kimi-pipe <name>`)


STAGE_TABLE: tuple[StageEntry, ...] = (
    StageEntry("model", "kimi_pipe.stages.model", "convert the embedded local model (cached)",
               "extract", _EXTRACT, settings=("model.local_model", "model.hf_weights"),
               command=False),
    StageEntry("generate", "kimi_pipe.stages.generate", "buy answers from a provider",
               "generate", _GENERATE,
               settings=("model", "provider", "dataset", "budget", "validation", "serving",
                         "output_dir")),
    StageEntry("reconstruct", "kimi_pipe.stages.reconstruct",
               "provider answers -> exact token ids (the contract)",
               settings=("model", "validation", "serving", "provider.logprobs"),
               reads=(RECORDS,), writes=(RECONSTRUCTED,)),
    StageEntry("audit", "kimi_pipe.stages.audit", "audit reconstructed records", "extract",
               _EXTRACT, settings=("model", "audit"), reads=(RECORDS,),
               writes=(AUDIT_JSON, AUDIT_MD)),
    StageEntry("extract", "kimi_pipe.stages.extract", "hidden states from the target",
               "extract", _EXTRACT, settings=("model", "extract"), reads=(RECORDS,)),
    StageEntry("export", "kimi_pipe.stages.export", "EAGLE-3 training data", "extract",
               _EXTRACT, settings=("format", "stores", "seed", "output"),
               from_results={"stores": "extract.store"}),
    StageEntry("probe", "kimi_pipe.stages.probe", "conformance probes per provider",
               "generate", _GENERATE, settings=("probe", "model", "provider")),
    StageEntry("sweep", "kimi_pipe.stages.sweep", "compare providers", "generate,report",
               _GENERATE + _REPORT,
               settings=("sweep", "report", "model", "provider", "dataset", "budget",
                         "validation", "serving"),
               writes=("report.md",)),
    StageEntry("report", "kimi_pipe.stages.report", "report over finished runs", "report",
               _REPORT, settings=("report",), writes=(REPORT_MD, REPORT_JSON)),
    StageEntry("demo", "kimi_pipe.pipeline.demo", "the whole pipeline offline on SmolLM2",
               "all", _GENERATE + _EXTRACT + _REPORT, in_pipelines=False),
    StageEntry("run", "kimi_pipe.pipeline.runner", "run a pipeline config end to end", "all",
               in_pipelines=False),
)  # fmt: skip

ENTRIES: dict[str, StageEntry] = {e.name: e for e in STAGE_TABLE}


class ModuleStage:
    """The `Stage` protocol over a stage module, driven by its entry."""

    entry: StageEntry

    def __init__(self, entry: StageEntry | None = None) -> None:
        if entry is not None:
            self.entry = entry
        self.name = self.entry.name
        self.settings = self.entry.settings

    @property
    def module(self) -> ModuleType:
        return load_target(self.entry.module, kind="stage")  # type: ignore[no-any-return]

    def _hook(self, name: str) -> Any:
        return getattr(self.module, name, None)

    def config(self, ctx: StageContext) -> DictConfig:
        """The stage's config: empty keys filled from earlier stages' results."""
        cfg = ctx.cfg
        for key, source in self.entry.from_results.items():
            if OmegaConf.select(cfg, key, default=None):
                continue
            stage, _, result_key = source.partition(".")
            if stage in ctx.results and ctx.results[stage].get(result_key) is not None:
                value = ctx.results[stage][result_key]
                cfg = cfg.copy()
                with open_dict(cfg):
                    OmegaConf.update(cfg, key, [value] if key == "stores" else value,
                                     force_add=True)  # fmt: skip
        return cfg

    def reads(self, ctx: StageContext) -> list[Path]:
        hook = self._hook("inputs")
        if hook is not None:
            return list(hook(self.config(ctx), ctx.run_dir))
        return [ctx.run_dir / p for p in self.entry.reads]

    def writes(self, ctx: StageContext) -> list[Path]:
        hook = self._hook("outputs")
        if hook is not None:
            return list(hook(self.config(ctx), ctx.run_dir))
        return [ctx.run_dir / p for p in self.entry.writes]

    def is_complete(self, ctx: StageContext) -> bool:
        hook = self._hook("is_complete")
        if hook is not None:
            return bool(hook(self.config(ctx), ctx.run_dir))
        return all(p.exists() for p in self.writes(ctx))

    def complete_note(self, ctx: StageContext) -> str:
        hook = self._hook("complete_note")
        return str(hook(self.config(ctx), ctx.run_dir)) if hook is not None else ""

    def run(self, ctx: StageContext) -> dict[str, Any]:
        return dict(self.module.run_stage(self.config(ctx), ctx.run_dir))


def _stage_class(entry: StageEntry) -> type[ModuleStage]:
    name = "".join(part.capitalize() for part in entry.name.split("_")) + "Stage"
    return type(name, (ModuleStage,), {"entry": entry, "__doc__": entry.summary})


# The built-in pipeline stages by name (classes, so `STAGES["extract"]()` is a stage).
STAGES: dict[str, type[ModuleStage]] = {
    e.name: _stage_class(e) for e in STAGE_TABLE if e.in_pipelines
}
ModelStage, GenerateStage, ReconstructStage, AuditStage, ExtractStage = (
    STAGES[n] for n in ("model", "generate", "reconstruct", "audit", "extract")
)
ExportStage, ProbeStage, SweepStage, ReportStage = (
    STAGES[n] for n in ("export", "probe", "sweep", "report")
)


def resolve_stage(name: str) -> Stage:
    """A built-in stage by name, or `module:Class` for one of your own."""
    if name in STAGES:
        return STAGES[name]()
    if ":" not in name:
        raise ConfigError(
            f"unknown stage {name!r}: built-in stages are {sorted(STAGES)}; "
            "your own is `module:Class`"
        )
    try:  # the one plug-in resolver (kimi_pipe/plugins.py)
        cls = load_target(name, kind="stage")
    except ImportError as exc:  # a dependency of your module's
        raise ConfigError(f"stage {name!r} cannot be imported: {exc}") from exc
    stage = cls()
    if not isinstance(stage, Stage):
        raise ConfigError(f"{name} does not implement the Stage protocol (name, reads, writes, "
                          "is_complete, run)")  # fmt: skip
    print(f"[run] using stage {name}", file=sys.stderr)
    return stage  # type: ignore[no-any-return]
