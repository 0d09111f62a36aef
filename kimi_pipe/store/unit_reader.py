"""A unit store read as a hidden-state store: what export opens (docs/distributed.md).

`UnitHiddenStore` gives the `HiddenStore` interface (ids, `store[id]`, `tokens`, `raw`,
manifest) over the committed units of a `kimi_pipe.store.units.UnitStore`: its samples are
exactly those the committed indexes name, so an export of it has every sample once, whatever
executor wrote it, how many workers died or how often a unit was attempted. There is no
merge step: the indexes are the store's index.

Each data object is checked against its index's size and sha256 the first time it is read.
On local disk a sample is then sliced from the file (safetensors `get_slice`); on an object
store the object is fetched whole and the last few are kept (`cache_objects`).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load

from kimi_pipe.store import objects
from kimi_pipe.store.hidden_store import HiddenStore, IndexEntry
from kimi_pipe.store.units import PLAN, CorruptUnit, UnitStore


def is_unit_store(path: str | os.PathLike[str]) -> bool:
    """A local directory that holds a unit store's plan."""
    return any(Path(path).glob(f"{PLAN}.c*.json"))


def open_local_store(path: str | os.PathLike[str]) -> HiddenStore:
    """A local store directory, whichever way it was written: a unit store (an executor's)
    through its committed indexes, else the work-shard layout."""
    return UnitHiddenStore(path) if is_unit_store(path) else HiddenStore(path)


class UnitHiddenStore(HiddenStore):
    """Read-only view of a unit store's committed samples, as `HiddenStore` gives them."""

    def __init__(
        self,
        store: UnitStore | str | os.PathLike[str],
        cache_objects: int = 2,
        *,
        url: str | None = None,
    ) -> None:
        """`url`: how the store is named in an export (default: its local path, or its
        bucket path on an object store)."""
        self.units = store if isinstance(store, UnitStore) else UnitStore.open(str(store))
        self.local = objects.is_local(self.units.fs)
        self.path = Path(self.units.root) if self.local else Path(self.units.root.lstrip("/"))
        self.url = url or str(self.path)
        self.manifest: dict[str, Any] = dict(self.units.plan.manifest)
        self._index: dict[str, IndexEntry] = {}
        self._refs: dict[str, dict[str, Any]] = {}  # object path -> its index's reference
        for index in self.units.iter_units():
            for sid, part, offset, length in index["samples"]:
                ref = index["objects"][int(part)]
                self._refs[str(ref["path"])] = ref
                if str(sid) in self._index:  # units never share ids; a second is a bug
                    raise CorruptUnit(f"sample {sid!r} is named by two committed units")
                self._index[str(sid)] = IndexEntry(str(sid), str(ref["path"]), offset, length)
        self.skipped: dict[str, str] = {
            str(row[0]): str(row[1]) for index in self.units.iter_units() for row in index["issues"]
        }
        self._verified: set[str] = set()
        self._cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._cache_objects = max(1, cache_objects)

    def _verify_local(self, rel: str) -> str:
        """The local file of a data object, checked once against its index."""
        path = self.units.path(rel)
        if rel not in self._verified:
            ref = self._refs[rel]
            digest = hashlib.sha256()
            size = 0
            try:
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 22):
                        digest.update(chunk)
                        size += len(chunk)
            except FileNotFoundError:
                raise CorruptUnit(f"{path}: named by a committed index but missing") from None
            if size != int(ref["size"]) or digest.hexdigest() != ref["sha256"]:
                raise CorruptUnit(f"{path}: not the object its index names (size or sha256)")
            self._verified.add(rel)
        return path

    def _object(self, rel: str) -> dict[str, torch.Tensor]:

        if rel in self._cache:
            self._cache.move_to_end(rel)
            return self._cache[rel]
        tensors = load(self.units.read_object(self._refs[rel]))  # size and sha256 checked
        self._cache[rel] = tensors
        while len(self._cache) > self._cache_objects:
            self._cache.popitem(last=False)
        return tensors

    def _read(self, sample_id: str | int, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        e = self.entry(sample_id)
        rows = slice(e.offset, e.offset + e.length)
        if self.local:
            with safe_open(self._verify_local(e.shard), framework="pt") as f:
                return {k: f.get_slice(k)[rows].clone() for k in keys}
        tensors = self._object(e.shard)
        return {k: tensors[k][rows].clone() for k in keys}
