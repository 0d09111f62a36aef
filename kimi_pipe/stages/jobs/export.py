"""The export stage's door: the composed config -> `ExportJob`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.config import whole_number
from kimi_pipe.errors import ConfigError
from kimi_pipe.exporters.job import ExportJob

# export.* keys the engine reads itself (conf/config.yaml), never passed to an exporter.
ENGINE_KEYS = ("accept", "workers", "storage_options", "push_to_hub")


def export_choice(cfg: DictConfig) -> tuple[str, dict[str, Any]]:
    """The format and its settings from a composed config.

    `format=NAME` (root key; by default `${export.name}`, the group choice) names the format.
    The `export` group's settings apply when they are that format's (`export=NAME`, with
    `export.KEY=...` overrides); `format=NAME` alone takes conf/export/NAME.yaml as it is.
    The root `max_length` is kept as an alias of `export.max_length` (SpecForge).
    """
    group = OmegaConf.select(cfg, "export", default=None)
    group_settings: dict[str, Any] = {}
    if isinstance(group, DictConfig):
        group_settings = dict(OmegaConf.to_container(group, resolve=True))  # type: ignore[arg-type]
    fmt = OmegaConf.select(cfg, "format", default=None) or group_settings.get("name") or "specforge"
    fmt = str(fmt)
    settings = dict(group_settings) if group_settings.get("name") == fmt else {}
    settings.pop("name", None)
    for key in ENGINE_KEYS:  # the engine's settings, not the format's (run_export)
        settings.pop(key, None)

    if "max_length" in settings:
        settings["max_length"] = whole_number(settings["max_length"], "export.max_length")
    max_length = whole_number(OmegaConf.select(cfg, "max_length", default=None), "max_length")
    if max_length is not None:
        settings["max_length"] = max_length
    return fmt, settings


def stores_of(cfg: DictConfig) -> list[str]:
    """`stores=`: one path or a list of them."""
    stores = OmegaConf.select(cfg, "stores", default=None) or []
    return [str(s) for s in ([stores] if isinstance(stores, str) else stores)]


def output_dir(cfg: DictConfig, run_dir: Path) -> Path:
    """`output=`, else `<run_dir>/export_<format>` (a pipeline's default)."""
    out = OmegaConf.select(cfg, "output", default=None)
    fmt = OmegaConf.select(cfg, "format", default="specforge")
    return Path(str(out)) if out else run_dir / f"export_{fmt}"


def export_job(cfg: DictConfig, run_dir: Path | None = None) -> ExportJob:
    """The composed config as an ExportJob; `run_dir` (a pipeline's run) gives the default
    output directory."""
    fmt, settings = export_choice(cfg)
    output = OmegaConf.select(cfg, "output", default=None)
    if run_dir is not None:
        output = output_dir(cfg, run_dir)
    accept = OmegaConf.select(cfg, "export.accept", default=None)
    if isinstance(accept, str):
        accept = [accept]
    return ExportJob(
        fmt=fmt,
        stores=tuple(stores_of(cfg)),
        output=str(output) if output is not None else None,
        seed=int(OmegaConf.select(cfg, "seed", default=0) or 0),
        target_model_path=_str_or_none(OmegaConf.select(cfg, "target_model_path", default=None)),
        settings=settings,
        accept=tuple(str(a) for a in accept) if accept else None,
        workers=OmegaConf.select(cfg, "export.workers", default=1),
        storage_options=_mapping(OmegaConf.select(cfg, "export.storage_options", default=None)),
        push_to_hub=_mapping(OmegaConf.select(cfg, "export.push_to_hub", default=None)),
    )


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def _mapping(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, DictConfig):
        return dict(OmegaConf.to_container(value, resolve=True))  # type: ignore[arg-type]
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a mapping, got {value!r}")
    return dict(value)
