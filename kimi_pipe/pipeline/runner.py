"""The generic runner: `python -m kimi_pipe run pipeline=NAME [overrides ...]`.

A pipeline is `conf/pipeline/NAME.yaml`: group choices for the whole job (model, provider,
dataset, ...) and `pipeline.stages`, an ordered list of `{stage: NAME, overrides: {key: value}}`.
NAME is a built-in stage (`pipeline.registry`) or `module:Class` for your own. The runner

- takes an exclusive lock on the run directory (a second runner exits 2 naming the holder),
- skips a stage whose completion marker matches the config and whose outputs are complete,
- re-runs any other stage (every stage resumes its own half-done work after a crash),
- times each stage and prints one summary: what ran, what was skipped, where outputs are.

Markers live in `<run_dir>/.pipeline/<stage>.json`; they hold the stage's summary, so a later
stage (and the final summary) can read the result of a stage that was skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from kimi_pipe.config import CONF_DIR
from kimi_pipe.errors import EXIT_FAILED, KimiPipeError, one_line
from kimi_pipe.pipeline.registry import resolve_stage
from kimi_pipe.pipeline.stage import Stage, StageContext
from kimi_pipe.stages.command import compose_command
from kimi_pipe.stages.help import HELP
from kimi_pipe.store import atomic
from kimi_pipe.store.run_lock import LOCK, RunDirLocked, RunLock

MARKER_DIR = ".pipeline"
RUN_SUMMARY = "pipeline_summary.json"

log = logging.getLogger("kimi_pipe.run")


class PipelineError(KimiPipeError, RuntimeError):
    """The pipeline cannot go on; the message names the stage and where to look."""


class RunDirBusy(PipelineError):
    """Another runner holds the run directory."""


@dataclass
class StageOutcome:
    name: str
    status: str  # "ran" | "skipped" | "failed"
    seconds: float
    writes: list[Path]
    result: dict[str, Any] | None = None
    error: str | None = None
    token: str | None = None  # this run of the stage (from its marker when skipped)
    # The failure was the user's to fix (a kimi_pipe.errors class, a missing input): the
    # command says it as one line and exits 2, like a stage run alone.
    user_error: bool = False


@dataclass
class PipelineRun:
    name: str
    cfg: DictConfig
    run_dir: Path
    outcomes: list[StageOutcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def results(self) -> dict[str, dict[str, Any]]:
        return {o.name: o.result for o in self.outcomes if o.result is not None}

    @property
    def ok(self) -> bool:
        return all(o.status != "failed" for o in self.outcomes)


@dataclass(frozen=True)
class StageSpec:
    """One entry of `pipeline.stages`."""

    name: str
    stage: Stage
    overrides: dict[str, Any]


def stage_specs(cfg: DictConfig) -> list[StageSpec]:
    entries = OmegaConf.select(cfg, "pipeline.stages", default=None)
    if not entries:
        raise PipelineError(
            "no stages: pick a pipeline (pipeline=demo, pipeline=openrouter_sglang, "
            "pipeline=sweep; the files are conf/pipeline/*.yaml)"
        )
    specs: list[StageSpec] = []
    for i, entry in enumerate(entries):
        overrides: Any
        if isinstance(entry, str):
            kind, overrides, name = entry, {}, None
        else:
            kind = entry.get("stage")
            raw = entry.get("overrides")
            overrides = {} if raw is None else OmegaConf.to_container(raw, resolve=False)
            name = entry.get("name")
        if not kind:
            raise PipelineError(f"pipeline.stages[{i}] has no `stage:` name")
        try:
            stage = resolve_stage(str(kind))
        except ValueError as exc:
            raise PipelineError(f"pipeline.stages[{i}]: {exc}") from None
        if name:
            stage.name = str(name)
        if not isinstance(overrides, dict):
            raise PipelineError(f"pipeline.stages[{i}].overrides must map keys to values")
        specs.append(StageSpec(stage.name, stage, overrides))  # type: ignore[arg-type]
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PipelineError(f"stage names repeat in the pipeline: {dup} (give each a name:)")
    return specs


def stage_config(cfg: DictConfig, overrides: dict[str, Any]) -> DictConfig:
    """The composed config with one stage's overrides applied (the original is untouched)."""
    staged = cfg.copy()
    with open_dict(staged):
        for key, value in overrides.items():
            OmegaConf.update(staged, key, value, force_add=True)
    return staged


