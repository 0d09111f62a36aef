"""Before anything is written: the run directory a generate job writes to and the checks run
before Hydra launches it (every job of a multirun first). At the door: it reads the config."""

from __future__ import annotations

import copy
import errno
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from hydra import compose as hydra_compose
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, open_dict
from omegaconf.errors import OmegaConfBaseException
from yaml import YAMLError

from kimi_pipe.errors import EXIT_USER_ERROR
from kimi_pipe.generation.datasets import dataset_nodes
from kimi_pipe.generation.errors import GenerateError
from kimi_pipe.providers.budget import budget_settings
from kimi_pipe.providers.credentials import api_key, key_in_overrides, refuse_secrets
from kimi_pipe.providers.settings import ProviderSettings
from kimi_pipe.store.run_dir import check_run_dir, same_dir


def _one_dir(run_dir: object, output_dir: object) -> None:
    """A single run's hydra.run.dir and output_dir must be one directory."""
    if not same_dir(str(run_dir), str(output_dir)):
        raise GenerateError(
            f"hydra.run.dir ({run_dir}) differs from output_dir ({output_dir}): records "
            "would go to one and the logs to the other; set output_dir only"
        )


def run_dir_of(output_dir: object) -> Path:
    """The run directory: `output_dir`, which a single Hydra run's `hydra.run.dir` must
    agree with; in a multirun, the job's directory (hydra.sweep.dir/subdir, one per job)."""
    try:
        hydra_cfg = HydraConfig.get()
    except (ImportError, ValueError):
        return Path(str(output_dir))
    job_dir = Path(hydra_cfg.runtime.output_dir)
    if str(hydra_cfg.mode) != "RunMode.MULTIRUN":
        _one_dir(job_dir, output_dir)
        return Path(str(output_dir))
    if any(o.lstrip("+~").startswith("output_dir=") for o in hydra_cfg.overrides.task):
        raise GenerateError(
            "output_dir with --multirun: every job writes to its own "
            f"hydra.sweep.dir/hydra.sweep.subdir ({job_dir}); drop output_dir"
        )
    return job_dir


def check_settings(cfg: DictConfig) -> None:
    """The budget, provider and dataset settings as the run reads them, and the key variable:
    a ConfigError naming what cannot buy, before the run directory and serving=auto's probes."""
    budget_settings(cfg)
    provider = ProviderSettings.from_config(cfg.provider)
    dataset_nodes(cfg)
    api_key(provider.api_key_env)


def refuse_keys_on_the_command_line(argv: list[str]) -> None:
    """Hydra saves every override in .hydra/ (and the log) before the task runs: refuse a
    key there, whatever the key it is given under."""
    why = key_in_overrides(argv)
    if why:
        print(
            f"error: {why} (Hydra would save it in .hydra/ and the log); export the "
            "provider's key variable (e.g. OPENROUTER_API_KEY) instead",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_USER_ERROR)


def writable(run_dir: Path) -> None:
    """Create the run directory, or raise the OSError (naming it) that says why not."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(run_dir, os.W_OK | os.X_OK):
        err = errno.EROFS if os.statvfs(run_dir).f_flag & os.ST_RDONLY else errno.EACCES
        raise OSError(err, os.strerror(err), str(run_dir))


def check_before_launch(
    cfg: DictConfig,
    jobs: Sequence[Sequence[str]],
    multirun: bool,
    environ: dict[str, str] | None = None,
) -> None:
    """What Hydra would write before the stage runs (`.hydra/`, the log, the run directory),
    checked for every job first: no secret in any resolved value or directory name, settings
    that can buy, one writable run directory per job; else a KimiPipeError. `cfg`: the
    command's config (with its `hydra` node), the single run's job; a multirun's jobs are
    composed here (one that does not compose is left for Hydra to report)."""
    seen: dict[str, list[str]] = {}
    for job in jobs if multirun else [None]:
        try:
            job_cfg = cfg if job is None else hydra_compose("config", list(job), True)
            if multirun:
                sweep = job_cfg.hydra.sweep
                run_dir = os.path.join(str(sweep.dir), str(sweep.subdir))
            else:
                run_dir = str(job_cfg.hydra.run.dir)
            output_dir = str(job_cfg.output_dir)
            settings = copy.deepcopy(job_cfg)  # the command's config keeps its hydra node
            with open_dict(settings):
                del settings["hydra"]
        except (HydraException, OmegaConfBaseException, YAMLError, UnicodeDecodeError):
            return
        where = "hydra.sweep.dir/subdir" if multirun else "hydra.run.dir"
        refuse_secrets(settings, environ, {where: run_dir})
        check_settings(settings)
        check_run_dir(run_dir)
        if not multirun:
            _one_dir(run_dir, output_dir)
        writable(Path(run_dir))  # Hydra creates it and writes its log there first
        seen.setdefault(os.path.realpath(run_dir), []).append(" ".join(job or ()))
    for run_dir, shared in seen.items():
        if len(shared) > 1:
            raise GenerateError(
                f"{len(shared)} jobs of this multirun would share the run directory {run_dir} "
                f"({' | '.join(shared)}): each would resume the other's records. Give each its "
                "own hydra.sweep.subdir (the default one is derived from what a job buys)"
            )
