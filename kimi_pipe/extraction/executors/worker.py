"""One unit worker: the loop every executor runs (docs/distributed.md).

A worker opens the engine (`extract.backend`), reads the records, makes sure the unit store
has its plan (the first worker writes it, the others check they were asked for the same
work), then claims, extracts and commits units through `store.units.run_units` until none
is left. Nothing here knows how many workers there are or who started them: a Ray actor,
a submitit job (a SLURM array task or `submitit.LocalExecutor`), or a plain process started
by hand all run `run_worker`. In a multi-node engine only the node of rank 0 is a worker;
the others run `serve_follower` (executors/nodes.py says which node a process is).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimi_pipe.errors import ConfigError
from kimi_pipe.extraction.capture import CaptureStats, IssueLog, TokenBudget, capture_into
from kimi_pipe.extraction.job import ExtractJob
from kimi_pipe.extraction.sglang.backend import serve_follower_node
from kimi_pipe.extraction.sharding import resolve_for_shard, teacher_head
from kimi_pipe.extraction.token_samples import (
    Backend,
    TokenSample,
    apply_max_len,
    load_backend,
    read_token_records,
)
from kimi_pipe.store import atomic, objects
from kimi_pipe.store.hidden_store import FP8, MANIFEST, make_manifest, state_dtypes
from kimi_pipe.store.teacher_rounding import DOC as ROUNDING_DOC
from kimi_pipe.store.units import (
    DEFAULT_LEASE_S,
    DEFAULT_PART_BYTES,
    CommitResult,
    UnitStore,
    UnitWriter,
    check_owner,
    default_owner,
    run_units,
)

log = logging.getLogger("kimi_pipe.extract")

SUMMARY_FILE = "extract_summary.json"


def executor_of(job: ExtractJob) -> str | None:
    """`extract.executor`: None (the work shards of extraction/sharding.py) or a name
    (checked when the job was built)."""
    return job.executor


def _positive(node: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    value = node.get(key, default)
    if value is None:
        return None
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"extract.units.{key} must be a number, not {value!r}") from None
    if number <= 0:
        raise ConfigError(f"extract.units.{key} must be > 0, got {value!r}")
    return number


@dataclass(frozen=True)
class UnitSettings:
    """`extract.units.*`: where the unit store is and how the work is cut."""

    url: str
    unit_samples: int = 256
    unit_tokens: int | None = None
    lease_s: float = DEFAULT_LEASE_S
    part_bytes: int = DEFAULT_PART_BYTES
    poll_s: float = 10.0
    workers: int = 1
    storage_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_job(cls, job: ExtractJob) -> UnitSettings:
        raw = job.get("units")
        node: dict[str, Any] = {}
        if raw is not None:
            if not isinstance(raw, Mapping):
                raise ConfigError("extract.units must be a mapping of settings")
            node = {str(k): v for k, v in raw.items()}
        url = node.get("url") or str(job.store_path())
        options = node.get("storage_options") or {}
        if not isinstance(options, dict):
            raise ConfigError("extract.units.storage_options must be a mapping (fsspec options)")
        return cls(
            url=str(url),
            unit_samples=_positive(node, "unit_samples", int, 256),
            unit_tokens=_positive(node, "unit_tokens", int, None),
            lease_s=_positive(node, "lease_s", float, DEFAULT_LEASE_S),
            part_bytes=_positive(node, "part_bytes", int, DEFAULT_PART_BYTES),
            poll_s=_positive(node, "poll_s", float, 10.0),
            workers=_positive(node, "workers", int, 1),
            storage_options=dict(options),
        )

    def open(self) -> UnitStore:
        fs, root = objects.open_fs(self.url, **self.storage_options)
        if objects.is_local(fs) and (Path(root) / MANIFEST).exists():
            raise ConfigError(
                f"{root} holds a store written by the work shards (manifest.json); the unit "
                "executors write another layout: set extract.output_dir or extract.units.url"
            )
        return UnitStore(fs, root, lease_s=self.lease_s)

    @property
    def local_root(self) -> Path | None:
        """The store's directory when it is on local disk (summaries go beside the units)."""
        fs, root = objects.open_fs(self.url, **self.storage_options)
        return Path(root) if objects.is_local(fs) else None


class UnitIssues(IssueLog):
    """The capture loop's issue log for one unit: a sample not stored is skipped in the
    unit's index (with its code), so the unit still commits and says why it lacks it."""

    def __init__(self, writer: UnitWriter) -> None:
        super().__init__(None)
        self.writer = writer

    def add(self, sample_id: str, code: str, detail: str = "") -> None:
        super().add(sample_id, code, detail)
        self.writer.skip(sample_id, code, detail)


def batch_budget(job: ExtractJob, backend: Any) -> TokenBudget:
    """`extract.batch_tokens` / `max_batch`, capped by the engine's own limits."""
    tokens = int(job.settings["batch_tokens"])
    engine_cap = getattr(backend, "max_batch_tokens", None)
    if engine_cap is not None and engine_cap < tokens:
        tokens = int(engine_cap)
    caps = [c for c in (job.get("max_batch"), getattr(backend, "max_batch_samples", None)) if c]
    return TokenBudget(tokens, max_samples=min(caps) if caps else None)


@dataclass
class Work:
    """What a worker holds after `prepare`: the store (planned) and the samples by id."""

    store: UnitStore
    samples: dict[str, TokenSample]
    counts: dict[str, int]
    manifest: dict[str, Any]
    head_weight: Any
    resolution: dict[str, Any]
    records: Path


