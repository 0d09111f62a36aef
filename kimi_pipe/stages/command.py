"""One command line for every stage over conf/, on Hydra's compose API (no sys.argv swap, no
private Hydra module), composed once per run: `compose_command(task, name=...)` runs the stage
as a Hydra job (`.hydra/<name>/`, `<name>.log`, `-m` through the configured launcher); with no
name it composes and writes nothing. A key among the overrides is refused first; a bad override
(with a did-you-mean: config_errors.py) and every `kimi_pipe.errors` failure is one line and
exit 2; a bug keeps its traceback."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.plugins import Plugins
from hydra.core.utils import run_job, setup_globals
from hydra.types import HydraContext
from omegaconf import DictConfig, OmegaConf

from kimi_pipe.config import MULTIRUN, require_conf_dir, sweep_jobs
from kimi_pipe.errors import (
    EXIT_USER_ERROR,
    ConfigError,
    KimiPipeError,
    StoreError,
    host_error,
    one_line,
)
from kimi_pipe.providers.credentials import refuse_keys_in_overrides
from kimi_pipe.stages import schemas  # noqa: F401 (registers the groups' schemas)
from kimi_pipe.stages.config_errors import NOT_COMPOSED, compose_error, override_key
from kimi_pipe.stages.help import StageHelp, help_text
from kimi_pipe.stages.logs import close_file_logs, file_logs, log_failure, say_each_line_once
from kimi_pipe.store.run_dir import remove_if_unused

Task = Callable[[DictConfig], Any]  # the composed config in; an exit status, or a summary
SHOW_CONFIG = ("--cfg", "-c")  # `--cfg job|hydra|all`: print the composed config, run nothing
JOB_FLAGS = (*MULTIRUN, *SHOW_CONFIG, "--resolve")  # a Hydra job's flags besides --help
USAGE = "usage: [group=option] [key=value ...] (Hydra overrides of conf/)"  # a stage's: help.py


def _compose(overrides: Sequence[str], with_hydra: bool) -> DictConfig:
    """Hydra's compose, in the Hydra the command initialized (a job's), else one of its own."""
    if GlobalHydra.instance().is_initialized():
        return hydra_compose("config", overrides=list(overrides), return_hydra_config=with_hydra)
    with initialize_config_dir(config_dir=str(require_conf_dir()), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides), return_hydra_config=with_hydra)


def compose_overrides(
    overrides: Sequence[str],
    moved: Mapping[str, str] | None = None,
    *,
    typed: Sequence[str] | None = None,
    with_hydra: bool = False,
) -> DictConfig:
    """The composed config (its `hydra` node only `with_hydra`), every value checked by the
    schemas; else a ConfigError naming the override (`typed`: the command line `overrides`
    came from). `moved`: a key the command took before it was a Hydra app -> its config key."""
    try:
        return _compose(overrides, with_hydra)
    except NOT_COMPOSED as exc:
        error, moved = compose_error(exc, typed or overrides, _compose), moved or {}
        old = ", ".join(
            f"{k}= is now {moved[k]}=" for k in map(override_key, overrides) if k in moved
        )
        if old:
            raise ConfigError(f"bad override or config: {error} {old}") from None
        raise error from None


def report(exc: BaseException) -> int | None:
    """Print a user-facing failure as one line and give its exit status; None for a bug."""
    message = one_line(exc)
    if message is not None:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return None if message is None else EXIT_USER_ERROR


def _said(call: Callable[[], Any]) -> int:
    """`call`'s exit status (a summary: 0); a user-facing failure said in one line."""
    try:
        result = call()
    except Exception as exc:
        status = report(exc)
        if status is None:
            raise
        return status
    return result if isinstance(result, int) else 0


def _overrides(args: Sequence[str], show: str | None, job: bool) -> list[str]:
    """The command line's overrides, once no key is among them and every flag is taken (a
    Hydra `job`'s: JOB_FLAGS); else a ConfigError."""
    refuse_keys_in_overrides(args)
    flags = {a for a in args if a.startswith("-")} - set(JOB_FLAGS if job else ())
    if job and any(a in SHOW_CONFIG for a in args) and show not in ("job", "hydra", "all"):
        raise ConfigError(f"--cfg {show or ''}: give --cfg job, --cfg hydra or --cfg all")
    if flags:
        takes = "-m/--multirun, --cfg job|hydra|all [--resolve], --help" if job else "--help"
        raise ConfigError(
            f"{' '.join(sorted(flags))}: not a flag of this command (it takes key=value "
            f"overrides, {takes})"
        )
    return [a for a in args if not a.startswith("-") and a != show]


