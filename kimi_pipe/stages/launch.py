"""generate's checks before Hydra launches it (every job of a multirun first): what Hydra
would write must hold no secret, each job's settings must buy, each its own run directory."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.generation.errors import GenerateError
from kimi_pipe.providers.credentials import refuse_secrets
from kimi_pipe.stages.jobs.generate import generate_job
from kimi_pipe.store.run_dir import check_run_dir, same_dir


def writable(run_dir: Path) -> None:
    """Create the run directory, or raise the OSError (naming it) that says why not."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(run_dir, os.W_OK | os.X_OK):
        err = errno.EROFS if os.statvfs(run_dir).f_flag & os.ST_RDONLY else errno.EACCES
        raise OSError(err, os.strerror(err), str(run_dir))


def check_before_launch(
    cfgs: Sequence[DictConfig], jobs: Sequence[Sequence[str]], multirun: bool
) -> None:
    """What Hydra would write before the stage runs (`.hydra/`, the log, the run directory),
    checked for every job first: no secret in any resolved value or directory name, the job
    generate would build from it (settings that can buy, a key), one writable run directory
    per job; else a KimiPipeError. `cfgs`: each job's config (with its `hydra` node)."""
    seen: dict[str, list[str]] = {}
    for job, cfg in zip(jobs, cfgs, strict=True):
        if multirun and any(o.lstrip("+~").startswith("output_dir=") for o in job):
            raise GenerateError(
                "output_dir with --multirun: every job writes to its own "
                "hydra.sweep.dir/hydra.sweep.subdir; drop output_dir"
            )
        where = "hydra.sweep.dir/subdir" if multirun else "hydra.run.dir"
        run_dir = str(cfg.hydra.run.dir)
        if multirun:
            run_dir = os.path.join(str(cfg.hydra.sweep.dir), str(cfg.hydra.sweep.subdir))
        settings = OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"])
        refuse_secrets(settings, None, {where: run_dir})
        generate_job(settings, Path(run_dir))
        check_run_dir(run_dir)
        if not multirun and not same_dir(run_dir, str(settings.output_dir)):
            raise GenerateError(
                f"hydra.run.dir ({run_dir}) differs from output_dir ({settings.output_dir}): "
                "records would go to one and the logs to the other; set output_dir only"
            )
        writable(Path(run_dir))  # Hydra creates it and writes its log there first
        seen.setdefault(os.path.realpath(run_dir), []).append(" ".join(job))
    for run_dir, shared in seen.items():
        if len(shared) > 1:
            raise GenerateError(
                f"{len(shared)} jobs of this multirun would share the run directory {run_dir} "
                f"({' | '.join(shared)}): each would resume the other's records. Give each its "
                "own hydra.sweep.subdir (the default one is derived from what a job buys)"
            )
