"""The built-in stages, as the runner sees them: thin adapters over `kimi_pipe.stages`.

Each adapter says what its stage reads and writes inside the run directory and calls the
stage's own function, so `python -m kimi_pipe.<stage>` and a pipeline do the same work.
A new stage: a class with the `Stage` protocol, here (and in `STAGES`) or anywhere
importable as `module:Class` in a pipeline's `stages:` list.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from kimi_pipe.pipeline.stage import Stage, StageContext


def set_key(cfg: DictConfig, key: str, value: Any) -> None:
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, force_add=True)


class OutputsExist:
    """Default completeness: every declared output exists (the stage wrote it last).

    `settings` names the config keys that define a stage's work: the runner re-runs a
    finished stage when one of them changed (or an earlier stage ran again).
    """

    name = "stage"
    settings: tuple[str, ...] | None = None

    def reads(self, ctx: StageContext) -> list[Path]:
        return []

    def writes(self, ctx: StageContext) -> list[Path]:
        return []

    def is_complete(self, ctx: StageContext) -> bool:
        return all(p.exists() for p in self.writes(ctx))


class ModelStage(OutputsExist):
    """Convert the provider's embedded local model once (cached); nothing for remote ones."""

    name = "model"
    settings = ("model.local_model", "model.hf_weights")

    def _spec(self, ctx: StageContext) -> Any:
        from kimi_pipe.providers.local_model import LocalModelSpec

        node = OmegaConf.select(ctx.cfg, "model.local_model", default=None)
        return None if node is None else LocalModelSpec.from_cfg(node)

    def writes(self, ctx: StageContext) -> list[Path]:
        from kimi_pipe.providers.local_model import converted_dir

        spec = self._spec(ctx)
        return [] if spec is None else [converted_dir(spec)]

    def is_complete(self, ctx: StageContext) -> bool:
        from kimi_pipe.providers.local_model import is_complete

        return all(is_complete(p) for p in self.writes(ctx))

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from kimi_pipe.providers.local_model import ensure_local_model

        spec = self._spec(ctx)
        if spec is None:
            return {"path": None}
        path = ensure_local_model(spec)
        hf_weights = OmegaConf.select(ctx.cfg, "model.hf_weights", default=None)
        if hf_weights is not None and Path(str(hf_weights)).resolve() != path.resolve():
            raise ValueError(f"model.hf_weights={hf_weights} is not the converted {path}")
        return {"path": str(path)}


class GenerateStage(OutputsExist):
    """Buy (or, with provider=local, generate) every prompt's answer; resumes answered ids."""

    name = "generate"
    settings = ("model", "provider", "dataset", "budget", "validation", "serving", "output_dir")

    def writes(self, ctx: StageContext) -> list[Path]:
        return [ctx.run_dir / "records.jsonl", ctx.run_dir / "summary.json"]

    def is_complete(self, ctx: StageContext) -> bool:
        """Every prompt of the dataset has a record (a run stopped by its budget is not)."""
        from kimi_pipe.store.prompt_datasets import load_prompts
        from kimi_pipe.store.records import load_resume_index

        if not all(p.exists() for p in self.writes(ctx)):
            return False
        done = load_resume_index(ctx.run_dir / "records.jsonl").ids
        return all(p.id in done for p in load_prompts(ctx.cfg.dataset))

    def complete_note(self, ctx: StageContext) -> str:
        return f"all answered already in {ctx.run_dir} (no server started, nothing bought)"

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from kimi_pipe.stages.generate import generate

        status, summary = generate(ctx.cfg, ctx.run_dir)  # starts/stops a local server itself
        if status != 0 or summary is None:
            raise RuntimeError(
                f"generate exited with status {status}; see the messages above and "
                f"{ctx.run_dir / 'summary.json'}"
            )
        return summary