def prepare(job: ExtractJob, backend: Backend, settings: UnitSettings) -> Work:
    """Read the records and write (or check) the store's plan. Every worker calls this."""
    records = job.records_path()
    # Target resolution rewrites the records before the ids are read; records scored before
    # are passed over, so a second worker only re-reads (docs/distributed.md, limits).
    resolution = resolve_for_shard(job, backend, records, 0, 1)
    samples, counts = read_token_records(records, only_ok=job.only_ok, accept=job.accept)
    samples, len_counts = apply_max_len(samples, job.max_len, job.over_max_len)
    counts.update(len_counts)
    manifest = make_manifest(
        **backend.store_fields,
        final_dtype=job.get("final_store_dtype"),
        loss_mask=job.loss_mask_convention(),
        source_runs=[str(records.parent.resolve())],
        backend=job.backend,
    )
    head = teacher_head(job, backend, manifest)
    if head is not None and state_dtypes(manifest)["hidden_state"] == FP8:
        manifest = {**manifest, "final_rounding": ROUNDING_DOC}
    store = settings.open()
    lengths = {s.id: len(s.input_ids) for s in samples} if settings.unit_tokens else None
    store.ensure_plan(
        [s.id for s in samples],
        unit_size=settings.unit_samples,
        manifest=manifest,
        lengths=lengths,
        unit_tokens=settings.unit_tokens,
    )
    return Work(
        store, {s.id: s for s in samples}, dict(counts), manifest, head, resolution, records
    )


def run_worker(
    job: ExtractJob,
    backend: Backend,
    *,
    owner: str | None = None,
    wait_for_held: bool = True,
    max_units: int | None = None,
    settings: UnitSettings | None = None,
) -> dict[str, Any]:
    """Claim, extract and commit units until none is left; return this worker's summary.

    `wait_for_held`: also wait for units other workers hold, taking over those whose lease
    runs out, so the run ends complete while one worker lives. `max_units`: stop after so
    many commits (a worker that leaves early; tests)."""
    settings = settings or UnitSettings.from_job(job)
    owner = check_owner(owner or default_owner())
    started = time.monotonic()
    cpu_started = time.process_time()  # CPU this process got: on a shared host, not the wall
    work = prepare(job, backend, settings)
    budget = batch_budget(job, backend)
    padded = not bool(getattr(backend, "packed", False))
    totals = CaptureStats()

    def extract_unit(writer: UnitWriter) -> None:
        # Longest first inside the unit: an out-of-memory shows on its first batch.
        todo = sorted(
            (work.samples[sid] for sid in writer.unit.ids), key=lambda s: (-len(s.input_ids), s.id)
        )
        issues = UnitIssues(writer)
        # TokenSample is frozen: read-only fields, which the Protocol cannot say.
        stats = capture_into(backend.forward, todo, writer, issues, budget, padded=padded)  # type: ignore[arg-type]
        totals.samples_in += stats.samples_in
        totals.written += stats.written
        totals.tokens_written += stats.tokens_written
        totals.batches += stats.batches
        totals.oom_retries += stats.oom_retries
        totals.seconds += stats.seconds
        for code, n in stats.issues.items():
            totals.issues[code] = totals.issues.get(code, 0) + n

    results: list[CommitResult] = run_units(
        work.store,
        owner,
        extract_unit,
        part_bytes=settings.part_bytes,
        max_units=max_units,
        wait_for_held=wait_for_held,
        poll_s=settings.poll_s,
        head_weight=work.head_weight,
    )
    return {
        "owner": owner,
        "store": settings.url,
        "records": str(work.records),
        "units_committed": [r.unit for r in results if r.ours],
        "units_lost": [r.unit for r in results if not r.ours],  # another commit stood first
        "samples": sum(r.samples for r in results if r.ours),
        "tokens": sum(r.tokens for r in results if r.ours),
        "capture": totals.as_dict(),
        "counts": work.counts,
        "resolve": work.resolution,
        "wall_s": round(time.monotonic() - started, 3),
        "cpu_s": round(time.process_time() - cpu_started, 3),
    }


def serve_follower(job: ExtractJob) -> dict[str, Any]:
    """A node of a multi-node engine other than rank 0's: it serves its tensor-parallel ranks
    until rank 0's node closes the engine, claims no unit and writes nothing. Its summary
    says so, with the store's status as it found it at the end."""
    node = serve_follower_node(job)
    settings = UnitSettings.from_job(job)
    return {
        "store": settings.url,
        "status": settings.open().status(),
        "follower_node": node,
    }


def open_worker_backend(job: ExtractJob) -> Backend:
    """The engine of one worker (`extract.backend`), as the work-shard path opens it."""
    return load_backend(job)


def run_summary(job: ExtractJob, workers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The run's summary once the executor's workers are done: the store's status and each
    worker's part; written beside the units when the store is on local disk."""
    settings = UnitSettings.from_job(job)
    store = settings.open()
    status = store.status()
    summary: dict[str, Any] = {
        "store": settings.url,
        "records": str(job.records_path()),
        "backend": job.backend,
        "executor": job.executor,
        "status": status,
        "complete": status["committed"] == status["units"],
        "workers": workers,
        **extra,
    }
    root = settings.local_root
    if root is not None:
        atomic.write_json(root / SUMMARY_FILE, summary, indent=2, sort_keys=True)
    return summary
