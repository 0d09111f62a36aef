"""Opening the stores of an export: local hidden stores, local unit stores and unit stores
on an object store (`s3://...`), sorted by reference and checked to mix."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kimi_pipe.errors import ConfigError, MissingFile
from kimi_pipe.store.hidden_store import HiddenStore
from kimi_pipe.store.unit_reader import UnitHiddenStore, open_local_store
from kimi_pipe.store.units import UnitStore

_COMPATIBLE_KEYS = (
    "model",
    "num_layers",
    "layer_ids",
    "layer_convention",
    "final_state",
    "final_norm",
    "hidden_size",
    "dtype",
    "store_dtype",
    "final_rounding",
    "loss_mask",
)


def is_url(ref: str | os.PathLike[str]) -> bool:
    """A store given as an fsspec URL (`s3://bucket/prefix`, `gs://...`), not a local path."""
    return "://" in str(ref) and not str(ref).startswith("file://")


def store_refs(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """The stores' references, sorted and deduplicated: local paths resolved, URLs as given
    (without a trailing slash). The plan's store positions point into this list."""
    refs = {str(p).rstrip("/") if is_url(p) else str(Path(p).resolve()) for p in paths}
    return sorted(refs)


def open_stores(
    paths: Sequence[str | os.PathLike[str]], storage_options: Mapping[str, Any] | None = None
) -> list[HiddenStore]:
    """Open the stores sorted by reference; refuse stores that cannot be mixed. A local
    directory holding a unit plan, or a URL (`s3://...`: a unit store on an object store,
    `storage_options` for fsspec), is read through its committed indexes only."""
    if not paths:
        raise ConfigError(
            "no stores to export: pass stores=[STORE_DIR,...] (made by python -m kimi_pipe extract)"
        )
    stores: list[HiddenStore] = []
    for ref in store_refs(paths):
        if is_url(ref):
            try:
                stores.append(
                    UnitHiddenStore(UnitStore.open(ref, **dict(storage_options or {})), url=ref)
                )
            except MissingFile:
                raise MissingFile(
                    f"store {ref} holds no unit plan: only a unit store (extract.executor="
                    "local|ray|submitit, extract.units.url) is exported from an object store"
                ) from None
            continue
        path = Path(ref)
        if not path.is_dir():
            raise MissingFile(
                f"store {path} does not exist: make one with `python -m kimi_pipe extract` "
                "(or the extract stage of a pipeline) and pass its directory in stores=[...]"
            )
        # A unit store (extract.executor=...) is read through its committed indexes only.
        stores.append(open_local_store(path))
    first = stores[0].manifest
    for s in stores[1:]:
        diff = [k for k in _COMPATIBLE_KEYS if s.manifest.get(k) != first.get(k)]
        if diff:
            detail = ", ".join(
                f"{k}: {_short(first.get(k))} vs {_short(s.manifest.get(k))}" for k in diff
            )
            raise ConfigError(f"stores {stores[0].path} and {s.path} cannot be mixed ({detail})")
    return stores


def store_name(store: HiddenStore) -> str:
    """How an export names a store: its URL (an object store) or its local path."""
    return str(getattr(store, "url", None) or store.path)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."