class ReconstructStage(OutputsExist):
    """Rebuild the ids from the stored answers alone and compare them with generate's."""

    name = "reconstruct"
    settings = ("model", "validation", "serving", "provider.logprobs")

    def reads(self, ctx: StageContext) -> list[Path]:
        return [ctx.run_dir / "records.jsonl"]

    def writes(self, ctx: StageContext) -> list[Path]:
        return [ctx.run_dir / "reconstructed.jsonl"]

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from kimi_pipe.core.models import load_model
        from kimi_pipe.stages.reconstruct import run_configured
        from kimi_pipe.store.records import iter_records

        source, target = ctx.run_dir / "records.jsonl", ctx.run_dir / "reconstructed.jsonl"
        counts = run_configured(ctx.cfg, load_model(ctx.cfg.model), source, target)
        inline = {r["id"]: r for r in iter_records(source) if not r.get("error")}
        same = differ = 0
        for rec in iter_records(target):
            ref = inline.get(rec.get("id"))
            if ref is None:
                continue
            keys = ("prompt_ids", "output_ids", "loss_mask")
            if all(rec.get(k) == ref.get(k) for k in keys):
                same += 1
            else:
                differ += 1
        return {"output": str(target), "records": counts["records"], "ok": counts["ok"],
                "same_as_generate": same, "differ_from_generate": differ}  # fmt: skip


class AuditStage(OutputsExist):
    """Fidelity: reconstructed ids against ids an engine really produced."""

    name = "audit"
    settings = ("model", "audit")

    def reads(self, ctx: StageContext) -> list[Path]:
        return [ctx.run_dir / "records.jsonl"]

    def writes(self, ctx: StageContext) -> list[Path]:
        return [ctx.run_dir / "audit.json", ctx.run_dir / "audit.md"]

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from kimi_pipe.stages.audit import run_audit

        cfg = ctx.cfg.copy()
        set_key(cfg, "audit.run_dir", str(ctx.run_dir))
        server = OmegaConf.select(cfg, "provider.server", default=None)
        if cfg.audit.get("threads") is None and server is not None:
            # Same CPU thread count as the server: the greedy runs must see the same arithmetic.
            set_key(cfg, "audit.threads", server.get("threads"))
        return run_audit(cfg)


class ExtractStage(OutputsExist):
    """EAGLE-3 hidden states of the run's token records into a sharded store."""

    name = "extract"
    settings = ("model", "extract")

    def reads(self, ctx: StageContext) -> list[Path]:
        return [ctx.run_dir / "records.jsonl"]

    def _store(self, ctx: StageContext) -> Path:
        out = OmegaConf.select(ctx.cfg, "extract.output_dir", default=None)
        return Path(str(out)) if out else ctx.run_dir / f"hidden_{ctx.cfg.extract.backend}"

    def writes(self, ctx: StageContext) -> list[Path]:
        from kimi_pipe.store.hidden_store import MANIFEST

        return [self._store(ctx) / MANIFEST]

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from kimi_pipe.stages.extract import run_extract

        cfg = ctx.cfg.copy()
        set_key(cfg, "extract.run_dir", str(ctx.run_dir))
        return run_extract(cfg)


class ExportStage(OutputsExist):
    """Training files for a trainer (`format=`) from the stores of earlier stages."""

    name = "export"
    settings = ("format", "stores", "seed", "output")

    def _stores(self, ctx: StageContext) -> list[str]:
        stores = OmegaConf.select(ctx.cfg, "stores", default=None) or []
        if isinstance(stores, str):
            stores = [stores]
        if not stores and "extract" in ctx.results:
            stores = [ctx.results["extract"]["store"]]
        return [str(s) for s in stores]

    def _output(self, ctx: StageContext) -> Path:
        out = OmegaConf.select(ctx.cfg, "output", default=None)
        fmt = OmegaConf.select(ctx.cfg, "format", default="specforge")
        return Path(str(out)) if out else ctx.run_dir / f"export_{fmt}"

    def reads(self, ctx: StageContext) -> list[Path]:
        return [Path(s) for s in self._stores(ctx)]

    def writes(self, ctx: StageContext) -> list[Path]:
        return [self._output(ctx) / "README.md"]

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from kimi_pipe.stages.export import run_export

        stores = self._stores(ctx)
        if not stores:
            raise ValueError("no store to export: run an extract stage first or pass stores=[...]")
        cfg = ctx.cfg.copy()
        set_key(cfg, "stores", stores)
        set_key(cfg, "seed", int(OmegaConf.select(cfg, "seed", default=0) or 0))
        set_key(cfg, "output", str(self._output(ctx)))
        return run_export(cfg)


