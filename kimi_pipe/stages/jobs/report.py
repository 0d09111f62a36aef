"""report's door: how a run's saved config is read (the report reads runs, not the config
it is given)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.reporting.report import ReportSettings
from kimi_pipe.stages.jobs.groups import settings_node


def report_settings(cfg: Any) -> ReportSettings:
    """The `report` node: where, and the routing policy (`ignore_quantizations` may be given
    as `a,b`)."""
    return settings_node(cfg, "report", ReportSettings, lists=("ignore_quantizations",))


def read_saved_config(path: Path) -> dict[str, Any]:
    """A run's saved Hydra config, interpolations resolved where they can be.

    A sweep job's config holds e.g. `order: [${provider.name}]`; keys whose interpolation
    cannot be resolved outside Hydra (`${hydra:...}`) are kept as written.
    """
    if not path.is_file():
        return {}
    cfg = OmegaConf.load(path)
    if not isinstance(cfg, DictConfig):
        return {}
    out: dict[str, Any] = {}
    for key in cfg:
        try:
            out[str(key)] = OmegaConf.to_container(cfg[key], resolve=True)
        except Exception:  # noqa: BLE001 - an unresolvable interpolation: keep it as text
            out[str(key)] = OmegaConf.to_container(cfg, resolve=False)[key]  # type: ignore[index]
    return out
