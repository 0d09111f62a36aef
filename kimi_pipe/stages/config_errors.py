"""A config that did not compose, said in one line: a key it lacks with the settings it most
likely meant ("did you mean"), a value a schema refuses with what was expected, else Hydra's
message less its search path. The command layer (stages/command.py) raises what these say."""

from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Callable, Sequence
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError
from yaml import YAMLError

from kimi_pipe.errors import ConfigError

NOT_COMPOSED = (HydraException, OmegaConfBaseException, YAMLError, UnicodeDecodeError)
# Hydra's words for a key the config lacks (its hint, `+key=value`, would add it as new).
_NO_SUCH_KEY = re.compile(r"Could not override '([^']+)'|delete from config\. '([^']+)' does")
# What a value should have been, in OmegaConf's words (a schema's field).
_KINDS = {"to Float": "a number", "to Integer": "a whole number", "valid bool": "true or false"}


def override_key(override: str) -> str:
    """`key` of `key=value`, `+key=value`, `++key=value` or `~key`."""
    return override.split("=", 1)[0].lstrip("+~")


def compose_error(
    exc: BaseException,
    overrides: Sequence[str],
    compose: Callable[[Sequence[str], bool], DictConfig],
) -> ConfigError:
    """`exc` (Hydra's or OmegaConf's) as one ConfigError naming the override the user typed
    (`overrides`); `compose(overrides, with_hydra)`: the command's, for the keys a `~key` is
    matched to (those of the defaults)."""
    cause = exc.__cause__
    if isinstance(cause, ValidationError):
        key, reason = str(cause.full_key), str(cause.msg).split("\n", 1)[0]
        given = next((o for o in overrides if override_key(o) == key), key)
        kind = next((k for words, k in _KINDS.items() if words in reason), None)
        if kind is None:
            return ConfigError(f"{given}: {reason}")
        value = OverridesParser.create().parse_override(given).value()
        return ConfigError(f"{key}={value!r}: expected {kind}")
    message = str(exc).split("\nConfig search path", 1)[0]
    found = _NO_SUCH_KEY.search(message)
    if found is None:
        return ConfigError(f"bad override or config: {message}")
    key = found.group(1) or found.group(2)
    typed = next((o for o in overrides if override_key(o) == key), key)
    # The config Hydra had composed when the key was missed (a `~key`: none, the defaults').
    node = getattr(exc.__cause__, "parent_node", None)
    with contextlib.suppress(*NOT_COMPOSED):
        node = compose([], False) if node is None else node._get_root()
    keys = [k for k in setting_keys(node) if k.split(".", 1)[0] != "hydra"] if node else []
    close = did_you_mean(key, keys)
    if close:
        return ConfigError(f"{typed}: no such setting; did you mean {' or '.join(close)}?")
    return ConfigError(
        f"{typed}: no such setting (`--help` lists the stage's main ones; a key of your own "
        f"is added with +{typed.lstrip('+~')})"
    )


def setting_keys(cfg: DictConfig) -> list[str]:
    """Every key of the config, dotted (`dataset`, `dataset.limit`, ...), nothing resolved."""

    def walk(node: Any, prefix: str) -> list[str]:
        if not isinstance(node, dict):
            return []
        return [k for n, c in node.items() for k in (prefix + n, *walk(c, f"{prefix}{n}."))]

    return walk(OmegaConf.to_container(cfg, resolve=False), "")


def did_you_mean(key: str, keys: Sequence[str], most: int = 3) -> list[str]:
    """The settings `key` most likely meant: a close spelling beside it (`dataset.limt` ->
    `dataset.limit`), else a close spelling anywhere, else its name under another node (`usd`
    -> `budget.usd`, `sweep.usd`). Only the closest few, never a list of weak guesses."""
    parent, _, name = key.rpartition(".")

    def closest(wanted: str, candidates: dict[str, str], cutoff: float) -> list[str]:
        scored = sorted(
            ((difflib.SequenceMatcher(None, wanted, t).ratio(), k) for k, t in candidates.items()),
            key=lambda pair: -pair[0],
        )
        best = scored[0][0] if scored else 0.0
        return [k for ratio, k in scored if ratio >= max(cutoff, best - 0.05)][:most]

    siblings = {k: k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent}
    return (
        closest(name, siblings, 0.7)
        or closest(key, {k: k for k in keys}, 0.85)
        or [k for k in keys if k.rpartition(".")[2] == name][:most]
        or closest(name, {k: k.rpartition(".")[2] for k in keys}, 0.85)
    )
