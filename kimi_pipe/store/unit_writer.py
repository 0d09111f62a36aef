"""Writing one claimed unit of a unit store: rows kept as their stored bytes, streamed out
as data objects every `part_bytes`, then the unit's index (the commit).

The store (`kimi_pipe.store.units.UnitStore`) and its lease are seen here only through the
two small protocols below, so this module does not import the store that creates writers.
"""

from __future__ import annotations

import json
import logging
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from fsspec import AbstractFileSystem

from kimi_pipe.errors import ConfigError, StoreError
from kimi_pipe.store import objects
from kimi_pipe.store.hidden_store import (
    FP8,
    state_dtypes,
    stored_states,
    torch_dtype,
)
from kimi_pipe.store.teacher_rounding import (
    RoundingCounts,
    TeacherHead,
)
from kimi_pipe.store.unit_plan import FORMAT, VERSION, Plan, Unit

log = logging.getLogger(__name__)

DATA_DIR = "data"
PART_SUFFIX = ".safetensors"
DEFAULT_PART_BYTES = 256 << 20  # a writer holds at most about this much of a unit in memory

# safetensors dtype names of what a unit holds (little-endian, like the safetensors library).
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.int64: "I64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
}


class UnitTarget(Protocol):
    """What a writer needs of the store: where objects go, the plan, the commit."""

    fs: AbstractFileSystem

    @property
    def plan(self) -> Plan: ...

    def path(self, rel: str) -> str: ...

    def publish_index(self, unit: str, body: dict[str, Any]) -> tuple[dict[str, Any], bool]: ...


