"""The unit store: hidden states in fixed-size work units on any fsspec filesystem.

One protocol for local disk, S3-compatible stores and GCS, and for any executor (Ray,
submitit, a shell loop): nothing in it renames, locks or hard-links (docs/store-units.md).

Layout under the root URL (paths relative to it)::

    plan.c0.json                     the work: sample ids cut into units (written once)
    leases/u-000042.g000003.json     claim generation 3 of unit u-000042 (owner, expiry)
    data/u-000042/<attempt>/part-00000.safetensors
                                     an attempt's data objects (hidden_store's shard format)
    index/u-000042.c0.json           the unit's index: commits it (written once)

* **Plan**: the sorted sample ids cut every `unit_size` samples (and, with `unit_tokens`,
  before a unit would pass that many tokens). It depends on the ids and these two numbers
  only, never on how many workers run, so a unit is the same work whoever does it.
* **Lease**: a worker claims a unit by creating its next lease generation (create-if-absent:
  of two claimants exactly one wins) and renews it by rewriting it (`Lease.keepalive`). A
  generation whose expiry has passed may be superseded by the next one: a dead worker loses
  its units after `lease_s` seconds.
* **Commit**: a unit's data objects go under a prefix of their own attempt first; its index
  object, naming each object with its size and sha256, is created last and only if absent.
  The first index is the commit and stays; a second commit of the unit changes nothing.
* **Read**: readers list index objects only, read only the objects an index names, and
  check each against its size and sha256. Data objects no index names (a killed writer's,
  a losing attempt's) are never read; `orphans()` lists them for deletion.

Worker API (any executor runs this loop)::

    store = UnitStore.open("s3://bucket/run/hidden", lease_s=600)
    store.ensure_plan(sample_ids, unit_size=256, manifest=make_manifest(...))
    def work(writer):                  # fill one claimed unit
        for sid in writer.unit.ids:
            writer.add(sid, input_ids, loss_mask, aux, final)   # or writer.skip(sid, code)
    run_units(store, owner, work)      # claim, fill, commit until no unit is left to claim

Reader API::

    for sid, tensors in store.iter_samples():   # committed units in plan order, verified
        ...

The plan lives in `store/unit_plan.py`, the writer of one unit in `store/unit_writer.py`;
this module holds the store (claims, commits, reading) and the lease, which share its state.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from fsspec import AbstractFileSystem
from safetensors.torch import load

from kimi_pipe.errors import ConfigError, MissingFile, StoreError
from kimi_pipe.store import objects
from kimi_pipe.store.hidden_store import (
    SCALE_SUFFIX,
    STATE_KEYS,
    dequantize_rows,
    torch_dtype,
)
from kimi_pipe.store.unit_plan import (  # noqa: F401  (FORMAT, Unit, plan_units: re-exported)
    FORMAT,
    VERSION,
    Plan,
    Unit,
    plan_diff,
    plan_units,
)
from kimi_pipe.store.unit_writer import (  # noqa: F401  (DATA_DIR, CommitResult: re-exported)
    DATA_DIR,
    DEFAULT_PART_BYTES,
    PART_SUFFIX,
    CommitResult,
    UnitWriter,
)

log = logging.getLogger(__name__)

PLAN = "plan"
INDEX_DIR = "index"
LEASE_DIR = "leases"
DEFAULT_LEASE_S = 600.0
OWNER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_LEASE_RE = re.compile(r"^(?P<unit>u-\d+)\.g(?P<gen>\d+)\.json$")
_INDEX_RE = re.compile(r"^(?P<unit>u-\d+)\.c\d+\.json$")


class CorruptUnit(StoreError):
    """A committed unit names a data object that is missing or not what its index says."""


def default_owner() -> str:
    """A worker name unique to this process: host, pid and a random tag."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:48] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def check_owner(owner: str) -> str:
    if not OWNER_RE.match(owner):
        raise ConfigError(f"worker name {owner!r}: use letters, digits, '.', '_' or '-'")
    return owner


