"""Sharded, indexed, resumable store of EAGLE-3 hidden states.

Layout of a store directory::

    manifest.json            what the states are (model, layer ids + convention, final state, ...)
    shards/shard_00000.safetensors
                             many samples concatenated along the token axis:
                             aux_hidden_state [T, 3H], hidden_state [T, H] (manifest dtype),
                             input_ids [T] int64, loss_mask [T] int64; the metadata holds the
                             sample ids, offsets and lengths, so a shard is self-describing
    index.jsonl              one line per sample: {"id", "shard", "offset", "length"}
    tokens/                  a Hugging Face `datasets` dataset (save_to_disk):
                             id, input_ids, loss_mask
                             (written by `StoreWriter.close()`)

Writer API (used by every extract backend)::

    manifest = make_manifest(model="...", num_layers=30, layer_ids=[1, 14, 26],
                             layer_convention="output_of_layer", hidden_size=576,
                             dtype="bfloat16", loss_mask="...", source_runs=["runs/x"],
                             backend="hf")
    with StoreWriter(path, manifest, shard_samples=256) as w:
        for ...:
            if sample_id in w.done_ids:        # resume: skip what is committed
                continue
            w.add(sample_id, input_ids, loss_mask, aux, final)   # aux [L, 3H], final [L, H]
    # leaving the block calls w.close() (flush + tokens dataset); w.flush() commits a shard now.

Crash safety: a shard is written to ``*.tmp`` and renamed (atomic), then its index lines are
appended in one write and fsync'ed. On reopen the writer deletes stray ``*.tmp`` files and
rebuilds index.jsonl from the committed shards' own metadata (a torn or lost index line does
not lose a sample, and a line whose shard never landed is dropped). So a killed run resumes
after its last complete shard and never stores a sample twice.

Reader API::

    store = HiddenStore(path)
    store.manifest, len(store), store.ids, "some-id" in store
    store["some-id"] -> {"input_ids" [L] int64, "loss_mask" [L] int64,
                         "aux_hidden_state" [L, 3H], "hidden_state" [L, H]}

Compact storage (`dtype="fp8_e4m3"`, per state with `final_dtype`): a state is kept as
`float8_e4m3fn` with one float32 scale per row, a row being one token's state of one layer
(H values): scale = amax(|row|) / 448, stored value = row / scale. The shard then also holds
`<state>_scale` [T, k] (k = 3 for aux, 1 for the final state). The manifest records it
(`store_dtype` per state, `scale_layout`) and its `dtype` becomes the dtype readers return
(bfloat16): `store[id]` dequantizes (fp8 value x scale, in float32, then cast), so every reader
sees plain tensors. `store.raw(id)` gives the stored tensors and scales as they are.
Given the LM head (`head_weight`), the writer rounds an fp8 final state so that the head's
argmax stays the plain store's (manifest `final_rounding`; kimi_pipe.store.teacher_rounding).

Why about 570 lines: the writer and the reader of one on-disk format (manifest, shards,
index, fp8 scales) change together whenever the format does.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kimi_pipe.errors import ConfigError, MissingFile
from kimi_pipe.store import atomic
from kimi_pipe.store.arrow_rows import save_rows
from kimi_pipe.store.teacher_rounding import DOC as ROUNDING_DOC
from kimi_pipe.store.teacher_rounding import (
    RoundingCounts,
    TeacherHead,
    quantize_keeping_argmax,
    teacher_rows,
)

FORMAT = "kimi_pipe.hidden_store"
VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.jsonl"
SHARDS = "shards"
TOKENS = "tokens"

# Keys that must agree when a writer reopens an existing store, or when shard parts merge
# into one: mixing them would corrupt it.
IDENTITY_KEYS = (
    "model",
    "layer_ids",
    "layer_convention",
    "final_state",
    "dtype",
    "store_dtype",
    "hidden_size",
    "loss_mask",
    "final_rounding",
)

LAYER_CONVENTIONS = {
    # hidden_states[i + 1] of transformers = what decoder layer i returns (SpecForge, ModelOpt).
    "output_of_layer": "aux state k is the output of decoder layer layer_ids[k] (0-based)",
    # SGLang / vLLM capture ids: the input of layer i, i.e. the output of layer i - 1.
    "input_of_layer": "aux state k is the input of decoder layer layer_ids[k] (0-based)",
}
FINAL_STATES = {
    "post_norm": "hidden_state is the last layer's output after the final norm (SpecForge)",
    "pre_norm": (
        "hidden_state is the last layer's output before the final norm (speculators); with "
        "final_norm (weight, eps) in the manifest the post-norm state is computed at export"
    ),
}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


# Compact storage: float8 e4m3 values with one float32 scale per row (see the module doc).
FP8 = "fp8_e4m3"
FP8_TORCH = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_TORCH).max)  # 448
FP8_READ_DTYPE = "bfloat16"  # what readers of an fp8 store get (the training dtype)
STATE_KEYS = ("aux_hidden_state", "hidden_state")
SCALE_SUFFIX = "_scale"
SCALE_LAYOUT = (
    "per_row: one float32 scale per token per layer state (H values), amax(|row|) / 448; "
    "shard tensor <state>_scale [T, k]; value = float8_e4m3fn value x scale"
)


def torch_dtype(name: str) -> torch.dtype:
    """Map a config dtype name to torch, with a clear error for anything else."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}") from None


