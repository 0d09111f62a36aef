"""The model stage: convert the provider's embedded local model once (cached); nothing for a
remote provider. `python -m kimi_pipe model` is not a command of its own: pipelines run it
first so that generate, audit and extract all load the same converted weights."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.errors import ConfigError
from kimi_pipe.stages.command import compose_command
from kimi_pipe.stages.jobs.model import model_job
from kimi_pipe.store.local_model import converted_dir, ensure_local_model
from kimi_pipe.store.local_model import is_complete as converted


def outputs(cfg: DictConfig, run_dir: Path) -> list[Path]:

    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    spec = model_job(values).spec
    return [] if spec is None else [converted_dir(spec)]


def is_complete(cfg: DictConfig, run_dir: Path) -> bool:

    return all(converted(p) for p in outputs(cfg, run_dir))


def run_stage(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, Any]:

    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    job = model_job(values)
    if job.spec is None:
        return {"path": None}
    path = ensure_local_model(job.spec)
    hf_weights = job.hf_weights
    if hf_weights is not None and Path(str(hf_weights)).resolve() != path.resolve():
        raise ConfigError(f"model.hf_weights={hf_weights} is not the converted {path}")
    return {"path": str(path)}


def main(argv: list[str] | None = None) -> int:
    """`kimi-pipe model model=smollm2`: convert the local model now (what pipelines do first)."""

    def model_stage(cfg: DictConfig) -> int:
        print(f"model: {run_stage(cfg)['path']}", file=sys.stderr)
        return 0

    return compose_command(model_stage, argv)


if __name__ == "__main__":
    raise SystemExit(main())
