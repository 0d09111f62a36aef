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

import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from yaml import YAMLError

from kimi_pipe.config import CONF_DIR, compose
from kimi_pipe.errors import EXIT_USER_ERROR, ConfigError, StoreError, host_error, one_line

# Hydra flags that do not run the task, or run it as a sweep (its overrides are sweep
# syntax that a plain compose rejects).
_NOT_A_SINGLE_RUN = {"-m", "--multirun", "-h", "--help", "--hydra-help", "--info", "-i",
                     "--cfg", "-c", "--resolve", "--package", "-p", "--shell-completion",
                     "-sc", "--version", "--config-path", "-cp", "--config-name", "-cn",
                     "--config-dir", "-cd", "--experimental-rerun"}  # fmt: skip

HYDRA_FULL_ERROR = "HYDRA_FULL_ERROR"

# A stage's task: the composed config in; an exit status, or a summary (status 0).
Task = Callable[[DictConfig], Any]


def _status(result: Any) -> int:
    return result if isinstance(result, int) else 0


def override_key(override: str) -> str:
    """`key` of `key=value`, `+key=value`, `++key=value` or `~key`."""
    return override.split("=", 1)[0].lstrip("+~")


def compose_overrides(
    overrides: Sequence[str], moved: Mapping[str, str] | None = None
) -> DictConfig:
    """The composed config, or a ConfigError naming the bad override. `moved` maps a key the
    command took before it was a Hydra app to its config key, said in the message."""

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
    check_value_types(overrides)
    return cfg


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


def report(exc: BaseException) -> int | None:
    """Print a user-facing failure as one line and give its exit status; None for a bug."""
    message = one_line(exc)
    if message is None:
        return None
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


HELP_FLAGS = ("-h", "--help")


def compose_command(
    task: Task,
    argv: Sequence[str] | None = None,
    *,
    usage: str | None = None,
    moved: Mapping[str, str] | None = None,
) -> int:
    """Compose the overrides (argv, else sys.argv) and run `task`; exit status returned.
    `-h`/`--help` prints `usage` (the stage module's docstring) and runs nothing; `moved`:
    see `compose_overrides`."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    if HELP_FLAGS[0] in overrides or HELP_FLAGS[1] in overrides:
        print((usage or "usage: [group=option] [key=value ...] (Hydra overrides of conf/)").strip())
        return 0
    try:
        return _status(task(compose_overrides(overrides, moved)))
    except Exception as exc:
        status = report(exc)
        if status is None:
            raise
        return status


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
        return report(ConfigError(f"bad override or config: {message}"))
    failure = host_error(exc, _hydra_writes())
    return None if failure is None else report(failure)


def _hydra_writes() -> str:
    """Where the Hydra job that failed writes: the directory of the log Hydra opened for it
    (its run directory) before saving its config; else the cwd."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return str(Path(handler.baseFilename).parent)
    return os.getcwd()


def hydra_command(task: Task, argv: Sequence[str] | None = None, *, name: str) -> int:
    """Run `task` as the Hydra app `name` over conf/ (argv replaces sys.argv[1:] when given).

    `name` is Hydra's job name: the saved config goes to `.hydra/<name>/` and the log to
    `<name>.log` in the run directory, whatever module holds the task. A write that fails
    on the host (a full disk: the saved config, the log) is one line and exit 2 too."""

    overrides = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith("hydra.job.name=") for a in overrides):
        overrides.append(f"hydra.job.name={name}")
    if not _NOT_A_SINGLE_RUN.intersection(a.split("=", 1)[0] for a in overrides):
        try:  # before Hydra creates the run directory and saves the config
            compose_overrides(overrides)
        except ConfigError as exc:
            return report(exc) or EXIT_USER_ERROR

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def stage_app(cfg: DictConfig) -> None:
        logs = _FileLogGuard()  # Hydra opened the job's log before calling the task
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
    try:
        with _hydra_raises():
            stage_app()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (1 if exc.code else 0)
    except Exception as exc:
        status = _hydra_failure(exc)
        if status is None:
            raise
        return status
    finally:
        sys.argv = saved
    return 0