class _NoCallbacks:  # hydra.callbacks: conf/ configures none (a class: submitit pickles it)
    def on_job_start(self, **_: Any) -> None: ...

    on_job_end = on_job_start


def _job(task: Task, cfg: DictConfig) -> None:
    """One Hydra job; a status other than 0 leaves as SystemExit (run_job keeps a bug's)."""
    say_each_line_once()
    status, failure = _said(lambda: task(cfg)), log_failure()
    if failure is not None and not status:
        report(StoreError(f"{one_line(failure)}: the run's log is incomplete (the task finished)"))
        status = EXIT_USER_ERROR
    if status:
        raise SystemExit(status)


def _run(task: Task, cfg: DictConfig, jobs: list[list[str]], multirun: bool) -> None:
    """Run the composed job, or launch each of a multirun's, as Hydra's own entry does."""
    setup_globals()
    callbacks: Any = _NoCallbacks()
    context = HydraContext(GlobalHydra.instance().config_loader(), callbacks)
    job = functools.partial(_job, task)
    if multirun:
        launcher = Plugins.instance().instantiate_launcher(
            hydra_context=context, task_function=job, config=cfg
        )
        returns = launcher.launch(jobs, initial_job_idx=0)
    else:
        returns = [run_job(job, cfg, "hydra.run.dir", None, hydra_context=context)]
    for done in returns:
        _ = done.return_value  # a job's bug raised here, with its traceback


def compose_command(
    task: Task,
    argv: Sequence[str] | None = None,
    *,
    name: str | None = None,
    help: StageHelp | None = None,  # noqa: A002 (the flag's name)
    moved: Mapping[str, str] | None = None,
    before_launch: Callable[[list[DictConfig], list[list[str]], bool], None] | None = None,
) -> int:
    """Run `task` on conf/ composed with the overrides (argv, else sys.argv[1:]); its exit
    status (`--help`: `help` printed). `moved`: see compose_overrides. As the Hydra job `name`,
    `before_launch(cfgs, jobs, multirun)` checks each job's config (with its `hydra` node)
    before Hydra writes anything; a failed start takes away a run directory it made, never used."""
    args = list(sys.argv[1:] if argv is None else argv)
    say_each_line_once()  # where the stage set up its logging (logging.basicConfig)
    if any(a in ("-h", "--help") for a in args):  # the stage's own, not Hydra's config dump
        print(USAGE if help is None else help_text(help, args))
        return 0
    if name is None:
        return _said(lambda: task(compose_overrides(_overrides(args, None, job=False), moved)))
    show = next((args[i + 1] for i, a in enumerate(args[:-1]) if a in SHOW_CONFIG), None)
    multirun = any(a in MULTIRUN for a in args)
    fresh: list[Path] = []
    status: int | None
    try:
        overrides = _overrides(args, show, job=True)
        if not any(a.startswith("hydra.job.name=") for a in overrides):
            overrides.append(f"hydra.job.name={name}")
        jobs = sweep_jobs([*MULTIRUN[:1], *overrides] if multirun else overrides)
        mode = ["hydra.mode=MULTIRUN"] if multirun else []
        with initialize_config_dir(str(require_conf_dir()), version_base="1.3", job_name=name):
            # Composed before anything is written, with the `hydra` node: the job, or each
            # of a multirun's where `before_launch` checks them (the launcher composes its own).
            checked = jobs if before_launch else jobs[:1]
            cfgs = [
                compose_overrides([*j, *mode], typed=overrides, with_hydra=True) for j in checked
            ]
            cfg = cfgs[0]
            if show is not None:
                job = OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"])
                shown = {"job": job, "hydra": cfg.hydra, "all": cfg}[show]
                print(OmegaConf.to_yaml(shown, resolve="--resolve" in args), end="")
                return 0
            if not multirun:  # the directories its run directory needs, before any is made
                run_dir = Path(str(cfg.hydra.run.dir)).absolute()
                fresh = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
            if before_launch is not None:
                before_launch(cfgs, jobs, multirun)
            _run(task, cfg, jobs, multirun)
        return 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (1 if exc.code else 0)
    except Exception as exc:
        status = report(_failure(exc, args))
        if status is None:
            raise
    if status:
        close_file_logs()
        remove_if_unused(fresh, name)
    return status


def _failure(exc: Exception, overrides: Sequence[str]) -> BaseException:
    """What to say of a failure around the task (a job that does not compose, a full disk)."""
    if isinstance(exc, KimiPipeError):
        return exc
    if isinstance(exc, NOT_COMPOSED) and host_error(exc, "") is None:
        return compose_error(exc, overrides, _compose)
    logs = file_logs()
    return host_error(exc, Path(logs[0].baseFilename).parent if logs else os.getcwd()) or exc