class HeldLease(Protocol):
    """What a writer needs of its lease: which unit and attempt, and ending it."""

    unit: Unit
    owner: str
    generation: int

    @property
    def attempt(self) -> str: ...

    def superseded(self) -> bool: ...

    def release(self) -> None: ...


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """A CPU tensor's bytes as safetensors stores them (C order, little-endian)."""
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def safetensors_header(
    specs: Mapping[str, tuple[torch.dtype, Sequence[int], int]], metadata: Mapping[str, str]
) -> bytes:
    """The header of a safetensors file whose tensors follow in sorted key order, so that the
    data can be streamed after it instead of built in memory first."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for key in sorted(specs):
        dtype, shape, nbytes = specs[key]
        header[key] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


@dataclass
class _Column:
    dtype: torch.dtype
    width: tuple[int, ...]
    chunks: list[bytes] = field(default_factory=list)
    rows: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class CommitResult:
    unit: str
    ours: bool  # False: an earlier commit of this unit stands, this attempt is discarded
    attempt: str
    samples: int
    skipped: int
    tokens: int


class UnitWriter:
    """Fill one claimed unit and commit it. Rows are kept as their stored bytes and written
    out as a data object every `part_bytes` (and at commit), so a writer holds at most about
    min(unit, part_bytes) of state in memory, however long the run."""

    def __init__(
        self,
        store: UnitTarget,
        lease: HeldLease,
        *,
        part_bytes: int = DEFAULT_PART_BYTES,
        head_weight: torch.Tensor | None = None,
    ) -> None:
        if sys.byteorder != "little":
            raise StoreError("the unit store writes safetensors bytes as they are in memory")
        if part_bytes < 1:
            raise ConfigError(f"part_bytes must be >= 1, got {part_bytes}")
        self.store = store
        self.lease = lease
        self.unit = lease.unit
        self.part_bytes = part_bytes
        manifest = store.plan.manifest
        self.state_dtypes = state_dtypes(manifest)
        self.hidden_size = int(manifest["hidden_size"])
        self.n_aux = len(manifest["layer_ids"])
        # What the capture loop casts states to before its NaN/inf check (as StoreWriter).
        self.dtype = torch_dtype(manifest["dtype"])
        if FP8 in self.state_dtypes.values() and self.dtype == torch.bfloat16:
            self.dtype = torch.float32
        self.teacher: TeacherHead | None = None
        self.rounding = RoundingCounts()
        if head_weight is not None and self.state_dtypes["hidden_state"] == FP8:
            if "final_rounding" not in manifest:
                raise ConfigError("a teacher-keeping fp8 store needs final_rounding in its plan")
            norm = manifest.get("final_norm") if manifest.get("final_state") == "pre_norm" else None
            self.teacher = TeacherHead(head_weight, norm, torch_dtype(manifest["dtype"]))
        self._wanted = set(self.unit.ids)
        self.done_ids: set[str] = set()  # written or skipped (the capture loop's Sink API)
        self._issues: list[list[str]] = []
        self._samples: list[list[Any]] = []  # [id, part number, offset, length]
        self._objects: list[dict[str, Any]] = []
        self._columns: dict[str, _Column] = {}
        self._part_rows: list[tuple[str, int, int]] = []
        self._buffered = 0
        self.peak_buffered = 0  # most bytes of rows held at once (the memory bound)
        self.tokens = 0
        self._result: CommitResult | None = None

    def _accept(self, sample_id: str) -> None:
        if self._result is not None:
            raise StoreError(f"unit {self.unit.name} is already committed")
        if sample_id not in self._wanted:
            raise ValueError(f"sample {sample_id!r} is not in unit {self.unit.name}")
        if sample_id in self.done_ids:
            raise ValueError(f"sample {sample_id!r} was already added to unit {self.unit.name}")

    def add(
        self,
        sample_id: str | int,
        input_ids: Sequence[int] | torch.Tensor,
        loss_mask: Sequence[int] | torch.Tensor,
        aux: torch.Tensor,
        final: torch.Tensor,
    ) -> None:
        """One sample of this unit: aux [L, k*H] (or [1, L, k*H]), final [L, H]."""
        sid = str(sample_id)
        self._accept(sid)
        ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1)
        mask = torch.as_tensor(loss_mask, dtype=torch.int64).reshape(-1)
        aux = aux.detach().squeeze(0) if aux.dim() == 3 else aux.detach()
        final = final.detach().squeeze(0) if final.dim() == 3 else final.detach()
        n = ids.numel()
        expected = {
            "loss_mask": (tuple(mask.shape), (n,)),
            "aux": (tuple(aux.shape), (n, self.n_aux * self.hidden_size)),
            "final": (tuple(final.shape), (n, self.hidden_size)),
        }
        for name, (got, want) in expected.items():
            if got != want:
                raise ValueError(f"sample {sid!r}: {name} has shape {got}, expected {want}")
        if n == 0:
            raise ValueError(f"sample {sid!r} has no tokens")
        tensors = {"input_ids": ids, "loss_mask": mask, **self._stored(aux, final, mask)}
        offset = self._part_rows[-1][1] + self._part_rows[-1][2] if self._part_rows else 0
        for key, t in tensors.items():
            col = self._columns.get(key)
            if col is None:
                col = self._columns[key] = _Column(t.dtype, tuple(t.shape[1:]))
            data = _tensor_bytes(t)
            col.chunks.append(data)
            col.rows += n
            col.nbytes += len(data)
            self._buffered += len(data)
        self.peak_buffered = max(self.peak_buffered, self._buffered)
        self._part_rows.append((sid, offset, n))
        self.done_ids.add(sid)
        self.tokens += n
        if self._buffered >= self.part_bytes:
            self._flush_part()

    def _stored(
        self, aux: torch.Tensor, final: torch.Tensor, loss_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Each state in its stored dtype (+ fp8 scales): hidden_store's per-row format."""
        return stored_states(
            aux, final, loss_mask, self.state_dtypes, self.n_aux, self.teacher, self.rounding
        )

    def skip(self, sample_id: str | int, code: str, detail: str = "") -> None:
        """Record that a sample of this unit is not stored (NaN/inf, OOM, bad capture): the
        unit can still commit, and its index says why the sample is missing."""
        sid = str(sample_id)
        self._accept(sid)
        self._issues.append([sid, code, detail])
        self.done_ids.add(sid)

    def _flush_part(self) -> None:
        """Stream the buffered rows into this attempt's next data object (hidden_store's
        shard format: tensors concatenated on the token axis, sample offsets in metadata)."""
        if not self._part_rows:
            return
        number = len(self._objects)
        rel = objects.join(
            DATA_DIR, self.unit.name, self.lease.attempt, f"part-{number:05d}{PART_SUFFIX}"
        )
        specs = {k: (c.dtype, (c.rows, *c.width), c.nbytes) for k, c in self._columns.items()}
        meta = {"samples": json.dumps([list(r) for r in self._part_rows])}
        with objects.hashing_writer(self.store.fs, self.store.path(rel)) as w:
            w.write(safetensors_header(specs, meta))
            for key in sorted(self._columns):
                chunks = self._columns[key].chunks
                while chunks:  # free each row's bytes as soon as they are written
                    w.write(chunks.pop(0))
        self._objects.append({"path": rel, "size": w.size, "sha256": w.sha256})
        self._samples.extend([sid, number, off, n] for sid, off, n in self._part_rows)
        self._columns.clear()
        self._part_rows = []
        self._buffered = 0

    def index_body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "kind": "unit_index",
            "unit": self.unit.name,
            "plan_sha256": self.store.plan.sha256,
            "attempt": self.lease.attempt,
            "owner": self.lease.owner,
            "generation": self.lease.generation,
            "objects": self._objects,
            "samples": self._samples,
            "issues": self._issues,
            "tokens": self.tokens,
        }

    def _publish(self, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Create the unit's index unless one stands: the commit point."""
        return self.store.publish_index(self.unit.name, body)

    def commit(self) -> CommitResult:
        """Write the last data object, then the index (the commit), then end the lease.
        Every sample of the unit must have been added or skipped."""
        if self._result is not None:
            return self._result
        missing = self._wanted - self.done_ids
        if missing:
            raise StoreError(
                f"unit {self.unit.name}: {len(missing)} samples neither added nor skipped "
                f"(e.g. {sorted(missing)[:3]})"
            )
        self._flush_part()
        if self.lease.superseded():
            log.warning("unit %s: committing after losing the lease", self.unit.name)
        standing, ours = self._publish(self.index_body())
        if not ours:
            log.warning(
                "unit %s: already committed by %s; this attempt's objects are orphans",
                self.unit.name,
                standing.get("attempt"),
            )
        self.lease.release()
        self._result = CommitResult(
            self.unit.name,
            ours,
            str(standing["attempt"]),
            len(standing["samples"]),
            len(standing["issues"]),
            int(standing["tokens"]),
        )
        return self._result