def fingerprint(stage: Stage, cfg: DictConfig, upstream: Sequence[str]) -> str:
    """Identity of a stage's work: its settings (the config keys it declares in `settings`,
    else the whole config but the stage list) and the runs of the stages before it. A changed
    setting, or an earlier stage that ran again, makes its marker stale."""
    keys = getattr(stage, "settings", None)
    if keys is None:
        plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        if isinstance(plain, dict):
            plain.pop("pipeline", None)
    else:
        plain = {}
        for key in keys:
            node = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
            plain[key] = (
                OmegaConf.to_container(node, resolve=True, throw_on_missing=False)
                if OmegaConf.is_config(node)
                else node
            )
    text = json.dumps([plain, list(upstream)], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _marker(run_dir: Path, name: str) -> Path:
    return run_dir / MARKER_DIR / f"{name}.json"


def read_marker(run_dir: Path, name: str) -> dict[str, Any] | None:
    path = _marker(run_dir, name)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # absent or torn: the stage is simply not known to be complete
    return data if isinstance(data, dict) else None


def write_marker(run_dir: Path, name: str, data: dict[str, Any]) -> None:
    path = _marker(run_dir, name)
    # A kill leaves the old marker or the new one, never half of one.
    atomic.write_json(path, data, indent=1, default=str)


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """One runner per run directory (`store.run_lock`, in `.pipeline/`: the generate stage
    holds its own lock on the run directory while it runs inside the pipeline)."""
    try:
        lock = RunLock(run_dir / MARKER_DIR).acquire()
    except RunDirLocked as exc:
        raise RunDirBusy(str(exc)) from None
    try:
        yield
    finally:
        lock.release()


def run_pipeline(cfg: DictConfig, *, say: Any = None) -> PipelineRun:
    """Run every stage of `cfg.pipeline` in order; stop at the first failure."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    name = str(OmegaConf.select(cfg, "pipeline.name", default="pipeline"))
    for key, value in (OmegaConf.select(cfg, "pipeline.env", default=None) or {}).items():
        os.environ.setdefault(str(key), str(value))
    specs = stage_specs(cfg)
    run_dir = Path(str(OmegaConf.select(cfg, "pipeline.run_dir", default=None) or cfg.output_dir))
    run_dir = run_dir.resolve()
    fresh = [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # deepest first
    (run_dir / MARKER_DIR).mkdir(parents=True, exist_ok=True)
    run = PipelineRun(name, cfg, run_dir)
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    upstream: list[str] = []  # run tokens of the stages so far: a re-run invalidates later ones
    with run_dir_lock(run_dir):
        for i, spec in enumerate(specs, start=1):
            ctx = StageContext(stage_config(cfg, spec.overrides), run_dir, results)
            outcome = _run_one(spec, ctx, f"[{i}/{len(specs)}]", say, upstream)
            run.outcomes.append(outcome)
            if outcome.result is not None:
                results[spec.name] = outcome.result
            if outcome.status == "failed":
                break
            upstream.append(outcome.token or "")
    run.seconds = time.monotonic() - started
    if fresh and all(o.status == "failed" for o in run.outcomes) and _only_the_lock(run_dir):
        _remove(fresh)  # a refused start: no empty run directory left behind
    else:
        _write_summary(run)
    return run


def _only_the_lock(run_dir: Path) -> bool:
    """The run directory holds nothing but the runner's own `.pipeline/` with its lock."""
    try:
        return [p.name for p in run_dir.iterdir()] == [MARKER_DIR] and {
            p.name for p in (run_dir / MARKER_DIR).iterdir()
        } <= {LOCK}
    except OSError:
        return False


def _remove(fresh: Sequence[Path]) -> None:
    """The directories this run made (deepest first), each only while it is empty: another
    run may have begun beside it."""
    with contextlib.suppress(OSError):  # what cannot go stays; the run's error is said
        for left in (fresh[0] / MARKER_DIR).iterdir():
            left.unlink()  # the lock's file (released)
        (fresh[0] / MARKER_DIR).rmdir()
        for directory in fresh:
            directory.rmdir()


def _run_one(
    spec: StageSpec, ctx: StageContext, tag: str, say: Any, upstream: Sequence[str]
) -> StageOutcome:
    stage, name = spec.stage, spec.name
    writes = _paths(stage.writes, ctx)
    marker = read_marker(ctx.run_dir, name)
    print_ = fingerprint(stage, ctx.cfg, upstream)
    if marker and marker.get("fingerprint") == print_ and stage.is_complete(ctx):
        note_of = getattr(stage, "complete_note", None)
        note = note_of(ctx) if note_of else ""
        say(f"== {tag} {name}: complete, skipped" + (f": {note}" if note else ""))
        result = marker.get("result") or {}
        return StageOutcome(name, "skipped", 0.0, writes, result, token=marker.get("token"))
    missing = [p for p in _paths(stage.reads, ctx) if not p.exists()]
    if missing:
        why = f"needs {', '.join(map(str, missing))}, which does not exist"
        say(f"== {tag} {name}: cannot start: {why}")
        return StageOutcome(name, "failed", 0.0, writes, None, why, user_error=True)
    why_rerun = "" if marker is None else " (settings changed)" if marker.get(
        "fingerprint") != print_ else " (outputs incomplete)"  # fmt: skip
    say(f"== {tag} {name}: running{why_rerun}")
    started = time.monotonic()
    try:
        result = stage.run(ctx)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # one failed stage ends the pipeline with its reason, not a trace
        log.debug("stage %s failed", name, exc_info=True)
        mistake = one_line(exc)
        seconds = time.monotonic() - started
        if mistake is not None:  # said once, as the command's `error:` line
            say(f"== {tag} {name}: failed after {seconds:.1f}s")
            return StageOutcome(name, "failed", seconds, writes, None, mistake, user_error=True)
        why = f"{type(exc).__name__}: {exc}"
        say(f"== {tag} {name}: failed after {seconds:.1f}s: {why}")
        return StageOutcome(name, "failed", seconds, writes, None, why)
    seconds = time.monotonic() - started
    result = json.loads(json.dumps(result or {}, default=str))  # what the marker will hold
    token = uuid.uuid4().hex
    write_marker(ctx.run_dir, name, {
        "stage": name, "token": token, "fingerprint": print_, "seconds": round(seconds, 3),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "result": result,
    })  # fmt: skip
    say(f"== {tag} {name}: done in {seconds:.1f}s")
    return StageOutcome(name, "ran", seconds, _paths(stage.writes, ctx), result, token=token)


def _paths(fn: Any, ctx: StageContext) -> list[Path]:
    try:
        return [Path(p) for p in fn(ctx)]
    except Exception:  # a path that needs an earlier result that is not there yet
        return []


def _write_summary(run: PipelineRun) -> None:
    data = {
        "pipeline": run.name,
        "run_dir": str(run.run_dir),
        "ok": run.ok,
        "seconds": round(run.seconds, 3),
        "stages": [
            {"stage": o.name, "status": o.status, "seconds": round(o.seconds, 3),
             "writes": [str(p) for p in o.writes], "error": o.error}
            for o in run.outcomes
        ],
    }  # fmt: skip
    path = run.run_dir / RUN_SUMMARY
    atomic.write_json(path, data, indent=2)


def stage_table(run: PipelineRun) -> str:
    rows = [("stage", "status", "time", "outputs")]
    for o in run.outcomes:
        # A failed stage's reason is said once, in its own line (the `error:` line of a
        # mistake, the stage's "failed after" line otherwise), not again in the table;
        # outputs it did not finish are not listed as if they were there.
        failed = o.error is not None
        shown = "-" if failed else ", ".join(str(p) for p in o.writes) or "-"
        status = "failed" if failed else o.status
        rows.append((o.name, status, f"{o.seconds:.1f}s", shown))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = []
    for j, r in enumerate(rows):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True))
                     + " | " + r[3] + " |")  # fmt: skip
        if j == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|---|")
    return "\n".join(lines)