# --- the store --------------------------------------------------------------------------------
class UnitStore:
    """A unit store at `root` on `fs` (see the module doc for the protocol)."""

    def __init__(
        self,
        fs: AbstractFileSystem,
        root: str,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        grace_s: float | None = None,
    ) -> None:
        """`lease_s`: how long a claim lasts without a renewal (a dead worker's units come
        back after it). `grace_s`: how old a torn write-once record (local disk only) must be
        before it is passed over; default `lease_s`."""
        objects.check_conditional_create(fs)
        if lease_s <= 0:
            raise ConfigError(f"lease_s must be > 0, got {lease_s}")
        self.fs = fs
        self.root = root.rstrip("/")
        self.lease_s = float(lease_s)
        self.grace_s = float(grace_s if grace_s is not None else lease_s)
        self._plan: Plan | None = None
        self._committed: dict[str, dict[str, Any]] = {}  # a commit never goes away: cached

    @classmethod
    def open(
        cls,
        url: str,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        grace_s: float | None = None,
        **storage_options: Any,
    ) -> UnitStore:
        """A store at a URL: a local path, ``s3://bucket/prefix`` (s3fs, `pip install
        kimi_pipe[s3]`), ``gs://bucket/prefix`` (gcsfs); storage_options go to fsspec."""
        fs, root = objects.open_fs(url, **storage_options)
        return cls(fs, root, lease_s=lease_s, grace_s=grace_s)

    def path(self, *parts: str) -> str:
        return objects.join(self.root, *parts)

    def relative(self, path: str) -> str:
        return path[len(self.root) + 1 :] if path.startswith(self.root + "/") else path

    # --- plan -------------------------------------------------------------------------------
    def ensure_plan(
        self,
        ids: Iterable[str | int],
        *,
        unit_size: int,
        manifest: dict[str, Any],
        lengths: Mapping[str, int] | None = None,
        unit_tokens: int | None = None,
    ) -> Plan:
        """Write the plan unless one stands; every worker may call this, the first plan wins
        and the others check that they were asked for the same work."""
        units = plan_units(ids, unit_size, lengths, unit_tokens)
        # As JSON gives it back (tuples become lists), so that plans compare equal.
        manifest = json.loads(json.dumps(manifest))
        wanted = Plan(unit_size, unit_tokens, manifest, tuple(units))
        body, _ = objects.create_once(self.fs, self.path(PLAN), wanted.body(), self.grace_s)
        plan = Plan.from_body(body)
        diff = plan_diff(plan, wanted)
        if diff:
            raise StoreError(
                f"unit store {self.root} was planned for other work ({diff}); use another "
                "output location or delete it"
            )
        self._plan = plan
        return plan

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            body = objects.read_once(self.fs, self.path(PLAN))
            if body is None:
                raise MissingFile(f"{self.root}: no unit store plan (ensure_plan writes it)")
            self._plan = Plan.from_body(body)
        return self._plan

    # --- commits ----------------------------------------------------------------------------
    def _index_base(self, unit: str) -> str:
        return self.path(INDEX_DIR, unit)

    def publish_index(self, unit: str, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Create `unit`'s index unless one stands (the commit point): the standing index,
        and whether it is `body`'s."""
        standing, ours = objects.create_once(self.fs, self._index_base(unit), body, self.grace_s)
        if ours:
            self._committed[unit] = standing
        return standing, ours

    def _checked_index(self, body: dict[str, Any] | None) -> dict[str, Any] | None:
        if body is None:
            return None
        if body.get("kind") != "unit_index" or body.get("plan_sha256") != self.plan.sha256:
            raise StoreError(
                f"{self.root}: index of unit {body.get('unit')!r} belongs to another plan"
            )
        return body

    def committed_index(self, unit: str) -> dict[str, Any] | None:
        """The index that commits `unit`, or None (not committed yet)."""
        if unit not in self._committed:
            body = self._checked_index(objects.read_once(self.fs, self._index_base(unit)))
            if body is None:
                return None
            self._committed[unit] = body
        return self._committed[unit]

    def committed(self) -> dict[str, dict[str, Any]]:
        """Every committed unit's index (one listing of index/; indexes read once each)."""
        slots: dict[str, list[str]] = {}
        for p in objects.listing(self.fs, self.path(INDEX_DIR)):
            m = _INDEX_RE.match(p.rsplit("/", 1)[-1])
            if m and m["unit"] not in self._committed:
                slots.setdefault(m["unit"], []).append(p)
        for unit, paths in slots.items():
            body = self._checked_index(objects.first_valid(self.fs, self._index_base(unit), paths))
            if body is not None:
                self._committed[unit] = body
        return dict(self._committed)

    # --- leases -----------------------------------------------------------------------------
    def _lease_path(self, unit: str, generation: int) -> str:
        return self.path(LEASE_DIR, f"{unit}.g{generation:06d}.json")

    def _lease_paths(self) -> dict[str, tuple[int, str]]:
        """Each unit's newest lease generation and its path (one listing of leases/)."""
        newest: dict[str, tuple[int, str]] = {}
        for p in objects.listing(self.fs, self.path(LEASE_DIR)):
            m = _LEASE_RE.match(p.rsplit("/", 1)[-1])
            if m and int(m["gen"]) >= newest.get(m["unit"], (-1, ""))[0]:
                newest[m["unit"]] = (int(m["gen"]), p)
        return newest

    def _unit_lease(self, unit: str) -> tuple[int, str | None]:
        paths = [str(p) for p in self.fs.glob(self.path(LEASE_DIR, f"{unit}.g*.json"))]
        gens = [(int(m["gen"]), p) for p in paths if (m := _LEASE_RE.match(p.rsplit("/", 1)[-1]))]
        return max(gens) if gens else (-1, None)

    def lease_expiry(self, path: str) -> float:
        """When the lease at `path` ends. A torn lease (local disk, a writer killed while
        renewing) counts as renewed when it was last written."""
        body = objects.decode_record(objects.read_bytes(self.fs, path))
        if body is not None:
            return float(body["expires"])
        written = objects.modified_s(self.fs, path)
        return (written or 0.0) + self.lease_s

    def claim(self, unit: Unit | str, owner: str) -> Lease | None:
        """Claim `unit` for `owner`: a Lease, or None when it is committed or held by a live
        lease. Of workers claiming the same free unit at once, exactly one gets it."""
        check_owner(owner)
        u = self.plan.unit(unit) if isinstance(unit, str) else unit
        if self.committed_index(u.name) is not None:
            return None
        self.fs.invalidate_cache()
        generation, path = self._unit_lease(u.name)
        if path is not None and time.time() < self.lease_expiry(path):
            return None
        lease = Lease(self, u, generation + 1, owner, time.time() + self.lease_s)
        try:
            objects.create_exclusive(self.fs, lease.path, objects.encode_record(lease.body()))
        except FileExistsError:
            return None  # another worker took this generation first
        if self.committed_index(u.name) is not None:  # committed while we claimed
            lease.release()
            return None
        if generation >= 0:
            log.warning("unit %s: lease generation %d expired; taken over", u.name, generation)
        return lease

    def claim_next(self, owner: str) -> Lease | None:
        """Claim some unit that is neither committed nor held; None when there is none.
        Workers start their scan at different places (a hash of the owner) to collide less."""
        committed = self.committed()
        newest = self._lease_paths()
        now = time.time()
        free = [
            u
            for u in self.plan.units
            if u.name not in committed
            and (u.name not in newest or self.lease_expiry(newest[u.name][1]) <= now)
        ]
        if not free:
            return None
        start = int.from_bytes(hashlib.sha256(owner.encode()).digest()[:4], "big") % len(free)
        for u in free[start:] + free[:start]:
            lease = self.claim(u, owner)
            if lease is not None:
                return lease
        return None

    def writer(
        self,
        lease: Lease,
        *,
        part_bytes: int = DEFAULT_PART_BYTES,
        head_weight: torch.Tensor | None = None,
    ) -> UnitWriter:
        return UnitWriter(self, lease, part_bytes=part_bytes, head_weight=head_weight)

    # --- reading ----------------------------------------------------------------------------
    def iter_units(self) -> Iterator[dict[str, Any]]:
        """The index of every committed unit, in plan order."""
        committed = self.committed()
        for u in self.plan.units:
            if u.name in committed:
                yield committed[u.name]

    def read_object(self, ref: Mapping[str, Any]) -> bytes:
        """A data object named by an index, checked against its size and sha256."""
        path = self.path(str(ref["path"]))
        data = objects.read_bytes(self.fs, path)
        if data is None:
            raise CorruptUnit(f"{path}: named by a committed index but missing")
        if len(data) != int(ref["size"]):
            raise CorruptUnit(f"{path}: {len(data)} bytes, its index says {ref['size']}")
        if hashlib.sha256(data).hexdigest() != ref["sha256"]:
            raise CorruptUnit(f"{path}: sha256 differs from its index")
        return data

    def read_unit(
        self, index: Mapping[str, Any], dequantize: bool = True
    ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """(sample id, tensors) of one committed unit, one data object in memory at a time.
        `dequantize`: fp8 states come back in the manifest's dtype (as `HiddenStore[id]`);
        False: as stored, with their `<state>_scale` rows (as `HiddenStore.raw`)."""

        read_dtype = torch_dtype(self.plan.manifest["dtype"])
        by_part: dict[int, list[tuple[str, int, int]]] = {}
        for sid, part, offset, length in index["samples"]:
            by_part.setdefault(int(part), []).append((str(sid), int(offset), int(length)))
        for number, ref in enumerate(index["objects"]):
            tensors = load(self.read_object(ref))
            for sid, offset, length in by_part.get(number, []):
                out = {k: v[offset : offset + length].clone() for k, v in tensors.items()}
                if dequantize:
                    for key in STATE_KEYS:
                        scale = out.pop(key + SCALE_SUFFIX, None)
                        if scale is not None:
                            out[key] = dequantize_rows(out[key], scale, read_dtype)
                yield sid, out
            del tensors

    def iter_samples(
        self, dequantize: bool = True
    ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """Every committed sample, unit by unit in plan order (what an export reads)."""
        for index in self.iter_units():
            yield from self.read_unit(index, dequantize)

    def orphans(self) -> list[str]:
        """Data objects of committed units that their index does not name (a killed or losing
        attempt's): safe to delete, no reader ever opens them."""
        committed = self.committed()
        named = {self.path(ref["path"]) for index in committed.values() for ref in index["objects"]}
        out = []
        for p in objects.listing(self.fs, self.path(DATA_DIR)):
            unit = self.relative(p).split("/")[1] if "/" in self.relative(p) else ""
            if unit in committed and p not in named:
                out.append(p)
        return out

    def status(self) -> dict[str, Any]:
        committed = self.committed()
        newest = self._lease_paths()
        now = time.time()
        held = [
            u.name
            for u in self.plan.units
            if u.name not in committed
            and u.name in newest
            and self.lease_expiry(newest[u.name][1]) > now
        ]
        return {
            "units": len(self.plan.units),
            "committed": len(committed),
            "held": len(held),
            "free": len(self.plan.units) - len(committed) - len(held),
            "samples": sum(len(i["samples"]) for i in committed.values()),
            "skipped": sum(len(i["issues"]) for i in committed.values()),
        }


# --- leases -----------------------------------------------------------------------------------
@dataclass
class Lease:
    """Generation `generation` of the claim on `unit`, held by `owner` until `expires`."""

    store: UnitStore
    unit: Unit
    generation: int
    owner: str
    expires: float
    lost: bool = False  # a later generation exists: another worker took the unit over
    released: bool = False
    # A heartbeat must not renew a lease that was just released (it would hold the unit).
    _guard: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def path(self) -> str:
        return self.store._lease_path(self.unit.name, self.generation)

    @property
    def attempt(self) -> str:
        """This claim's data prefix: unique per (generation, owner), so attempts never mix."""
        return f"g{self.generation:06d}-{self.owner}"

    def body(self) -> dict[str, Any]:
        return {
            "kind": "lease",
            "unit": self.unit.name,
            "generation": self.generation,
            "owner": self.owner,
            "expires": self.expires,
        }

    def superseded(self) -> bool:
        self.store.fs.invalidate_cache()
        newest, _ = self.store._unit_lease(self.unit.name)
        self.lost = self.lost or newest > self.generation
        return self.lost

    def renew(self) -> bool:
        """Push the expiry `lease_s` ahead; False when the unit was taken over (`lost`) or
        the lease released."""
        with self._guard:
            if self.released or self.superseded():
                return False
            self.expires = time.time() + self.store.lease_s
            objects.overwrite(self.store.fs, self.path, objects.encode_record(self.body()))
            return True

    def release(self) -> None:
        """End the claim now (after a commit, or when giving the unit up)."""
        with self._guard:
            if self.released or self.superseded():
                self.released = True
                return
            self.released = True
            self.expires = 0.0
            objects.overwrite(self.store.fs, self.path, objects.encode_record(self.body()))

    @contextlib.contextmanager
    def keepalive(self, every_s: float | None = None) -> Iterator[Lease]:
        """Renew in a background thread every `every_s` (default a quarter of the lease) while
        the block runs. A renewal that fails is logged and retried at the next beat."""
        interval = every_s if every_s is not None else self.store.lease_s / 4
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    if not self.renew():
                        if self.lost:
                            log.warning("unit %s: lease lost to a later claim", self.unit.name)
                        return
                except Exception as exc:  # noqa: BLE001 - a heartbeat must not kill the work
                    log.warning("unit %s: lease renewal failed: %s", self.unit.name, exc)

        thread = threading.Thread(target=beat, name=f"lease-{self.unit.name}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()


def run_units(
    store: UnitStore,
    owner: str,
    work: Callable[[UnitWriter], None],
    *,
    part_bytes: int = DEFAULT_PART_BYTES,
    max_units: int | None = None,
    wait_for_held: bool = False,
    poll_s: float = 10.0,
    head_weight: torch.Tensor | None = None,
) -> list[CommitResult]:
    """The loop every executor runs: claim a unit, fill it with `work`, commit it, until no
    unit is left to claim (or `max_units` are done). Workers need no coordinator: the plan,
    the leases and the indexes in the store are the whole schedule.

    `wait_for_held`: when only units held by other workers are left, poll every `poll_s`
    until they are committed, taking over any whose lease runs out (a dead worker's), so
    the run ends complete as long as one worker lives. `head_weight`: the LM head that an
    fp8 final state keeps the teacher of (`UnitWriter`)."""
    results: list[CommitResult] = []
    while max_units is None or len(results) < max_units:
        lease = store.claim_next(owner)
        if lease is None:
            if wait_for_held and len(store.committed()) < len(store.plan.units):
                time.sleep(poll_s)
                continue
            break
        with lease.keepalive():
            writer = store.writer(lease, part_bytes=part_bytes, head_weight=head_weight)
            try:
                work(writer)
            except BaseException:
                lease.release()  # the unit is free again now, not after lease_s
                raise
            results.append(writer.commit())
    return results
