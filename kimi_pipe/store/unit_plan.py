"""The plan of a unit store: the sorted sample ids cut into fixed-size units.

It depends on the ids and the unit size (and, with `unit_tokens`, the samples' lengths)
only, never on how many workers run it, so a unit is the same work whoever does it. The
store that claims, writes and commits units is `kimi_pipe.store.units`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kimi_pipe.errors import ConfigError, StoreError
from kimi_pipe.store import objects
from kimi_pipe.store.hidden_store import IDENTITY_KEYS

FORMAT = "kimi_pipe.unit_store"
VERSION = 1


@dataclass(frozen=True)
class Unit:
    """One unit of work: a fixed list of sample ids, committed at once."""

    name: str
    ids: tuple[str, ...]
    tokens: int | None = None


def unit_name(number: int) -> str:
    return f"u-{number:06d}"


def plan_units(
    ids: Iterable[str | int],
    unit_size: int,
    lengths: Mapping[str, int] | None = None,
    unit_tokens: int | None = None,
) -> list[Unit]:
    """Cut the sorted ids into units of `unit_size` samples (and at most `unit_tokens` tokens,
    a longer sample alone). Sorting makes the plan a function of the id set, not of the
    order the records came in or of how many workers will run it."""
    if unit_size < 1:
        raise ConfigError(f"unit_size must be >= 1, got {unit_size}")
    if unit_tokens is not None and (unit_tokens < 1 or lengths is None):
        raise ConfigError("unit_tokens needs lengths and must be >= 1")
    keys = [str(i) for i in ids]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})[:5]
        raise ConfigError(f"sample ids appear twice: {dup}")
    units: list[Unit] = []
    current: list[str] = []
    tokens = 0

    def cut() -> None:
        nonlocal current, tokens
        if current:
            units.append(Unit(unit_name(len(units)), tuple(current), tokens if lengths else None))
        current, tokens = [], 0

    for sid in sorted(keys):
        n = int(lengths[sid]) if lengths is not None else 0
        over = unit_tokens is not None and current and tokens + n > unit_tokens
        if len(current) >= unit_size or over:
            cut()
        current.append(sid)
        tokens += n
    cut()
    return units


@dataclass(frozen=True)
class Plan:
    """What the store holds once every unit is committed (the plan record's content)."""

    unit_size: int
    unit_tokens: int | None
    manifest: dict[str, Any]
    units: tuple[Unit, ...]
    sha256: str = ""  # of the plan record as stored: every index names it

    def body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "kind": "plan",
            "unit_size": self.unit_size,
            "unit_tokens": self.unit_tokens,
            "manifest": self.manifest,
            "units": [{"unit": u.name, "ids": list(u.ids), "tokens": u.tokens} for u in self.units],
        }

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Plan:
        if body.get("format") != FORMAT or body.get("kind") != "plan":
            raise StoreError(f"not a unit store plan: format {body.get('format')!r}")
        if int(body.get("version", 0)) > VERSION:
            raise StoreError(f"unit store version {body['version']} is newer than {VERSION}")
        units = tuple(Unit(u["unit"], tuple(u["ids"]), u.get("tokens")) for u in body["units"])
        digest = hashlib.sha256(objects.encode_record(body)).hexdigest()
        return cls(
            int(body["unit_size"]), body.get("unit_tokens"), dict(body["manifest"]), units, digest
        )

    def unit(self, name: str) -> Unit:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(f"no unit {name!r} in the plan")


def plan_diff(have: Plan, want: Plan) -> str:
    diffs = []
    if have.unit_size != want.unit_size:
        diffs.append(f"unit_size {have.unit_size} != {want.unit_size}")
    if have.unit_tokens != want.unit_tokens:
        diffs.append(f"unit_tokens {have.unit_tokens} != {want.unit_tokens}")
    for key in IDENTITY_KEYS:
        if have.manifest.get(key) != want.manifest.get(key):
            diffs.append(f"{key} {have.manifest.get(key)!r} != {want.manifest.get(key)!r}")
    if [u.ids for u in have.units] != [u.ids for u in want.units]:
        a = {i for u in have.units for i in u.ids}
        b = {i for u in want.units for i in u.ids}
        diffs.append(f"sample ids differ ({len(a - b)} only planned, {len(b - a)} only asked)")
    return "; ".join(diffs)
