"""generate's door: the config's values (converted once, by the stage) read into a
`GenerateJob` (kimi_pipe/generation/job.py), checked as the run reads them; and the checks
before Hydra launches it (`check_before_launch`, every job of a multirun first): what Hydra
would write must hold no secret, each job's settings must buy, each its own run directory."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from kimi_pipe.config import comma_lists, typed_settings
from kimi_pipe.conformance.auto import AutoSettings
from kimi_pipe.core.serving import ServingProfile
from kimi_pipe.errors import ConfigError
from kimi_pipe.generation.datasets import datasets_of
from kimi_pipe.generation.errors import GenerateError
from kimi_pipe.generation.job import GenerateJob
from kimi_pipe.providers.budget import BudgetSettings
from kimi_pipe.providers.credentials import api_key, refuse_secrets
from kimi_pipe.providers.settings import ProviderSettings
from kimi_pipe.stages.jobs.groups import mapping_value, plain_values
from kimi_pipe.store.run_dir import check_run_dir, same_dir


def run_dir_of(output_dir: object) -> Path:
    """The run directory: `output_dir` (a single Hydra run's hydra.run.dir, checked equal
    before the launch), but in a multirun the job's own (hydra.sweep.dir/subdir)."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(str(output_dir))


def generate_job(
    config: Mapping[str, Any] | DictConfig,
    run_dir: Path | None = None,
    *,
    own_dir: bool = True,
) -> GenerateJob:
    """The config's values (the stage converted them once, at its door; a composed config is
    converted here) as generate's job. Before anything is written: no secret in any value,
    budget and provider settings that can buy, a key that is set (each a ConfigError naming
    the setting). `run_dir`: where it buys (None: `output_dir`, as Hydra's run agrees;
    `own_dir=False`: none, for a job only ever bought into directories given to it, as the
    probes are)."""
    values = plain_values(config)
    refuse_secrets(values)
    budget = typed_settings(values.get("budget"), BudgetSettings, "budget").check()
    provider = mapping_value(values.get("provider"), "provider")
    settings = ProviderSettings.from_config(provider)
    nodes = datasets_of(values.get("datasets"))
    # A missing key stops here too: before Hydra or the runner makes the run directory, and
    # before serving=auto's probes open theirs.
    api_key(settings.api_key_env)
    if run_dir is None and own_dir:
        run_dir = run_dir_of(values.get("output_dir"))
    validation = mapping_value(values.get("validation"), "validation")
    try:
        serving = ServingProfile.from_config(values.get("serving"))
    except ValueError as exc:
        raise ConfigError(f"conf/serving: {exc}") from None
    return GenerateJob(
        model=mapping_value(values.get("model"), "model"),
        provider=provider,
        settings=settings,
        dataset=mapping_value(values.get("dataset"), "dataset"),
        budget=budget,
        serving=serving,
        serving_auto=typed_settings(
            values.get("serving_auto"), AutoSettings, "serving_auto", comma_lists("providers")
        ),
        billing_tolerance=int(validation.get("billing_tolerance") or 0),
        record_ids=str(validation.get("record_ids", "engine")),
        accept=mapping_value(values.get("export"), "export").get("accept"),
        run_dir=run_dir,
        datasets=tuple(nodes) if nodes is not None else None,
    )


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
