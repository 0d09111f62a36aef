"""The extract stage's door: the composed config -> `ExtractJob`, converted once."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kimi_pipe.errors import ConfigError
from kimi_pipe.extraction.job import ExtractJob, records_of
from kimi_pipe.extraction.resolve_settings import ResolveSettings
from kimi_pipe.stages.jobs.groups import plain_values


def executor_name(value: Any) -> str | None:
    """`extract.executor`: None (the work shards) for null, "", none; else the name."""
    if value is None or str(value) in ("", "none", "null"):
        return None
    return str(value)


def extract_job(
    config: Mapping[str, Any] | DictConfig,
    run_dir: Path | None = None,
    *,
    default_run_dir: Path | None = None,
) -> ExtractJob:
    """The config's values (the stage converted them once, at its door; a composed config
    is converted here) as an ExtractJob. `run_dir`: a pipeline's run, in place of
    `extract.run_dir`; `default_run_dir`: used only when `extract.run_dir` is unset. The
    records are `records` / `extract.records`, else `run_dir` / `extract.run_dir`'s
    records.jsonl (top-level keys first)."""
    values = plain_values(config)
    settings = values.get("extract")
    if not isinstance(settings, dict):
        raise ConfigError("extract must be a mapping of settings (conf/extract/<backend>.yaml)")
    settings = {str(k): v for k, v in settings.items()}
    own_run_dir = settings.get("run_dir")
    if run_dir is not None:
        own_run_dir = str(run_dir)
    elif own_run_dir is None and default_run_dir is not None:
        own_run_dir = str(default_run_dir)
    if own_run_dir is not None:
        settings["run_dir"] = own_run_dir
    records = records_of(
        _first(values.get("records"), settings.get("records")),
        _first(values.get("run_dir"), own_run_dir),
    )
    output = settings.get("output_dir")
    model = values.get("model")
    resolve = values.get("resolve")
    return ExtractJob(
        backend=str(settings.get("backend")),
        settings=settings,
        records=records,
        output_dir=Path(str(output)) if output is not None else None,
        model=model if isinstance(model, dict) else None,
        # The judge is the extraction model: `extract.dtype` sets the resolution's slacks.
        resolve=ResolveSettings.from_values(
            resolve if isinstance(resolve, Mapping) else None, settings.get("dtype")
        ),
        executor=executor_name(settings.get("executor")),
    )


def _first(*given: Any) -> Any:
    return next((value for value in given if value is not None), None)
