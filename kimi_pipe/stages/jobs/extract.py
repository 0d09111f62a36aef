"""The extract stage's door: the composed config -> `ExtractJob`, once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.errors import ConfigError
from kimi_pipe.extraction.job import ExtractJob, records_of
from kimi_pipe.extraction.resolve import ResolveSettings


def plain(cfg: DictConfig, key: str) -> Any:
    """The node `key` as plain values (interpolations resolved); None when absent."""
    node = OmegaConf.select(cfg, key, default=None)
    if not OmegaConf.is_config(node):
        return node
    out = OmegaConf.to_container(node, resolve=True)
    return {str(k): v for k, v in out.items()} if isinstance(out, dict) else out


def _first(cfg: DictConfig, *keys: str) -> Any:
    for key in keys:
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None:
            return value
    return None


def executor_name(value: Any) -> str | None:
    """`extract.executor`: None (the work shards) for null, "", none; else the name."""
    if value is None or str(value) in ("", "none", "null"):
        return None
    return str(value)


def resolve_settings(cfg: DictConfig) -> ResolveSettings:
    """The `resolve` group, judged at `extract.dtype` (the extraction model is the judge)."""
    return ResolveSettings.from_values(
        plain(cfg, "resolve"), OmegaConf.select(cfg, "extract.dtype", default=None)
    )


def extract_job(
    cfg: DictConfig, run_dir: Path | None = None, *, default_run_dir: Path | None = None
) -> ExtractJob:
    """The composed config as an ExtractJob. `run_dir`: a pipeline's run, in place of
    `extract.run_dir`; `default_run_dir`: used only when `extract.run_dir` is unset. The
    records are `records` / `extract.records`, else `run_dir` / `extract.run_dir`'s
    records.jsonl (top-level keys first)."""

    settings = plain(cfg, "extract")
    if not isinstance(settings, dict):
        raise ConfigError("extract must be a mapping of settings (conf/extract/<backend>.yaml)")
    own_run_dir = settings.get("run_dir")
    if run_dir is not None:
        own_run_dir = str(run_dir)
    elif own_run_dir is None and default_run_dir is not None:
        own_run_dir = str(default_run_dir)
    if own_run_dir is not None:
        settings["run_dir"] = own_run_dir
    records = records_of(
        _first(cfg, "records", "extract.records"),
        _first(cfg, "run_dir") or own_run_dir,
    )
    output = settings.get("output_dir")
    model = plain(cfg, "model")
    return ExtractJob(
        backend=str(settings.get("backend")),
        settings=settings,
        records=records,
        output_dir=Path(str(output)) if output is not None else None,
        model=model if isinstance(model, dict) else None,
        resolve=resolve_settings(cfg),
        executor=executor_name(settings.get("executor")),
    )
