"""One command line for every stage: Hydra overrides in, one line and exit 2 for a mistake.

A stage module's `main(argv)` is made here, over conf/ through Hydra's compose API (no
sys.argv swap, none of Hydra's private modules), the config composed once for a run:

- `hydra_command(task, argv, name=...)`: the stage runs as a Hydra job
  (`hydra.core.utils.run_job`): run directory, saved config in `.hydra/<name>/`, the log;
  `-m` runs each job of the sweep through the configured launcher (Hydra's basic one, or
  submitit's). Stages that write a run directory (generate, extract, export).
- `compose_command(task, argv)`: the same overrides composed, nothing written: stages that
  read runs and write one file or table (reconstruct, audit, report, probe, sweep).

Both check the overrides first: an unknown group option or key (with a did-you-mean), a
value of another kind than its setting's (the groups' schemas, kimi_pipe/stages/schemas.py,
else the yaml's default) is one line and exit 2, before anything is written. Every
`kimi_pipe.errors` failure raised by the task is one line and exit 2; a bug keeps its
traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
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
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException, ValidationError
from yaml import YAMLError

from kimi_pipe.config import CONF_DIR, MULTIRUN, require_conf_dir, sweep_jobs
from kimi_pipe.errors import (
    EXIT_USER_ERROR,
    ConfigError,
    KimiPipeError,
    StoreError,
    host_error,
    one_line,
)
from kimi_pipe.stages import schemas
from kimi_pipe.stages.help import StageHelp, help_text

schemas.register()  # the groups' schemas, before any compose of a command

__all__ = ["help_text"]  # re-exported: stages print their help through the command layer

# A stage's task: the composed config in; an exit status, or a summary (status 0).
Task = Callable[[DictConfig], Any]
NOT_COMPOSED = (HydraException, OmegaConfBaseException, YAMLError, UnicodeDecodeError)
HELP_FLAGS = ("-h", "--help")
SHOW_CONFIG = ("--cfg", "-c")  # `--cfg job|hydra|all`: print the composed config, run nothing


def _status(result: Any) -> int:
    return result if isinstance(result, int) else 0


def override_key(override: str) -> str:
    """`key` of `key=value`, `+key=value`, `++key=value` or `~key`."""
    return override.split("=", 1)[0].lstrip("+~")


def wants_help(argv: Sequence[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


def compose_hydra(overrides: Sequence[str], typed: Sequence[str] | None = None) -> DictConfig:
    """The config composed with its `hydra` node (inside an initialized Hydra, or one made
    for the call), every value checked; a ConfigError naming the bad override otherwise.
    `typed`: the command line as given, where `overrides` were derived from it."""
    try:
        cfg = _compose(overrides, with_hydra=True)
    except NOT_COMPOSED as exc:
        raise compose_error(exc, typed or overrides) from None
    check_value_types(cfg, overrides)
    return cfg


def _compose(overrides: Sequence[str], with_hydra: bool = False) -> DictConfig:
    """Hydra's compose, in the Hydra the command initialized (a job's), else one of its own."""
    if GlobalHydra.instance().is_initialized():
        return hydra_compose("config", overrides=list(overrides), return_hydra_config=with_hydra)
    with initialize_config_dir(config_dir=str(require_conf_dir()), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides), return_hydra_config=with_hydra)


def compose_overrides(
    overrides: Sequence[str], moved: Mapping[str, str] | None = None
) -> DictConfig:
    """The composed config a stage reads (no `hydra` node), or a ConfigError naming the bad
    override. `moved` maps a key the command took before it was a Hydra app to its config
    key, said in the message (Hydra's own hint, `+key=value`, would add a stray key)."""
    old = [override_key(o) for o in overrides if override_key(o) in (moved or {})]
    try:
        cfg = compose_hydra(overrides)
    except ConfigError as exc:
        if old and moved:
            keys = ", ".join(f"{key}= is now {moved[key]}=" for key in old)
            raise ConfigError(f"bad override or config: {exc} {keys}") from None
        raise
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


# Hydra's words for a key the config does not have (its hint, `+key=value`, would add it).
_NO_SUCH_KEY = re.compile(
    r"Could not override '([^']+)'|Could not delete from config\. '([^']+)' does not exist"
)
# OmegaConf's words for a value a schema's field cannot hold, and what was expected.
_KINDS = {"to Float": "a number", "to Integer": "a whole number", "valid bool": "true or false"}


def compose_error(exc: BaseException, overrides: Sequence[str]) -> ConfigError:
    """The ConfigError for a config that did not compose: a key the config lacks (a typo) is
    named with the settings it most likely meant, from the keys of the config composed with
    the same group choices; a value a schema refuses says what was expected; anything else
    keeps Hydra's message, on one line (without Hydra's search path)."""
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
    close = did_you_mean(key, setting_keys(_choices_only(overrides)))
    if close:
        return ConfigError(f"{typed}: no such setting; did you mean {' or '.join(close)}?")
    return ConfigError(
        f"{typed}: no such setting (`--help` lists the stage's main ones; a key of your own "
        f"is added with +{typed.lstrip('+~')})"
    )


def _choices_only(overrides: Sequence[str]) -> Any:
    """The config composed with the overrides' group choices only (`dataset=jsonl`, a
    `hydra.searchpath`), else the defaults: the keys a typo is compared with."""
    choices = [
        o
        for o in overrides
        if "=" in o
        and not o.startswith(("+", "~"))
        and ("." not in override_key(o) or override_key(o).startswith("hydra."))
        and (CONF_DIR / override_key(o)).is_dir() | override_key(o).startswith("hydra.")
    ]
    for tried in (choices, []):
        with contextlib.suppress(*NOT_COMPOSED):
            return _compose(tried)
    return OmegaConf.create({})


def setting_keys(cfg: DictConfig) -> list[str]:
    """Every key of the config, dotted (`dataset`, `dataset.limit`, ...), nothing resolved."""
    keys: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for name, child in node.items():
                keys.append(f"{prefix}{name}")
                walk(child, f"{prefix}{name}.")

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return keys


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


def _expected(default: Any, value: Any) -> str | None:
    """What a value given for a setting whose default is `default` should have been; None
    when it fits (null always does: it says "not set")."""
    if value is None or isinstance(value, str) and "${" in value:
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    if isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else "a whole number"
    if isinstance(default, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return None if ok else "a number"
    return None


def check_value_types(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """`seed=1.5`, `provider.concurrency=abc`: a value of another kind than the setting's
    default in its yaml (the group option chosen, else conf/config.yaml) is a ConfigError
    naming it, before a stage reads it deep inside. Read from the files, not composed again;
    settings whose default is null are the stage's to check, new keys (`+key=`) and
    interpolations are not checked (the schemas' groups were checked at compose)."""
    with contextlib.suppress(HydraException):
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        choices = OmegaConf.select(cfg, "hydra.runtime.choices", default={})
        for item in parsed:
            key, value = item.key_or_group, item.value()
            group, _, rest = key.partition(".")
            if (
                (CONF_DIR / key).is_dir()  # a group choice: Hydra checks it
                or key.startswith("hydra")
                or item.is_add() | item.is_force_add() | item.is_delete()
                or not isinstance(value, str | int | float | bool)
            ):
                continue
            option = CONF_DIR / group / f"{choices.get(group)}.yaml"
            path, where = (rest, option) if rest and option.is_file() else (key, None)
            default: Any = OmegaConf.to_container(OmegaConf.load(where or CONF_DIR / "config.yaml"))
            for part in path.split("."):  # as written: an interpolation is not resolved
                default = default.get(part) if isinstance(default, dict) else None
            expected = _expected(default, value)
            if expected is not None:
                raise ConfigError(
                    f"{key}={value!r}: expected {expected} (its default is {default!r})"
                )


def report(exc: BaseException) -> int | None:
    """Print a user-facing failure as one line and give its exit status; None for a bug."""
    message = one_line(exc)
    if message is None:
        return None
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def compose_command(
    task: Task,
    argv: Sequence[str] | None = None,
    *,
    usage: str | None = None,
    moved: Mapping[str, str] | None = None,
    help: StageHelp | None = None,  # noqa: A002 (the flag's name)
) -> int:
    """Compose the overrides (argv, else sys.argv[1:]) and run `task`; exit status returned.
    `-h`/`--help` prints `help` (else `usage`) and runs nothing; `moved`: see
    `compose_overrides`."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    say_each_line_once()  # where the stage set up its logging (logging.basicConfig)
    if wants_help(overrides):
        default = "usage: [group=option] [key=value ...] (Hydra overrides of conf/)"
        print(help_text(help, overrides) if help is not None else (usage or default).strip())
        return 0
    try:
        return _status(task(compose_overrides(overrides, moved)))
    except Exception as exc:
        status = report(exc)
        if status is None:
            raise
        return status


class _SaidAlready(logging.Filter):
    """On the terminal's handler of the root logger: a record that a library's own handler
    printed already (huggingface_hub's retries, `datasets`' warnings) is not printed a
    second time; the run's log file still gets it."""

    def filter(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        root = logging.getLogger()
        while logger is not None and logger is not root:
            if any(_is_terminal(h) for h in logger.handlers):
                return False
            if not logger.propagate:
                break
            logger = logger.parent
        return True


def _is_terminal(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and not isinstance(
        handler, logging.FileHandler
    )


def say_each_line_once() -> None:
    """Install `_SaidAlready` on the root logger's terminal handlers (once each)."""
    for handler in logging.getLogger().handlers:
        if _is_terminal(handler) and not any(isinstance(f, _SaidAlready) for f in handler.filters):
            handler.addFilter(_SaidAlready())


class _FileLogGuard:
    """The run's file logs (Hydra's `<name>.log` in the run directory), whose failed writes
    (a full disk) are kept here instead of the logging module's "--- Logging error ---"
    traceback on stderr: the handler is silenced and the stage ends in one line, exit 2."""

    def __init__(self) -> None:
        self.failures: list[OSError] = []
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                handler.handleError = functools.partial(self._failed, handler)  # type: ignore[method-assign]

    def _failed(self, handler: logging.FileHandler, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        failure = None if exc is None else host_error(exc, handler.baseFilename)
        if failure is None:  # a bad log call (a format error): a bug, keep its traceback
            logging.FileHandler.handleError(handler, record)
            return
        self.failures.append(failure)
        handler.setLevel(logging.CRITICAL + 1)  # nothing more to a disk that refused

    def status(self, status: int) -> int:
        """The stage's exit status, 2 (said in one line) where only its log failed."""
        if status or not self.failures:
            return status
        where = one_line(self.failures[0])
        report(StoreError(f"{where}: the run's log is incomplete (the task finished)"))
        return EXIT_USER_ERROR


def _fresh_dirs(where: Path) -> list[Path]:
    """`where` and those of its parents that do not exist yet, deepest first."""
    fresh, where = [], where.absolute()
    while not where.exists() and where != where.parent:
        fresh.append(where)
        where = where.parent
    return fresh


def remove_if_unused(fresh: Sequence[Path], name: str) -> None:
    """After a refused start: a run directory this command made that holds only what Hydra
    wrote for it (`.hydra/<name>/`, `<name>.log`) and the run's lock goes, with the parents
    it made; anything else in it keeps it."""
    if not fresh:
        return
    run_dir = fresh[0]
    hydra_dir = run_dir / ".hydra"
    ours = {".hydra", f"{name}.log", ".lock"}
    try:
        if not run_dir.is_dir() or not {p.name for p in run_dir.iterdir()} <= ours:
            return
        if hydra_dir.exists() and {p.name for p in hydra_dir.iterdir()} - {name}:
            return
        shutil.rmtree(run_dir)
        for parent in fresh[1:]:
            parent.rmdir()  # only an empty one: another run may have begun beside it
    except OSError:
        return  # what could not go stays; the error said is the start's own


class _NoCallbacks:
    """Hydra's job callbacks (`hydra.callbacks`; conf/ configures none): run_job and the
    launchers call these hooks around each job, with nothing to do in them here."""

    def on_job_start(self, *args: Any, **kwargs: Any) -> None:
        return None

    def on_job_end(self, *args: Any, **kwargs: Any) -> None:
        return None


def _job(task: Task, cfg: DictConfig) -> None:
    """One Hydra job's task: its summary, or a mistake said in one line; a status other
    than 0 leaves as SystemExit (Hydra's run_job keeps an Exception, not a SystemExit)."""
    logs = _FileLogGuard()  # run_job opened the job's log before calling the task
    say_each_line_once()
    try:
        status = _status(task(cfg))
    except Exception as exc:
        status_or_none = report(exc)
        if status_or_none is None:
            raise
        status = status_or_none
    status = logs.status(status)
    if status:
        raise SystemExit(status)


def _run(task: Task, cfg: DictConfig, jobs: list[list[str]], multirun: bool) -> None:
    """Run the composed job (or launch each of a multirun's) as Hydra's own entry does."""
    setup_globals()
    context = HydraContext(
        config_loader=GlobalHydra.instance().config_loader(),
        callbacks=_NoCallbacks(),  # type: ignore[arg-type]
    )
    job = functools.partial(_job, task)
    if not multirun:
        _ = run_job(job, cfg, "hydra.run.dir", None, hydra_context=context).return_value
        return  # (return_value raises a task's bug, with its traceback)
    launcher = Plugins.instance().instantiate_launcher(
        hydra_context=context, task_function=job, config=cfg
    )
    for done in launcher.launch(jobs, initial_job_idx=0):
        _ = done.return_value  # a job's bug raised here, with its traceback


def hydra_command(
    task: Task,
    argv: Sequence[str] | None = None,
    *,
    name: str,
    help: StageHelp | None = None,  # noqa: A002 (the flag's name)
    before_launch: Callable[[DictConfig, list[list[str]], bool], None] | None = None,
) -> int:
    """Run `task` as the Hydra job `name` over conf/ (argv, else sys.argv[1:]).

    `name` is Hydra's job name: the saved config goes to `.hydra/<name>/` and the log to
    `<name>.log` in the run directory, whatever module holds the task. A write that fails
    on the host (a full disk: the saved config, the log) is one line and exit 2 too. A run
    that fails leaves no run directory of Hydra's files alone behind (the directories its
    run directory needs, known from the composed config before any is made).
    `before_launch(cfg, jobs, multirun)` checks the composed config before Hydra writes
    anything; its KimiPipeError or OSError is one line, exit 2, and the directories made are
    taken away again."""
    args = list(sys.argv[1:] if argv is None else argv)
    fresh: list[Path] = []
    if help is not None and wants_help(args):  # not Hydra's dump of the whole config
        print(help_text(help, args))
        return 0
    show = next((args[i + 1] for i, a in enumerate(args[:-1]) if a in SHOW_CONFIG), None)
    flags = {a for a in args if a.startswith("-")} - {*MULTIRUN, *SHOW_CONFIG, "--resolve"}
    multirun = any(a in MULTIRUN for a in args)
    overrides = [a for a in args if not a.startswith("-") and a != show]
    if not any(a.startswith("hydra.job.name=") for a in overrides):
        overrides.append(f"hydra.job.name={name}")
    status = 0
    try:
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
            cfg = compose_hydra([*jobs[0], *mode], typed=overrides)  # before anything is written
            fresh = [] if multirun else _fresh_dirs(Path(str(cfg.hydra.run.dir)))
            if show is not None:
                shown = cfg.hydra if show == "hydra" else cfg
                if show == "job":
                    with open_dict(cfg):
                        del cfg["hydra"]
                print(OmegaConf.to_yaml(shown, resolve="--resolve" in args), end="")
                return 0
            if before_launch is not None:
                try:
                    before_launch(cfg, jobs, multirun)
                except (KimiPipeError, OSError) as exc:
                    status = report(exc) or 0
                    if not status:
                        raise
            if not status:
                _run(task, cfg, jobs, multirun)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (1 if exc.code else 0)
    except Exception as exc:
        failure = exc if isinstance(exc, ConfigError) else _hydra_failure(exc, overrides)
        status_or_none = None if failure is None else report(failure)
        if status_or_none is None:
            raise
        status = status_or_none
    if status:
        _close_file_logs()
        remove_if_unused(fresh, name)
    return status


def _hydra_failure(exc: Exception, overrides: Sequence[str]) -> Exception | None:
    """A failure raised by Hydra around the task (a sweep's job that does not compose, a
    write to a full disk) as the error to say; None for a bug."""
    if isinstance(exc, NOT_COMPOSED) and host_error(exc, "") is None:
        return compose_error(exc, overrides)
    return host_error(exc, _hydra_writes())


def _hydra_writes() -> str:
    """Where the Hydra job that failed writes: the directory of the log Hydra opened for it
    (its run directory) before saving its config; else the cwd."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return str(Path(handler.baseFilename).parent)
    return os.getcwd()


def _close_file_logs() -> None:
    """Hydra's log of the job, closed (and taken off the root logger) before its directory
    may go."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            with contextlib.suppress(OSError):  # a full disk: said already (_FileLogGuard)
                handler.close()
