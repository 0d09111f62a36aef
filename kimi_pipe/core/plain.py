"""Settings as plain Python values: a config node read through the Mapping and Sequence
protocols only, so that code below the stages' doors never needs the config library (a
composed node resolves its interpolations as it is read)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def plain(value: Any) -> Any:
    """`value` with every mapping a dict and every sequence (but text) a list, deeply (a
    composed node's mandatory value that was never given reads as None)."""
    if isinstance(value, Mapping):
        return {k: plain(value.get(k)) for k in value}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray):
        return [plain(v) for v in value]
    return value


def select(node: Any, key: str, default: Any = None) -> Any:
    """The value at the dotted `key` of nested mappings; `default` where a part is absent
    (a null value is returned as it is, as the config's own select does)."""
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node