def quantize_rows(x: torch.Tensor, rows_per_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k*H] float -> (float8_e4m3fn [T, k*H], float32 scales [T, k]), one scale per row."""
    t = x.shape[0]
    rows = x.float().reshape(t, rows_per_token, -1)
    scale = (rows.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-12)
    q = (rows / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_TORCH)
    return q.reshape(t, -1), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_rows: fp8 value x its row's scale, in float32, cast to `dtype`."""
    t, k = scale.shape
    rows = q.float().reshape(t, k, -1) * scale.float().unsqueeze(-1)
    return rows.reshape(t, -1).to(dtype)


def state_dtypes(manifest: dict[str, Any]) -> dict[str, str]:
    """How each state is stored: {"aux_hidden_state": name, "hidden_state": name}."""
    stored = manifest.get("store_dtype")
    if isinstance(stored, dict):
        return {k: str(stored.get(k, manifest["dtype"])) for k in STATE_KEYS}
    return {k: str(manifest["dtype"]) for k in STATE_KEYS}


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low/middle/high layers as "output of layer" ids: [1, N//2 - 1, N - 4]."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if ids != sorted(set(ids)):
        raise ValueError(
            f"the default EAGLE-3 layer rule gives {ids} for {num_layers} layers; "
            "set extract.layer_ids explicitly"
        )
    return ids


def make_manifest(
    *,
    model: str,
    num_layers: int,
    layer_ids: Sequence[int],
    hidden_size: int,
    dtype: str,
    loss_mask: str,
    source_runs: Sequence[str],
    backend: str,
    layer_convention: str = "output_of_layer",
    final_state: str = "post_norm",
    final_dtype: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build a manifest dict, validating the conventions so every store states them.

    `dtype`: how the states are stored (a torch dtype name, or `fp8_e4m3`); `final_dtype`:
    the final state's, when it differs (null = `dtype`). With fp8 for any state, the manifest's
    `dtype` is what readers return and `store_dtype` / `scale_layout` say what is on disk.
    """
    if layer_convention not in LAYER_CONVENTIONS:
        raise ValueError(f"layer_convention must be one of {sorted(LAYER_CONVENTIONS)}")
    if final_state not in FINAL_STATES:
        raise ValueError(f"final_state must be one of {sorted(FINAL_STATES)}")
    per_state = {"aux_hidden_state": dtype, "hidden_state": final_dtype or dtype}
    plain = {d for d in per_state.values() if d != FP8}
    for d in plain:
        torch_dtype(d)
    if len(plain) > 1:
        raise ValueError(
            f"aux and final states stored as {sorted(plain)}: only fp8_e4m3 may differ from "
            "the other state's dtype"
        )
    compact = FP8 in per_state.values()
    read_dtype = plain.pop() if plain else FP8_READ_DTYPE
    if compact and read_dtype == "float32":
        read_dtype = FP8_READ_DTYPE  # fp8 + float32 would read as float32: keep the training dtype
    dtype = read_dtype if compact else dtype
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "model": model,
        "num_layers": int(num_layers),
        "layer_ids": [int(i) for i in layer_ids],
        "layer_convention": layer_convention,
        "layer_convention_doc": LAYER_CONVENTIONS[layer_convention],
        "final_state": final_state,
        "final_state_doc": FINAL_STATES[final_state],
        "dtype": dtype,
        "hidden_size": int(hidden_size),
        "aux_hidden_size": int(hidden_size) * len(layer_ids),
        "loss_mask": loss_mask,
        "source_runs": [str(s) for s in source_runs],
        "backend": backend,
    }
    if compact:
        manifest["store_dtype"] = per_state
        manifest["scale_layout"] = SCALE_LAYOUT
    if extra:
        manifest.update(extra)
    return manifest


@dataclass(frozen=True)
class IndexEntry:
    """Where one sample lives: token rows [offset, offset + length) of a shard."""

    id: str
    shard: str
    offset: int
    length: int


def _shard_name(number: int) -> str:
    return f"shard_{number:05d}.safetensors"


def _shard_number(name: str) -> int:
    return int(name.removeprefix("shard_").removesuffix(".safetensors"))


def _write_json_atomic(path: Path, obj: Any) -> None:
    atomic.write_json(path, obj, indent=2, sort_keys=True)


def _read_index(path: Path) -> list[IndexEntry]:
    """Read index.jsonl; a torn last line (crash mid-write) is ignored, not fatal."""
    entries: list[IndexEntry] = []
    if not path.exists():
        return entries
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            entries.append(IndexEntry(str(d["id"]), d["shard"], int(d["offset"]), int(d["length"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return entries


def _shard_entries(shard_path: Path) -> list[IndexEntry]:
    """Index entries recorded in a shard's own metadata."""
    with safe_open(str(shard_path), framework="pt") as f:
        meta = f.metadata() or {}
    samples = json.loads(meta.get("samples", "[]"))
    return [IndexEntry(str(s[0]), shard_path.name, int(s[1]), int(s[2])) for s in samples]


def _index_lines(entries: Sequence[IndexEntry]) -> str:
    return "".join(
        json.dumps({"id": e.id, "shard": e.shard, "offset": e.offset, "length": e.length}) + "\n"
        for e in entries
    )


def stored_states(
    aux: torch.Tensor,
    final: torch.Tensor,
    loss_mask: torch.Tensor,
    dtypes: dict[str, str],
    n_aux: int,
    teacher: TeacherHead | None,
    rounding: RoundingCounts,
) -> dict[str, torch.Tensor]:
    """One sample's states as a store keeps them, each in its stored dtype (+ fp8 scales); an
    fp8 final state keeps the teacher's argmax where `teacher` is given (counted in
    `rounding`). The shard writer here and the unit writer (store/unit_writer.py) share it."""
    out: dict[str, torch.Tensor] = {}
    for key, value, rows in (("aux_hidden_state", aux, n_aux), ("hidden_state", final, 1)):
        if key == "hidden_state" and teacher is not None:
            q, scale, counts = quantize_keeping_argmax(
                value.to("cpu"), teacher, rows_read=teacher_rows(loss_mask)
            )
            out[key], out[key + SCALE_SUFFIX] = q, scale
            rounding.add(counts)
        elif dtypes[key] == FP8:
            out[key], out[key + SCALE_SUFFIX] = quantize_rows(value.to("cpu"), rows)
        else:
            out[key] = value.to("cpu", torch_dtype(dtypes[key]))
    return out


class StoreWriter:
    """Append samples to a store, committing one shard every `shard_samples` samples.

    `done_ids` holds the ids already committed (from a previous run too): callers skip them.
    Adding a committed id again raises, so a resumed run cannot duplicate a sample.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        manifest: dict[str, Any],
        shard_samples: int = 256,
        shard_tokens: int | None = None,
        head_weight: torch.Tensor | None = None,
    ) -> None:
        """`head_weight`: the LM head [vocab, H]; with an fp8 final state it makes the writer
        keep the head's argmax of the plain store (teacher_rounding), recorded in the manifest."""
        if shard_samples < 1:
            raise ValueError("shard_samples must be >= 1")
        self.path = Path(path)
        self.shard_samples = shard_samples
        # Cap on tokens per shard too, so one shard of long samples stays a sane size.
        self.shard_tokens = shard_tokens
        self.state_dtypes = state_dtypes(manifest)
        # dtype: what the extract loop casts a sample to before its inf check. An fp8 state
        # is quantized from float32 (one rounding, not two); bf16 has float32's range.
        self.dtype = torch_dtype(manifest["dtype"])
        if FP8 in self.state_dtypes.values() and self.dtype == torch.bfloat16:
            self.dtype = torch.float32
        self.hidden_size = int(manifest["hidden_size"])
        self.n_aux = len(manifest["layer_ids"])
        self.teacher: TeacherHead | None = None
        self.rounding = RoundingCounts()
        if head_weight is not None and self.state_dtypes["hidden_state"] == FP8:
            norm = manifest.get("final_norm") if manifest.get("final_state") == "pre_norm" else None
            if manifest.get("final_state") == "pre_norm" and not norm:
                raise ConfigError("an fp8 pre-norm final state needs final_norm to keep the head")
            self.teacher = TeacherHead(head_weight, norm, torch_dtype(manifest["dtype"]))
            manifest = {**manifest, "final_rounding": ROUNDING_DOC}
        (self.path / SHARDS).mkdir(parents=True, exist_ok=True)
        self.manifest = self._open_manifest(manifest)
        entries = self._recover()
        self.done_ids: set[str] = {e.id for e in entries}
        shard_numbers = [_shard_number(e.shard) for e in entries]
        self._next_shard = max(shard_numbers, default=-1) + 1
        # (id, input_ids, loss_mask, {stored tensor name: tensor}) per buffered sample.
        self._buffer: list[tuple[str, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = []
        self._buffer_tokens = 0
        self._pending: set[str] = set()
        self.committed_shards = 0  # shards committed by this writer (not by earlier runs)

    # --- opening / recovery -------------------------------------------------------------
    def _open_manifest(self, manifest: dict[str, Any]) -> dict[str, Any]:
        path = self.path / MANIFEST
        if path.exists():
            old = json.loads(path.read_text())
            diff = [k for k in IDENTITY_KEYS if old.get(k) != manifest.get(k)]
            if diff:
                detail = ", ".join(f"{k}: {old.get(k)!r} != {manifest.get(k)!r}" for k in diff)
                raise ConfigError(
                    f"store {self.path} was written with different settings ({detail}); "
                    "use another output directory or delete it"
                )
            runs = list(dict.fromkeys([*old.get("source_runs", []), *manifest["source_runs"]]))
            manifest = {**old, **manifest, "source_runs": runs}
        _write_json_atomic(path, manifest)
        return manifest

    def _recover(self) -> list[IndexEntry]:
        """Make index.jsonl list exactly the committed shards; drop stray temp files."""
        shard_dir = self.path / SHARDS
        for tmp in shard_dir.glob("*.tmp"):
            tmp.unlink()
        # The shards' own metadata is the truth: it survives a torn or lost index line.
        indexed: list[IndexEntry] = []
        for shard in sorted(shard_dir.glob("shard_*.safetensors")):
            indexed.extend(_shard_entries(shard))
        # Rewrite the index whole: it may have had a torn line or lines of a lost shard.
        atomic.write_text(self.path / INDEX, _index_lines(indexed))
        return indexed

    # --- writing -------------------------------------------------------------------------
    def add(
        self,
        sample_id: str | int,
        input_ids: Sequence[int] | torch.Tensor,
        loss_mask: Sequence[int] | torch.Tensor,
        aux: torch.Tensor,
        final: torch.Tensor,
    ) -> None:
        """Buffer one sample; aux is [L, 3H] (or [1, L, 3H]), final is [L, H] (or [1, L, H])."""
        sid = str(sample_id)
        if sid in self.done_ids or sid in self._pending:
            raise ValueError(f"sample {sid!r} is already in the store {self.path}")
        ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1)
        mask = torch.as_tensor(loss_mask, dtype=torch.int64).reshape(-1)
        aux = aux.detach().squeeze(0) if aux.dim() == 3 else aux.detach()
        final = final.detach().squeeze(0) if final.dim() == 3 else final.detach()
        n = ids.numel()
        expected = {
            "loss_mask": (mask.shape, (n,)),
            "aux": (tuple(aux.shape), (n, self.n_aux * self.hidden_size)),
            "final": (tuple(final.shape), (n, self.hidden_size)),
        }
        for name, (got, want) in expected.items():
            if tuple(got) != want:
                raise ValueError(f"sample {sid!r}: {name} has shape {tuple(got)}, expected {want}")
        if n == 0:
            raise ValueError(f"sample {sid!r} has no tokens")
        self._buffer.append((sid, ids, mask, self._stored(aux, final, mask)))
        self._pending.add(sid)
        self._buffer_tokens += n
        full = len(self._buffer) >= self.shard_samples
        if full or (self.shard_tokens is not None and self._buffer_tokens >= self.shard_tokens):
            self.flush()

    def _stored(
        self, aux: torch.Tensor, final: torch.Tensor, loss_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The shard tensors of one sample: each state in its stored dtype (+ fp8 scales)."""
        return stored_states(
            aux, final, loss_mask, self.state_dtypes, self.n_aux, self.teacher, self.rounding
        )

    def flush(self) -> None:
        """Commit the buffered samples as one shard (atomic), then index them."""
        if not self._buffer:
            return
        name = _shard_name(self._next_shard)
        entries: list[IndexEntry] = []
        offset = 0
        for sid, ids, _, _ in self._buffer:
            entries.append(IndexEntry(sid, name, offset, ids.numel()))
            offset += ids.numel()
        tensors = {
            "input_ids": torch.cat([b[1] for b in self._buffer]),
            "loss_mask": torch.cat([b[2] for b in self._buffer]),
        }
        for key in self._buffer[0][3]:
            tensors[key] = torch.cat([b[3][key] for b in self._buffer]).contiguous()
        meta = {"samples": json.dumps([[e.id, e.offset, e.length] for e in entries])}
        final_path = self.path / SHARDS / name
        with atomic.atomic_path(final_path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
        with atomic.open_append(self.path / INDEX) as f:
            f.write(_index_lines(entries).encode())
            f.flush()
            os.fsync(f.fileno())
        self.done_ids.update(e.id for e in entries)
        self._pending.clear()
        self._buffer.clear()
        self._buffer_tokens = 0
        self._next_shard += 1
        self.committed_shards += 1

    def close(self) -> None:
        """Flush, then write the token data as a `datasets` dataset (tokens/)."""
        self.flush()
        write_tokens_dataset(self.path)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # On an error keep what is committed, but do not commit a half-built shard.
        if exc_type is None:
            self.close()


def write_tokens_dataset(path: str | os.PathLike[str]) -> None:
    """(Re)write tokens/ from the committed shards: id, input_ids, loss_mask per sample,
    streamed (store/arrow_rows.py): memory follows a batch of rows, not the store."""
    store = HiddenStore(path)

    def rows() -> Iterator[dict[str, Any]]:
        for sid in store.ids:
            t = store.tokens(sid)
            yield {
                "id": sid,
                "input_ids": t["input_ids"].tolist(),
                "loss_mask": t["loss_mask"].tolist(),
            }

    out = Path(path) / TOKENS
    with atomic.atomic_path(out) as tmp:
        save_rows(rows(), Path(tmp), {"id": [], "input_ids": [], "loss_mask": []})
        if out.exists():
            shutil.rmtree(out)  # a directory cannot be renamed over a non-empty one


class HiddenStore:
    """Read-only view of a store: `store[sample_id]` returns one sample as tensors."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.exists():
            raise MissingFile(
                f"{manifest_path} not found: not a hidden-state store "
                "(make one with `python -m kimi_pipe extract`)"
            )
        self.manifest: dict[str, Any] = json.loads(manifest_path.read_text())
        shard_dir = self.path / SHARDS
        committed = {p.name for p in shard_dir.glob("shard_*.safetensors")}
        self._index: dict[str, IndexEntry] = {}
        for e in _read_index(self.path / INDEX):
            if e.shard in committed:
                self._index.setdefault(e.id, e)

    @property
    def ids(self) -> list[str]:
        """Sample ids in store order (shard, then offset)."""
        return sorted(self._index, key=lambda i: (self._index[i].shard, self._index[i].offset))

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, sample_id: object) -> bool:
        return str(sample_id) in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self.ids)

    def entry(self, sample_id: str | int) -> IndexEntry:
        try:
            return self._index[str(sample_id)]
        except KeyError:
            raise KeyError(f"sample {sample_id!r} is not in the store {self.path}") from None

    def _read(self, sample_id: str | int, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        e = self.entry(sample_id)
        out: dict[str, torch.Tensor] = {}
        # get_slice reads only this sample's rows, not the whole shard.
        with safe_open(str(self.path / SHARDS / e.shard), framework="pt") as f:
            for k in keys:
                # clone: own the rows, not a view of the whole shard (torch.save of a view
                # would write the entire shard).
                out[k] = f.get_slice(k)[e.offset : e.offset + e.length].clone()
        return out

    def tokens(self, sample_id: str | int) -> dict[str, torch.Tensor]:
        """input_ids and loss_mask only (cheap)."""
        return self._read(sample_id, ("input_ids", "loss_mask"))

    @property
    def state_dtypes(self) -> dict[str, str]:
        return state_dtypes(self.manifest)

    def raw(self, sample_id: str | int) -> dict[str, torch.Tensor]:
        """One sample's tensors as stored: fp8 states with their `<state>_scale` rows."""
        keys = ["input_ids", "loss_mask"]
        for key, dtype in self.state_dtypes.items():
            keys += [key, key + SCALE_SUFFIX] if dtype == FP8 else [key]
        return self._read(sample_id, keys)

    def __getitem__(self, sample_id: str | int) -> dict[str, torch.Tensor]:
        """One sample with plain states in the manifest's `dtype` (fp8 dequantized)."""
        out = self.raw(sample_id)
        read_dtype = torch_dtype(self.manifest["dtype"])
        for key in STATE_KEYS:
            scale = out.pop(key + SCALE_SUFFIX, None)
            if scale is not None:
                out[key] = dequantize_rows(out[key], scale, read_dtype)
        return out

    def total_tokens(self) -> int:
        return sum(e.length for e in self._index.values())
