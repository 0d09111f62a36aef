"""One command line for every stage: Hydra overrides in, one line and exit 2 for a mistake.

A stage module exposes `run_stage(cfg, run_dir) -> summary` and a `main()` made here:

- `hydra_command(task)`: the stage runs as a Hydra app (`@hydra.main` over `conf/`): run
  directory, saved config in `.hydra/<stage>/`, `--multirun` sweeps. Used by stages that
  write a run directory (generate, extract, export).
- `compose_command(task, argv)`: the same overrides composed without a Hydra job (no
  `.hydra/` written): stages that read runs and write one file or table (reconstruct,
  audit, report, probe, sweep). A stage's own settings are a config group
  (`conf/<stage>/default.yaml`: `audit.*`, `probe.*`, `sweep.*`, `report.*`), read
  through `kimi_pipe.config.node_settings` (typed: a wrong value is one line, exit 2).

Both check the overrides first (an unknown group option or key is one line, exit 2, not
Hydra's traceback or exit 1), and turn every `kimi_pipe.errors` failure raised by the task
into one line and exit 2. A bug keeps its traceback.
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
import textwrap
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hydra
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException, ValidationError
from yaml import YAMLError

from kimi_pipe.config import CONF_DIR, compose, sweep_jobs
from kimi_pipe.errors import EXIT_USER_ERROR, ConfigError, StoreError, host_error, one_line
from kimi_pipe.stages import schemas
from kimi_pipe.stages.help import StageHelp

# Hydra flags that do not run the task, or run it as a sweep (its overrides are sweep
# syntax that a plain compose rejects).
_NOT_A_SINGLE_RUN = {"-m", "--multirun", "-h", "--help", "--hydra-help", "--info", "-i",
                     "--cfg", "-c", "--resolve", "--package", "-p", "--shell-completion",
                     "-sc", "--version", "--config-path", "-cp", "--config-name", "-cn",
                     "--config-dir", "-cd", "--experimental-rerun"}  # fmt: skip

schemas.register()  # the groups' schemas, before any compose of a command

HYDRA_FULL_ERROR = "HYDRA_FULL_ERROR"
_MULTIRUN = {"-m", "--multirun"}

# A stage's task: the composed config in; an exit status, or a summary (status 0).
Task = Callable[[DictConfig], Any]


def _status(result: Any) -> int:
    return result if isinstance(result, int) else 0


def override_key(override: str) -> str:
    """`key` of `key=value`, `+key=value`, `++key=value` or `~key`."""
    return override.split("=", 1)[0].lstrip("+~")


def compose_overrides(
    overrides: Sequence[str],
    moved: Mapping[str, str] | None = None,
    typed: Sequence[str] | None = None,
) -> DictConfig:
    """The composed config, or a ConfigError naming the bad override. `moved` maps a key the
    command took before it was a Hydra app to its config key, said in the message; `typed`:
    the command line as given, where `overrides` were derived from it (a multirun's job)."""

    try:
        cfg = compose(list(overrides))
    except (HydraException, OmegaConfBaseException, YAMLError, UnicodeDecodeError) as exc:
        # Hydra appends its search path to a missing group option: noise on one line.
        message = str(exc).split("\nConfig search path", 1)[0]
        old = [o for o in overrides if override_key(o) in (moved or {})]
        if old and moved:  # Hydra's own hint (`+key=value`) would add a stray key
            message = (
                message.split("\n", 1)[0]
                + " "
                + ", ".join(f"{override_key(o)}= is now {moved[override_key(o)]}=" for o in old)
            )
            raise ConfigError(f"bad override or config: {message}") from None
        if isinstance(exc.__cause__, ValidationError):  # a group schema refused the value
            raise wrong_type(exc.__cause__, overrides) from None
        raise override_error(message, typed or overrides) from None
    check_value_types(overrides)
    return cfg


# OmegaConf's words for a value a schema's field cannot hold, and what was expected.
_KINDS = {"to Float": "a number", "to Integer": "a whole number", "valid bool": "true or false"}


def wrong_type(exc: ValidationError, overrides: Sequence[str]) -> ConfigError:
    """A value of the wrong kind for a schema's field, said as the type check says it:
    `budget.usd='abc': expected a number`."""
    key = str(exc.full_key)
    reason = str(exc.msg).split("\n", 1)[0]
    expected = next((kind for words, kind in _KINDS.items() if words in reason), None)
    given = next((o for o in overrides if override_key(o) == key), key)
    if expected is None:
        return ConfigError(f"{given}: {reason}")
    value = OverridesParser.create().parse_override(given).value()
    return ConfigError(f"{key}={value!r}: expected {expected}")


# Hydra's words for a key the config does not have (its hint, `+key=value`, would add it).
_NO_SUCH_KEY = re.compile(
    r"Could not override '([^']+)'|Could not delete from config\. '([^']+)' does not exist"
)


def override_error(message: str, overrides: Sequence[str]) -> ConfigError:
    """The ConfigError for a config that did not compose: a key the config lacks (a typo) is
    named with the settings it most likely meant, from the keys of the config composed with
    the same group choices; anything else keeps Hydra's message, on one line."""
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


def _choices_only(overrides: Sequence[str]) -> DictConfig:
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
        try:
            return compose(tried)
        except (HydraException, OmegaConfBaseException, YAMLError, UnicodeDecodeError):
            continue
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
            (
                (difflib.SequenceMatcher(None, wanted, text).ratio(), k)
                for k, text in candidates.items()
            ),
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


def check_value_types(overrides: Sequence[str]) -> None:
    """`budget.usd=abc`, `seed=1.5`, `sweep.probes=maybe`: a value of another kind than the
    setting's default (a number, a whole number, true/false) is a ConfigError naming it,
    before a stage reads it deep inside. Settings whose default is null are the stage's to
    check; new keys (`+key=`) and interpolations are not checked."""

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return  # compose said it already
    values = [
        o
        for o in parsed
        if not (CONF_DIR / o.key_or_group).is_dir()  # a group choice: Hydra checks it
        and not o.key_or_group.startswith("hydra")
        and not (o.is_add() or o.is_force_add() or o.is_delete() or o.is_sweep_override())
        and isinstance(o.value(), str | int | float | bool)
    ]
    if not values:
        return
    # The defaults of the same groups: the choices and Hydra settings without the values.
    base = compose([str(o.input_line) for o in parsed if o not in values])
    for item in values:
        try:
            default = OmegaConf.select(base, item.key_or_group, throw_on_missing=False)
        except OmegaConfBaseException:
            continue
        expected = _expected(default, item.value())
        if expected is not None:
            raise ConfigError(
                f"{item.key_or_group}={item.value()!r}: expected {expected} "
                f"(its default is {default!r})"
            )


def first_job(argv: Sequence[str]) -> list[str]:
    """The overrides of the command's first job (a multirun's sweeps at their first values):
    the keys a typo names are the same in every job, so this one composes as they all would."""
    try:
        return sweep_jobs(argv)[0]
    except HydraException:
        return [a for a in argv if not a.startswith("-")]  # compose says what is wrong


def report(exc: BaseException) -> int | None:
    """Print a user-facing failure as one line and give its exit status; None for a bug."""
    message = one_line(exc)
    if message is None:
        return None
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


HELP_FLAGS = ("-h", "--help")


def wants_help(argv: Sequence[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


def help_text(stage: StageHelp, argv: Sequence[str] = ()) -> str:
    """`--help`: what the stage does, its main settings with the values they have with the
    other arguments given (`generate dataset=B5 --help` shows B5's), and two examples."""
    overrides = [a for a in argv if not a.startswith("-")]
    cfg = OmegaConf.create({})
    for tried in (overrides, []):
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = hydra_compose("config", overrides=tried, return_hydra_config=True)
            break
        except (HydraException, OmegaConfBaseException, YAMLError, UnicodeDecodeError):
            continue
    choices = OmegaConf.select(cfg, "hydra.runtime.choices", default={})
    lines = [f"python -m kimi_pipe {stage.name} [key=value ...]", ""]
    lines += textwrap.wrap(stage.what, 92)
    lines += ["", "main settings (key=value; `make ... key=value` passes them too), now:"]
    rows = [
        (f"{key}={choices.get(key) if _options(key) else _shown(cfg, key)}", about, _options(key))
        for key, about in stage.settings
    ]
    width = min(max(len(left) for left, _, _ in rows), 34)
    for left, about, options in rows:
        if len(left) > width:
            lines += [f"  {left}", f"  {'':<{width}}  {about}"]
        else:
            lines.append(f"  {left:<{width}}  {about}")
        if options:
            lines += [f"  {'':<{width}}    {part}" for part in textwrap.wrap(options, 60)]
    lines += ["", "examples:", *(f"  {e}" for e in stage.examples), ""]
    every = (
        f"every setting: python -m kimi_pipe {stage.name} --cfg job"
        if stage.whole_config
        else "every setting: conf/config.yaml and its groups"
    )
    lines.append(every + (f"; more in {stage.more}" if stage.more else ""))
    return "\n".join(lines)


def _options(key: str) -> str:
    """A config group's options (conf/<key>/*.yaml), said after its line; "" for a value."""
    if not (CONF_DIR / key).is_dir():
        return ""
    return "options: " + " ".join(sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml")))


def _shown(cfg: DictConfig, key: str) -> str:
    """A setting's value as typed on the command line: a group's choice by its name, a value
    resolved where it can be, else as written; `???` where it must be given."""
    try:
        value = OmegaConf.select(
            cfg, f"{key}.name" if _options(key) else key, throw_on_missing=True
        )
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
    except MissingMandatoryValue:
        return "??? (required)"
    except OmegaConfBaseException:
        value = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value).replace("'", "").replace(" ", "")


def compose_command(
    task: Task,
    argv: Sequence[str] | None = None,
    *,
    usage: str | None = None,
    moved: Mapping[str, str] | None = None,
    help: StageHelp | None = None,  # noqa: A002 (the flag's name)
) -> int:
    """Compose the overrides (argv, else sys.argv) and run `task`; exit status returned.
    `-h`/`--help` prints `help` (else `usage`) and runs nothing; `moved`: see
    `compose_overrides`."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    say_each_line_once()  # where the stage set up its logging (logging.basicConfig)
    if wants_help(overrides):
        if help is not None:
            print(help_text(help, overrides))
        else:
            print(
                (
                    usage or "usage: [group=option] [key=value ...] (Hydra overrides of conf/)"
                ).strip()
            )
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


@contextmanager
def _hydra_raises() -> Iterator[None]:
    """Hydra's own failures (saving the config to `.hydra/`, opening the log) raised to the
    caller instead of printed as a traceback and exit 1 (HYDRA_FULL_ERROR, restored)."""
    saved = os.environ.get(HYDRA_FULL_ERROR)
    os.environ[HYDRA_FULL_ERROR] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(HYDRA_FULL_ERROR, None)
        else:
            os.environ[HYDRA_FULL_ERROR] = saved


def _hydra_failure(exc: Exception) -> int | None:
    """A failure raised by Hydra around the task, as one line and exit 2; None for a bug."""

    if isinstance(exc, HydraException | OmegaConfBaseException) and host_error(exc, "") is None:
        # A sweep's overrides (composed only here): Hydra's message, without its search path.
        message = str(exc).split("\nConfig search path", 1)[0]
        return report(override_error(message, sys.argv[1:]))
    failure = host_error(exc, _hydra_writes())
    return None if failure is None else report(failure)


def _hydra_writes() -> str:
    """Where the Hydra job that failed writes: the directory of the log Hydra opened for it
    (its run directory) before saving its config; else the cwd."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return str(Path(handler.baseFilename).parent)
    return os.getcwd()


def new_run_dirs(argv: Sequence[str]) -> list[Path]:
    """The run directory a single Hydra run of `argv` writes to and those of its parents that
    do not exist yet, deepest first (none for a multirun, or a config that does not compose):
    what a refused start may take away again (`remove_if_unused`)."""
    if _NOT_A_SINGLE_RUN.intersection(a.split("=", 1)[0] for a in argv):
        return []
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose("config", overrides=list(argv), return_hydra_config=True)
        where = Path(str(cfg.hydra.run.dir)).absolute()
    except (HydraException, OmegaConfBaseException, YAMLError, UnicodeDecodeError, ValueError):
        return []
    fresh = []
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


def hydra_command(
    task: Task,
    argv: Sequence[str] | None = None,
    *,
    name: str,
    help: StageHelp | None = None,  # noqa: A002 (the flag's name)
    fresh: Sequence[Path] | None = None,
) -> int:
    """Run `task` as the Hydra app `name` over conf/ (argv replaces sys.argv[1:] when given).

    `name` is Hydra's job name: the saved config goes to `.hydra/<name>/` and the log to
    `<name>.log` in the run directory, whatever module holds the task. A write that fails
    on the host (a full disk: the saved config, the log) is one line and exit 2 too. A run
    that fails leaves no run directory of Hydra's files alone behind (`fresh`: the
    directories the command made, from `new_run_dirs` before any of them was made)."""

    overrides = list(sys.argv[1:] if argv is None else argv)
    if help is not None and wants_help(overrides):  # not Hydra's dump of the whole config
        print(help_text(help, overrides))
        return 0
    if not any(a.startswith("hydra.job.name=") for a in overrides):
        overrides.append(f"hydra.job.name={name}")
    if fresh is None:
        fresh = new_run_dirs(overrides)
    flags = _NOT_A_SINGLE_RUN.intersection(a.split("=", 1)[0] for a in overrides)
    if not flags or flags <= _MULTIRUN:
        try:  # before Hydra creates the run (or sweep) directory and saves the config
            compose_overrides(first_job(overrides), typed=overrides)
        except ConfigError as exc:
            remove_if_unused(fresh, name)  # a check before this one may have made it
            return report(exc) or EXIT_USER_ERROR

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def stage_app(cfg: DictConfig) -> None:
        logs = _FileLogGuard()  # Hydra opened the job's log before calling the task
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
            raise SystemExit(status)  # not an Exception: Hydra lets it through

    saved, sys.argv = sys.argv, [sys.argv[0], *overrides]
    status = 0
    try:
        with _hydra_raises():
            stage_app()
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (1 if exc.code else 0)
    except Exception as exc:
        status_or_none = _hydra_failure(exc)
        if status_or_none is None:
            raise
        status = status_or_none
    finally:
        sys.argv = saved
    if status:
        _close_file_logs()
        remove_if_unused(fresh, name)
    return status


def _close_file_logs() -> None:
    """Hydra's log of the job, closed (and taken off the root logger) before its directory
    may go."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            with contextlib.suppress(OSError):  # a full disk: said already (_FileLogGuard)
                handler.close()
