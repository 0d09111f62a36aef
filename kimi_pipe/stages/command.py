"""One command line for every stage over conf/, through Hydra's compose API (no sys.argv
swap, no private Hydra module), composed once per run.

`hydra_command` runs a stage that writes a run directory as a Hydra job (saved config in
`.hydra/<name>/`, `<name>.log`; `-m` through the configured launcher); `compose_command`
composes the same overrides and writes nothing. A bad override (a typo gets a did-you-mean)
and every `kimi_pipe.errors` failure is one line and exit 2; a bug keeps its traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.core.utils import run_job, setup_globals
from hydra.errors import HydraException
from hydra.types import HydraContext
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError
from yaml import YAMLError

from kimi_pipe.config import MULTIRUN, require_conf_dir, sweep_jobs
from kimi_pipe.errors import (
    EXIT_USER_ERROR,
    ConfigError,
    KimiPipeError,
    StoreError,
    host_error,
    one_line,
)
from kimi_pipe.providers.credentials import key_in_overrides
from kimi_pipe.stages import schemas  # noqa: F401 (registers the groups' schemas)
from kimi_pipe.stages.help import StageHelp, help_text
from kimi_pipe.stages.logs import close_file_logs, file_logs, log_failure, say_each_line_once

Task = Callable[[DictConfig], Any]  # the composed config in; an exit status, or a summary
NOT_COMPOSED = (HydraException, OmegaConfBaseException, YAMLError, UnicodeDecodeError)
HELP_FLAGS = ("-h", "--help")
SHOW_CONFIG = ("--cfg", "-c")  # `--cfg job|hydra|all`: print the composed config, run nothing
# Hydra's words for a key the config lacks (its hint, `+key=value`, would add it as new).
_NO_SUCH_KEY = re.compile(r"Could not override '([^']+)'|delete from config\. '([^']+)' does")
# What a value should have been, in OmegaConf's words (a schema's field).
_KINDS = {"to Float": "a number", "to Integer": "a whole number", "valid bool": "true or false"}


def override_key(override: str) -> str:
    """`key` of `key=value`, `+key=value`, `++key=value` or `~key`."""
    return override.split("=", 1)[0].lstrip("+~")


def wants_help(argv: Sequence[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


def refuse_keys(args: Sequence[str]) -> None:
    """A key on the command line is refused for every stage, before anything is composed or
    written: overrides are kept (`.hydra/`, a log, a run's plan), whatever key it is under."""
    why = key_in_overrides(list(args))
    if why:
        raise ConfigError(
            f"{why} (a run keeps its overrides in .hydra/ and its log); export the provider's "
            "key variable (e.g. OPENROUTER_API_KEY) instead"
        )


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
        error, moved = compose_error(exc, typed or overrides), moved or {}
        old = ", ".join(
            f"{k}= is now {moved[k]}=" for k in map(override_key, overrides) if k in moved
        )
        if old:
            raise ConfigError(f"bad override or config: {error} {old}") from None
        raise error from None


def compose_error(exc: BaseException, overrides: Sequence[str]) -> ConfigError:
    """A config that did not compose, in one line: a key it lacks with the settings it most
    likely meant, a value a schema refuses with what was expected, else Hydra's message."""
    cause = exc.__cause__
    if isinstance(cause, ValidationError):
        key, reason = str(cause.full_key), str(cause.msg).split("\n", 1)[0]
        given = next((o for o in overrides if override_key(o) == key), key)
        kind = next((k for words, k in _KINDS.items() if words in reason), None)
        if kind is None:
            return ConfigError(f"{given}: {reason}")
        value = OverridesParser.create().parse_override(given).value()
        return ConfigError(f"{key}={value!r}: expected {kind}")
    message = str(exc).split("\nConfig search path", 1)[0]
    found = _NO_SUCH_KEY.search(message)
    if found is None:
        return ConfigError(f"bad override or config: {message}")
    key = found.group(1) or found.group(2)
    typed = next((o for o in overrides if override_key(o) == key), key)
    # The config Hydra had composed when the key was missed (a `~key`: none, the defaults').
    node = getattr(exc.__cause__, "parent_node", None)
    with contextlib.suppress(*NOT_COMPOSED):
        node = _compose([], with_hydra=False) if node is None else node._get_root()
    keys = [k for k in setting_keys(node) if k.split(".", 1)[0] != "hydra"] if node else []
    close = did_you_mean(key, keys)
    if close:
        return ConfigError(f"{typed}: no such setting; did you mean {' or '.join(close)}?")
    return ConfigError(
        f"{typed}: no such setting (`--help` lists the stage's main ones; a key of your own "
        f"is added with +{typed.lstrip('+~')})"
    )


def setting_keys(cfg: DictConfig) -> list[str]:
    """Every key of the config, dotted (`dataset`, `dataset.limit`, ...), nothing resolved."""

    def walk(node: Any, prefix: str) -> list[str]:
        if not isinstance(node, dict):
            return []
        return [k for n, c in node.items() for k in (prefix + n, *walk(c, f"{prefix}{n}."))]

    return walk(OmegaConf.to_container(cfg, resolve=False), "")


def did_you_mean(key: str, keys: Sequence[str], most: int = 3) -> list[str]:
    """The settings `key` most likely meant: a close spelling beside it (`dataset.limt` ->
    `dataset.limit`), else a close spelling anywhere, else its name under another node (`usd`
    -> `budget.usd`, `sweep.usd`). Only the closest few, never a list of weak guesses."""
    parent, _, name = key.rpartition(".")

    def closest(wanted: str, candidates: dict[str, str], cutoff: float) -> list[str]:
        scored = sorted(
            ((difflib.SequenceMatcher(None, wanted, t).ratio(), k) for k, t in candidates.items()),
            key=lambda pair: -pair[0],
        )
        best = scored[0][0] if scored else 0.0
        return [k for ratio, k in scored if ratio >= max(cutoff, best - 0.05)][:most]

    siblings = {k: k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent}
    return (
        closest(name, siblings, 0.7)
        or closest(key, {k: k for k in keys}, 0.85)
        or [k for k in keys if k.rpartition(".")[2] == name][:most]
        or closest(name, {k: k.rpartition(".")[2] for k in keys}, 0.85)
    )


def report(exc: BaseException) -> int | None:
    """Print a user-facing failure as one line and give its exit status; None for a bug."""
    message = one_line(exc)
    if message is None:
        return None
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


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


def _helped(args: Sequence[str], help: StageHelp | None) -> bool:  # noqa: A002
    """`--help`: the stage's own help (not Hydra's dump of the whole config) printed."""
    if wants_help(args):
        usage = "usage: [group=option] [key=value ...] (Hydra overrides of conf/)"
        print(usage if help is None else help_text(help, args))
    return wants_help(args)


def compose_command(
    task: Task,
    argv: Sequence[str] | None = None,
    *,
    moved: Mapping[str, str] | None = None,
    help: StageHelp | None = None,  # noqa: A002 (the flag's name)
) -> int:
    """Compose the overrides (argv, else sys.argv[1:]) and run `task`; its exit status.
    `--help` prints `help` and runs nothing; `moved`: see `compose_overrides`."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    say_each_line_once()  # where the stage set up its logging (logging.basicConfig)
    if _helped(overrides, help):
        return 0

    def composed() -> Any:
        refuse_keys(overrides)
        return task(compose_overrides(overrides, moved))

    return _said(composed)


def remove_if_unused(fresh: Sequence[Path], name: str) -> None:
    """After a refused start: the run directory this command made (`fresh`: it, then the
    parents it made) goes, with them, if it holds only Hydra's files of the job and a lock."""
    with contextlib.suppress(OSError, IndexError):  # what cannot go stays; the error was said
        ours = {p.name for p in fresh[0].iterdir()} <= {".hydra", f"{name}.log", ".lock"}
        if ours and {p.name for p in fresh[0].glob(".hydra/*")} <= {name}:
            shutil.rmtree(fresh[0])
            for parent in fresh[1:]:
                parent.rmdir()  # only an empty one: another run may have begun beside it


class _NoCallbacks:  # hydra.callbacks: conf/ configures none (a class: submitit pickles it)
    def on_job_start(self, **_: Any) -> None: ...

    on_job_end = on_job_start


def _job(task: Task, cfg: DictConfig) -> None:
    """One Hydra job; a status other than 0 leaves as SystemExit (run_job keeps only an
    Exception, a task's bug, for its return_value to raise)."""
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


def hydra_command(
    task: Task,
    argv: Sequence[str] | None = None,
    *,
    name: str,
    help: StageHelp | None = None,  # noqa: A002 (the flag's name)
    before_launch: Callable[[list[DictConfig], list[list[str]], bool], None] | None = None,
) -> int:
    """Run `task` as the Hydra job `name` over conf/ (argv, else sys.argv[1:]).
    `before_launch(cfgs, jobs, multirun)` checks each job's composed config (with its `hydra`
    node) before Hydra writes anything. A KimiPipeError, or a write the host refuses (a full
    disk), is one line and exit 2, and takes away a run directory the failed start made that
    holds nothing else."""
    args = list(sys.argv[1:] if argv is None else argv)
    if _helped(args, help):
        return 0
    show = next((args[i + 1] for i, a in enumerate(args[:-1]) if a in SHOW_CONFIG), None)
    flags = {a for a in args if a.startswith("-")} - {*MULTIRUN, *SHOW_CONFIG, "--resolve"}
    multirun = any(a in MULTIRUN for a in args)
    overrides = [a for a in args if not a.startswith("-") and a != show]
    if not any(a.startswith("hydra.job.name=") for a in overrides):
        overrides.append(f"hydra.job.name={name}")
    fresh: list[Path] = []
    status: int | None
    try:
        refuse_keys(args)
        if any(a in SHOW_CONFIG for a in args) and show not in ("job", "hydra", "all"):
            raise ConfigError(f"--cfg {show or ''}: give --cfg job, --cfg hydra or --cfg all")
        if flags:
            raise ConfigError(
                f"{' '.join(sorted(flags))}: not a flag of this command (it takes key=value "
                "overrides, -m/--multirun, --cfg job|hydra|all [--resolve], --help)"
            )
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
        status = report(_failure(exc, overrides))
        if status is None:
            raise
    if status:
        close_file_logs()
        remove_if_unused(fresh, name)
    return status


def _failure(exc: Exception, overrides: Sequence[str]) -> BaseException:
    """The error to say of a failure around the task (a multirun's job that does not compose,
    a write to a full disk, named by the job's log directory); else `exc` (a bug)."""
    if isinstance(exc, KimiPipeError):
        return exc
    if isinstance(exc, NOT_COMPOSED) and host_error(exc, "") is None:
        return compose_error(exc, overrides)
    logs = file_logs()
    return host_error(exc, Path(logs[0].baseFilename).parent if logs else os.getcwd()) or exc
