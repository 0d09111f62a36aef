"""Where the Hydra configs and bundled data live, and composing the config outside
`@hydra.main` (for stages that write no run dir).

A checkout keeps `conf/` and `data/` at the repository root; a built wheel carries copies
inside the package (`kimi_pipe/conf`, `kimi_pipe/data`, written by setup.py at build time).
The packaged copy wins when it exists, so an installed wheel never reads a stray `conf/`
that some other distribution left in site-packages.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kimi_pipe.errors import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent  # the checkout; in an installed wheel this is site-packages


def bundled_dir(name: str, package_dir: Path = PACKAGE_DIR) -> Path:
    """The package's own copy of `name` (an installed wheel), else the checkout's."""
    packaged = package_dir / name
    if packaged.is_dir():
        return packaged
    return package_dir.parent / name


CONF_DIR = bundled_dir("conf")
DATA_DIR = bundled_dir("data")


class ConfigDirMissing(ConfigError, FileNotFoundError):
    """Neither the package nor a checkout holds the Hydra configs."""


def require_conf_dir() -> Path:
    if not (CONF_DIR / "config.yaml").is_file():
        raise ConfigDirMissing(
            f"kimi_pipe configs not found: neither {PACKAGE_DIR / 'conf'} (an installed wheel) "
            f"nor {REPO_DIR / 'conf'} (a checkout) holds config.yaml. Reinstall the wheel "
            "(built with `pip wheel .` or `make wheel`), or run from a checkout."
        )
    return CONF_DIR


# `${kimi_pipe_data:demo_prompts.jsonl}` in a config: a file bundled with the project.
OmegaConf.register_new_resolver("kimi_pipe_data", lambda name: str(DATA_DIR / name), replace=True)


def purchase_digest(*parts: object) -> str:
    """A short digest of resolved config values (`${kimi_pipe_digest:${a},${b}}`): the
    default run directory carries one of everything that changes what is bought, so two
    jobs that buy differently never share a directory."""
    data = [
        OmegaConf.to_container(p, resolve=True) if isinstance(p, DictConfig | ListConfig) else p
        for p in parts
    ]
    text = json.dumps(data, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


OmegaConf.register_new_resolver("kimi_pipe_digest", purchase_digest, replace=True)


def compose(overrides: Sequence[str]) -> DictConfig:

    with initialize_config_dir(config_dir=str(require_conf_dir()), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


MULTIRUN = ("-m", "--multirun")


def sweep_jobs(argv: Sequence[str]) -> list[list[str]]:
    """The overrides of every job a command line starts: its one job, or with `-m` each job of
    the multirun (the product of its sweeps, a later override of a key replacing an earlier
    one, as Hydra's basic sweeper makes them). Flags are left out; a HydraException for an
    override that does not parse or a sweep no list can hold (`interval(...)`)."""
    overrides = [a for a in argv if not a.startswith("-")]
    if not any(a in MULTIRUN for a in argv):
        return [overrides]
    chosen: dict[str, list[str]] = {}
    for item in OverridesParser.create().parse_overrides(overrides):
        key = item.get_key_element()
        if not item.is_sweep_override():
            chosen[key] = [f"{key}={item.get_value_element_as_str()}"]
        elif item.is_discrete_sweep():
            chosen[key] = [f"{key}={value}" for value in item.sweep_string_iterator()]
        else:
            raise HydraException(f"{item.input_line}: a multirun sweeps lists and ranges only")
    return [list(job) for job in itertools.product(*chosen.values())]


Settings = TypeVar("Settings")


def typed_settings(
    values: Any,
    schema: type[Settings],
    key: str,
    fix: Callable[[dict[str, Any]], None] | None = None,
) -> Settings:
    """Plain config values (a mapping, or None for all defaults) as the dataclass `schema`,
    checked the way Hydra's structured configs check a node: a value of the wrong type, an
    unknown key or a missing mandatory value is a ConfigError naming `key.field`. `fix` may
    rewrite the values first (a comma-separated string into a list, say)."""

    if values is not None and not isinstance(values, dict):
        raise ConfigError(f"{key} must be a mapping of settings, not {values!r}")
    values = dict(values or {})
    if fix is not None:
        fix(values)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), values)
        return cast(Settings, OmegaConf.to_object(merged))
    except OmegaConfBaseException as exc:
        raise _setting_error(exc, key) from None


def node_settings(
    cfg: Any, key: str, schema: type[Settings], fix: Callable[[dict[str, Any]], None] | None = None
) -> Settings:
    """The composed config's node `key` (interpolations resolved) as `typed_settings`."""

    try:
        node = OmegaConf.select(cfg, key, default=None, throw_on_missing=True)
        plain = (
            OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
            if OmegaConf.is_config(node)
            else node
        )
    except OmegaConfBaseException as exc:
        raise _setting_error(exc, key) from None
    return typed_settings(plain, schema, key, fix)


def _setting_error(exc: Any, key: str) -> ConfigError:
    full = str(exc.full_key or "")
    where = full if full == key or full.startswith(f"{key}.") else f"{key}.{full}".rstrip(".")
    reason = str(getattr(exc, "msg", "") or exc).split("\n", 1)[0]
    return ConfigError(f"{where}: {reason}")


def comma_lists(*keys: str) -> Callable[[dict[str, Any]], None]:
    """A `node_settings` fix: `a,b` (or one `a`) given where a list belongs becomes [a, b]."""

    def fix(values: dict[str, Any]) -> None:
        for key in keys:
            if isinstance(values.get(key), str):
                values[key] = [part.strip() for part in values[key].split(",") if part.strip()]

    return fix


def whole_number(value: Any, key: str) -> int | None:
    """A setting that is null or a whole number (its default null says nothing of its kind,
    so the command line's type check cannot); a ConfigError naming `key` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r}: expected a whole number (or null)")
    return value
