"""Readers of the config groups several stages share (model, provider, dataset, budget,
serving...): a composed node as plain values or as its typed settings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from kimi_pipe.config import CONF_DIR, Settings, comma_lists, node_settings
from kimi_pipe.core.serving import ServingProfile
from kimi_pipe.errors import ConfigError
from kimi_pipe.providers.budget import BudgetSettings


def plain_node(cfg: Any, key: str) -> Any:
    """The node at `key` ("": the whole config) with its interpolations resolved, as plain
    values (a mandatory value never given stays `???`, as the readers below the doors
    expect); None where absent."""
    node = OmegaConf.select(cfg, key, default=None) if key else cfg
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def mapping_node(cfg: Any, key: str) -> dict[str, Any]:
    """`plain_node` of a group that must be a mapping (model, provider, dataset)."""
    node = plain_node(cfg, key)
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


def budget_of(cfg: Any) -> BudgetSettings:
    """The `budget` group, checked: a cap that cannot buy is a ConfigError naming it."""
    return node_settings(cfg, "budget", BudgetSettings).check()


def serving_of(cfg: Any) -> ServingProfile:
    """The `serving` group as a profile; a wrong field is a ConfigError naming conf/serving."""
    try:
        return ServingProfile.from_config(plain_node(cfg, "serving"))
    except ValueError as exc:
        raise ConfigError(f"conf/serving: {exc}") from None


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
