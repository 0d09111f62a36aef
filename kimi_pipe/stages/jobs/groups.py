"""Readers of the config groups several stages share (model, provider, dataset, budget,
serving...): a composed node as plain values or as its typed settings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from kimi_pipe.config import CONF_DIR, Settings, comma_lists, node_settings
from kimi_pipe.errors import ConfigError


def plain_node(cfg: Any, key: str) -> Any:
    """The node at `key` ("": the whole config) with its interpolations resolved, as plain
    values (a mandatory value never given stays `???`, as the readers below the doors
    expect); None where absent."""
    node = OmegaConf.select(cfg, key, default=None) if key else cfg
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def plain_values(config: Mapping[str, Any] | DictConfig) -> dict[str, Any]:
    """A composed config as plain values, interpolations resolved (a mandatory value never
    given stays ???, for the reader that needs it to name it); plain values as they are."""
    if not OmegaConf.is_config(config):
        return dict(config)
    values = OmegaConf.to_container(config, resolve=True, throw_on_missing=False)
    return {str(k): v for k, v in values.items()} if isinstance(values, dict) else {}


def mapping_node(cfg: Any, key: str) -> dict[str, Any]:
    """`plain_node` of a group that must be a mapping (model, provider, dataset)."""
    return mapping_value(plain_node(cfg, key), key)


def mapping_value(node: Any, key: str) -> dict[str, Any]:
    """The plain value of the group `key`, which must be a mapping of settings; {} absent."""
    if node is None:
        return {}
    if not isinstance(node, dict):
        raise ConfigError(f"{key} must be a mapping of settings, not {node!r}")
    return node


def settings_node(
    cfg: Any, key: str, schema: type[Settings], lists: tuple[str, ...] = ()
) -> Settings:
    """The node at `key` as its typed settings `schema` (kimi_pipe/config.py's checks); each
    of `lists` may be given as `a,b` for [a, b]."""
    return node_settings(cfg, key, schema, fix=comma_lists(*lists) if lists else None)


def with_overrides(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """A copy of a composed config with `key=value` / `++key=value` / `group=choice`
    overrides applied (a group choice loads conf/<group>/<choice>.yaml), for a job whose
    config was composed elsewhere (the command line, a pipeline)."""

    out = cfg.copy()
    with open_dict(out):
        for item in OverridesParser.create().parse_overrides(list(overrides)):
            key, value = item.key_or_group, item.value()
            group = CONF_DIR / key / f"{value}.yaml"
            if "." not in key and isinstance(value, str) and group.is_file():
                OmegaConf.update(out, key, OmegaConf.load(group), merge=False, force_add=True)
                continue
            OmegaConf.update(out, key, value, merge=False, force_add=True)
    return out
