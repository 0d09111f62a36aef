"""The export stage's door: the config's values -> `ExportJob`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kimi_pipe.config import whole_number
from kimi_pipe.errors import ConfigError
from kimi_pipe.exporters.job import ExportJob
from kimi_pipe.stages.jobs.groups import plain_values

# export.* keys the engine reads itself (conf/config.yaml), never passed to an exporter.
ENGINE_KEYS = ("accept", "workers", "storage_options", "push_to_hub")

Config = Mapping[str, Any] | DictConfig  # the stage's plain values, or a composed config


def export_choice(config: Config) -> tuple[str, dict[str, Any]]:
    """The format and its settings from the config's values.

    `format=NAME` (root key; by default `${export.name}`, the group choice) names the format.
    The `export` group's settings apply when they are that format's (`export=NAME`, with
    `export.KEY=...` overrides); `format=NAME` alone takes conf/export/NAME.yaml as it is.
    The root `max_length` is kept as an alias of `export.max_length` (SpecForge).
    """
    values = plain_values(config)
    group = values.get("export")
    group_settings: dict[str, Any] = dict(group) if isinstance(group, Mapping) else {}
    fmt = str(values.get("format") or group_settings.get("name") or "specforge")
    settings = dict(group_settings) if group_settings.get("name") == fmt else {}
    settings.pop("name", None)
    for key in ENGINE_KEYS:  # the engine's settings, not the format's (run_export)
        settings.pop(key, None)

    if "max_length" in settings:
        settings["max_length"] = whole_number(settings["max_length"], "export.max_length")
    max_length = whole_number(values.get("max_length"), "max_length")
    if max_length is not None:
        settings["max_length"] = max_length
    return fmt, settings


def stores_of(config: Config) -> list[str]:
    """`stores=`: one path or a list of them."""
    stores = plain_values(config).get("stores") or []
    return [str(s) for s in ([stores] if isinstance(stores, str) else stores)]


def output_dir(config: Config, run_dir: Path) -> Path:
    """`output=`, else `<run_dir>/export_<format>` (a pipeline's default)."""
    values = plain_values(config)
    out = values.get("output")
    fmt = values.get("format") or "specforge"
    return Path(str(out)) if out else run_dir / f"export_{fmt}"


def export_job(config: Config, run_dir: Path | None = None) -> ExportJob:
    """The config's values (converted at the stage's door; a composed config is converted
    here) as an ExportJob; `run_dir` (a pipeline's run) gives the default output directory."""
    values = plain_values(config)
    fmt, settings = export_choice(values)
    output = values.get("output")
    if run_dir is not None:
        output = output_dir(values, run_dir)
    node = values.get("export")
    group: Mapping[str, Any] = node if isinstance(node, Mapping) else {}
    accept = group.get("accept")
    if isinstance(accept, str):
        accept = [accept]
    target = values.get("target_model_path")
    return ExportJob(
        fmt=fmt,
        stores=tuple(stores_of(values)),
        output=str(output) if output is not None else None,
        seed=int(values.get("seed") or 0),
        target_model_path=None if target is None else str(target),
        settings=settings,
        accept=tuple(str(a) for a in accept) if accept else None,
        workers=group.get("workers", 1),
        storage_options=_mapping(group.get("storage_options")),
        push_to_hub=_mapping(group.get("push_to_hub")),
    )


def _mapping(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a mapping, got {value!r}")
    return dict(value)
