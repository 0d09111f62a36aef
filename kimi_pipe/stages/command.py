"""One command line for every stage: Hydra overrides in, one line and exit 2 for a mistake.

A stage module exposes `run_stage(cfg, run_dir) -> summary` and a `main()` made here:

- `hydra_command(task)`: the stage runs as a Hydra app (`@hydra.main` over `conf/`): run
  directory, saved config in `.hydra/<stage>/`, `--multirun` sweeps. Used by stages that
  write a run directory (generate, extract, export).
- `compose_command(task, argv)`: the same overrides composed without a Hydra job (no
  `.hydra/` written): stages that read runs and write one file or table (reconstruct,
  audit, report, probe, sweep).

Both check the overrides first (an unknown group option or key is one line, exit 2, not
Hydra's traceback or exit 1), and turn every `kimi_pipe.errors` failure raised by the task
into one line and exit 2. A bug keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig

from kimi_pipe.config import CONF_DIR, compose
from kimi_pipe.errors import EXIT_USER_ERROR, ConfigError, one_line

# Hydra flags that do not run the task, or run it as a sweep (its overrides are sweep
# syntax that a plain compose rejects).
_NOT_A_SINGLE_RUN = {"-m", "--multirun", "-h", "--help", "--hydra-help", "--info", "-i",
                     "--cfg", "-c", "--resolve", "--package", "-p", "--shell-completion",
                     "-sc", "--version", "--config-path", "-cp", "--config-name", "-cn",
                     "--config-dir", "-cd", "--experimental-rerun"}  # fmt: skip

# A stage's task: the composed config in; an exit status, or a summary (status 0).
Task = Callable[[DictConfig], Any]


def _status(result: Any) -> int:
    return result if isinstance(result, int) else 0


def compose_overrides(overrides: Sequence[str]) -> DictConfig:
    """The composed config, or a ConfigError naming the bad override."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose(list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        # Hydra appends its search path to a missing group option: noise on one line.
        message = str(exc).split("\nConfig search path", 1)[0]
        raise ConfigError(f"bad override or config: {message}") from None


def report(exc: BaseException) -> int | None:
    """Print a user-facing failure as one line and give its exit status; None for a bug."""
    message = one_line(exc)
    if message is None:
        return None
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def compose_command(task: Task, argv: Sequence[str] | None = None) -> int:
    """Compose the overrides (argv, else sys.argv) and run `task`; exit status returned."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        return _status(task(compose_overrides(overrides)))
    except Exception as exc:
        status = report(exc)
        if status is None:
            raise
        return status


def hydra_command(task: Task, argv: Sequence[str] | None = None, *, name: str) -> int:
    """Run `task` as the Hydra app `name` over conf/ (argv replaces sys.argv[1:] when given).

    `name` is Hydra's job name: the saved config goes to `.hydra/<name>/` and the log to
    `<name>.log` in the run directory, whatever module holds the task."""
    import hydra

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
        try:
            status = _status(task(cfg))
        except Exception as exc:
            status_or_none = report(exc)
            if status_or_none is None:
                raise
            status = status_or_none
        if status:
            raise SystemExit(status)  # not an Exception: Hydra lets it through

    saved, sys.argv = sys.argv, [sys.argv[0], *overrides]
    try:
        stage_app()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (1 if exc.code else 0)
    finally:
        sys.argv = saved
    return 0