def _summary_hook(cfg: DictConfig) -> Any:
    """`pipeline.summary: module:function` prints a pipeline's own tables (the demo's)."""
    spec = OmegaConf.select(cfg, "pipeline.summary", default=None)
    if not spec:
        return None
    module, _, attr = str(spec).partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise PipelineError(f"pipeline.summary={spec} cannot be imported: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    overrides = list(sys.argv[1:] if argv is None else argv)

    def pipeline_task(cfg: DictConfig) -> int:
        hook = _summary_hook(cfg)
        run = run_pipeline(cfg)
        print_run(run, hook)
        raise_user_error(run)
        return 0 if run.ok else EXIT_FAILED

    return compose_command(pipeline_task, overrides, help=HELP["run"])


def raise_user_error(run: PipelineRun) -> None:
    """A stage stopped by the user's mistake: raised as one line (exit 2), as that stage
    run alone would say it."""
    failed = next((o for o in run.outcomes if o.status == "failed"), None)
    if failed is not None and failed.user_error:
        raise PipelineError(f"stage {failed.name}: {failed.error}")


def print_run(run: PipelineRun, hook: Any = None) -> None:
    """The closing summary: one line, the stage table, then the pipeline's own tables."""
    print(
        f"\nkimi_pipe {run.name}: {'done' if run.ok else 'STOPPED'} in {run.seconds:.0f}s "
        f"(run directory {run.run_dir}; {RUN_SUMMARY})"
    )
    print(stage_table(run))
    if hook is not None and run.ok:
        print()
        hook(run)


def available_pipelines() -> list[str]:

    return sorted(p.stem for p in (CONF_DIR / "pipeline").glob("*.yaml"))