class ProbeStage(OutputsExist):
    """Conformance probes pinned to each provider of `sweep.providers` (a small budget of
    its own, `sweep.probe_usd`), into <run_dir>/probes: the report's conformance table."""

    name = "probe"
    settings = ("sweep", "model", "provider")

    def writes(self, ctx: StageContext) -> list[Path]:
        from kimi_pipe.reporting.data import PROBES_DIR

        return [ctx.run_dir / PROBES_DIR / "conformance.json"]

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from kimi_pipe.reporting.data import PROBES_DIR
        from kimi_pipe.stages.probe import default_battery, load_battery, run_probes

        providers = SweepStage.providers(ctx)
        probe_usd = OmegaConf.select(ctx.cfg, "sweep.probe_usd", default=None)
        overrides = [
            str(o)
            for o in OmegaConf.select(ctx.cfg, "sweep.overrides", default=None) or []
            if not str(o).lstrip("+~").startswith(("dataset", "budget"))
        ]
        battery = load_battery(default_battery(str(ctx.cfg.model.name)))
        out = ctx.run_dir / PROBES_DIR
        results = run_probes(
            providers, out, battery, None if probe_usd is None else float(probe_usd), overrides
        )
        return {
            "conformance": str(out / "conformance.md"),
            "usable": [r.provider for r in results if r.usable],
            "left_out": [r.provider for r in results if not r.usable],
        }


class SweepStage(OutputsExist):
    """One generate job per provider on the same prompts under one shared budget
    (`sweep.providers`, `sweep.n`, `sweep.usd`), then the report."""

    name = "sweep"
    settings = ("sweep", "model", "provider", "dataset", "budget", "validation")

    def writes(self, ctx: StageContext) -> list[Path]:
        return [ctx.run_dir / "report.md"]

    @staticmethod
    def providers(ctx: StageContext) -> list[str]:
        node = OmegaConf.select(ctx.cfg, "sweep", default=None)
        if node is None or not node.get("providers"):
            raise ValueError("sweep.providers=[a,b,c] is required (OpenRouter provider slugs)")
        providers = node.providers
        if isinstance(providers, str):
            return [p.strip() for p in providers.split(",") if p.strip()]
        return [str(p) for p in providers]

    def argv(self, ctx: StageContext) -> list[str]:
        node = OmegaConf.select(ctx.cfg, "sweep", default=None)
        providers = ",".join(self.providers(ctx))
        argv = [
            f"dataset={ctx.cfg.dataset.name}",
            f"providers={providers}",
            f"n={int(node.n)}",
            f"usd={float(node.usd)}",
            f"sweep_dir={ctx.run_dir}",
        ]
        if "probe" in ctx.results:  # the pipeline's probe stage ran them already
            argv.append("probes=false")
        argv += [str(o) for o in node.get("overrides") or []]
        return argv

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from kimi_pipe.stages.sweep import main as sweep_main

        argv = self.argv(ctx)
        status = sweep_main(argv)
        if status != 0:
            raise RuntimeError(f"sweep exited with status {status} (argv: {argv})")
        return {"sweep_dir": str(ctx.run_dir), "report": str(ctx.run_dir / "report.md")}


class ReportStage(OutputsExist):
    """Per-provider fidelity, cost and speed report over the run directory's runs."""

    name = "report"
    settings = ()

    def writes(self, ctx: StageContext) -> list[Path]:
        return [ctx.run_dir / "report.md", ctx.run_dir / "report.json"]

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from kimi_pipe.stages.report import build_report

        path = build_report(ctx.run_dir, ctx.run_dir)
        data = json.loads((ctx.run_dir / "report.json").read_text(encoding="utf-8"))
        return {"report": str(path), "routing": data.get("routing")}


STAGES: dict[str, type] = {
    cls.name: cls
    for cls in (
        ModelStage,
        GenerateStage,
        ReconstructStage,
        AuditStage,
        ExtractStage,
        ExportStage,
        ProbeStage,
        SweepStage,
        ReportStage,
    )  # fmt: skip
}


def resolve_stage(name: str) -> Stage:
    """A built-in stage by name, or `module:Class` for one of your own."""
    if name in STAGES:
        return STAGES[name]()  # type: ignore[no-any-return]
    module, sep, attr = name.partition(":")
    if not sep:
        raise ValueError(
            f"unknown stage {name!r}: built-in stages are {sorted(STAGES)}; "
            "your own is `module:Class`"
        )
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"stage {name!r} cannot be imported: {exc}") from exc
    stage = cls()
    if not isinstance(stage, Stage):
        raise ValueError(f"{name} does not implement the Stage protocol (name, reads, writes, "
                         "is_complete, run)")  # fmt: skip
    print(f"[run] using stage {name}", file=sys.stderr)
    return stage  # type: ignore[no-any-return]
