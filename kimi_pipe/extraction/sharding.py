"""Engine-agnostic scale-out logic of the extract stage.

* Deterministic split of sample ids into ``num_shards`` work shards (stable hash of the id, so
  a shard's work does not change when records are reordered or other shards fail).
* Each work shard writes its own store part (``STORE/parts/shard-00003-of-00008``); when the
  last part finishes, the parts are merged into ONE store at ``STORE`` (hard links, no copy).
* The capture loop: batches under a token budget, halves the budget and retries on GPU
  out-of-memory, marks samples whose states contain NaN/inf (issue ``nonfinite_hidden_state``)
  instead of writing them, and logs progress. It talks to any engine through one callable,
  ``capture(batch_input_ids) -> [(aux [L, k*H], final [L, H]), ...]``.

How the stage uses it (any backend)::

    samples = select_shard(samples, shard, num_shards)
    part = part_dir(store, shard, num_shards)
    with StoreWriter(part, manifest) as writer:
        issues = IssueLog(part)
        stats = capture_into(engine.capture, samples, writer, issues, TokenBudget(batch_tokens))
    mark_part_done(part, stats)
    maybe_merge(store, num_shards)     # the last part to finish builds the one index

(`run_sharded` calls `mark_part_started(part)` first: a part that runs again is not done.)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open

from kimi_pipe.core.models import load_model
from kimi_pipe.errors import EXIT_FAILED, EXIT_USER_ERROR, ConfigError
from kimi_pipe.extraction.capture import (  # noqa: F401  (re-exported: the loop's names)
    CAPTURE_OOM,
    ISSUES,
    NONFINITE,
    PERMANENT,
    CaptureStats,
    IssueLog,
    Sample,
    SampleLike,
    Sink,
    TokenBudget,
    capture_into,
    is_oom,
    next_batch,
    nonfinite,
)
from kimi_pipe.extraction.job import ExtractJob
from kimi_pipe.extraction.records_pass import resolve_records
from kimi_pipe.extraction.split_check import LazyVocabulary
from kimi_pipe.extraction.token_samples import apply_max_len, read_token_records
from kimi_pipe.store import atomic
from kimi_pipe.store.hidden_store import (
    FP8,
    IDENTITY_KEYS,
    INDEX,
    MANIFEST,
    SHARDS,
    StoreWriter,
    make_manifest,
    state_dtypes,
    write_tokens_dataset,
)

log = logging.getLogger(__name__)


PARTS = "parts"
PART_DONE = "part_done.json"
MERGE_DONE = "merge_done.json"
MERGE_LOCK = ".merge.lock"
MERGED_STORE = ".merged_from_parts"  # set before a merge first touches the store


T = TypeVar("T")


# --- deterministic sharding ------------------------------------------------------------------
def shard_of(sample_id: str, num_shards: int) -> int:
    """Stable shard of an id (sha256, not Python's salted hash): same on every node and run."""
    digest = hashlib.sha256(str(sample_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % num_shards


def check_shard(shard: int, num_shards: int) -> None:
    if num_shards < 1:
        raise ConfigError(f"extract.num_shards must be >= 1, got {num_shards}")
    if not 0 <= shard < num_shards:
        raise ConfigError(f"extract.shard must be in 0..{num_shards - 1}, got {shard}")


def select_shard(
    items: Iterable[T], shard: int, num_shards: int, key: Callable[[T], str] | None = None
) -> list[T]:
    """The items of work shard `shard` (all of them when num_shards == 1), order kept."""
    check_shard(shard, num_shards)
    get = key or (lambda item: item.id)  # type: ignore[attr-defined]
    return [it for it in items if num_shards == 1 or shard_of(get(it), num_shards) == shard]


def part_dir(store: str | os.PathLike[str], shard: int, num_shards: int) -> Path:
    """Where work shard `shard` writes: the store itself when there is a single shard."""
    check_shard(shard, num_shards)
    if num_shards == 1:
        return Path(store)
    return Path(store) / PARTS / f"shard-{shard:05d}-of-{num_shards:05d}"


# --- finishing shards into one store --------------------------------------------------------
def _write_json_atomic(path: Path, obj: Any) -> None:
    atomic.write_json(path, obj, indent=2, sort_keys=True)


def mark_part_started(part: str | os.PathLike[str]) -> None:
    """A work shard (re)starts: drop its `part_done.json` from an earlier run, so no other
    shard merges the store while this one is still extracting."""
    (Path(part) / PART_DONE).unlink(missing_ok=True)


def mark_part_done(part: str | os.PathLike[str], info: dict[str, Any]) -> None:
    """Record that a work shard has no work left (written last, atomically). A fresh
    `done_id` per call lets a merge tell whether a part finished again since it began."""
    _write_json_atomic(Path(part) / PART_DONE, {**info, "done_id": uuid.uuid4().hex})


def parts_status(store: str | os.PathLike[str], num_shards: int) -> tuple[list[Path], list[int]]:
    """All part directories of a store, and the shards that have not finished yet."""
    parts = [part_dir(store, i, num_shards) for i in range(num_shards)]
    missing = [i for i, p in enumerate(parts) if not (p / PART_DONE).exists()]
    return parts, missing


def _done_ids(parts: Sequence[Path]) -> list[str | None]:
    """Which finish of each part a merge sees (None: not finished / unreadable)."""
    out: list[str | None] = []
    for p in parts:
        try:
            text = (p / PART_DONE).read_text()
        except FileNotFoundError:
            out.append(None)
            continue
        try:
            done_id = json.loads(text).get("done_id")
        except (json.JSONDecodeError, AttributeError):
            done_id = None
        out.append(str(done_id) if done_id else hashlib.sha256(text.encode()).hexdigest())
    return out


def _shard_samples(shard: Path) -> list[tuple[str, int, int]]:
    with safe_open(str(shard), framework="pt") as f:
        meta = f.metadata() or {}
    return [(str(s[0]), int(s[1]), int(s[2])) for s in json.loads(meta.get("samples", "[]"))]


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # same filesystem: no extra disk, no copy time
    except OSError:
        shutil.copy2(src, dst)


def merge_parts(store: str | os.PathLike[str], num_shards: int) -> dict[str, Any]:
    """Build ONE store (manifest, shards/, index.jsonl, tokens/, issues.jsonl) at `store` from
    its finished parts. Idempotent: rerunning rebuilds it from the parts."""
    root = Path(store)
    parts, missing = parts_status(root, num_shards)
    if missing:
        raise RuntimeError(f"cannot merge {root}: shards {missing} of {num_shards} not finished")
    done_ids = _done_ids(parts)  # read before the parts: a later finish shows as a change
    manifests = [json.loads((p / MANIFEST).read_text()) for p in parts if (p / MANIFEST).exists()]
    if not manifests:
        raise RuntimeError(f"cannot merge {root}: no part has a manifest")
    first = manifests[0]
    for m in manifests[1:]:
        diff = [k for k in IDENTITY_KEYS if m.get(k) != first.get(k)]
        if diff:
            raise ValueError(f"parts of {root} disagree on {diff}; they cannot share one index")

    if (root / SHARDS).exists() and not (root / MERGED_STORE).exists():
        raise RuntimeError(
            f"{root} already holds a store written without work shards; merging parts into it "
            "would replace it. Use another extract.output_dir for a sharded run."
        )
    (root / MERGED_STORE).touch()
    staging = root / (SHARDS + ".merging")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    index_lines: list[str] = []
    seen: set[str] = set()
    number = 0
    for part in parts:
        for shard in sorted((part / SHARDS).glob("shard_*.safetensors")):
            name = f"shard_{number:05d}.safetensors"
            for sid, offset, length in _shard_samples(shard):
                if sid in seen:
                    raise ValueError(f"sample {sid!r} is in two parts of {root}")
                seen.add(sid)
                row = {"id": sid, "shard": name, "offset": offset, "length": length}
                index_lines.append(json.dumps(row) + "\n")
            _link_or_copy(shard, staging / name)
            number += 1

    # Swap in the new shards; a crash here is repaired by running the merge again.
    target = root / SHARDS
    if target.exists():
        shutil.rmtree(target)
    atomic.replace(staging, target)
    atomic.write_text(root / INDEX, "".join(index_lines))
    runs = list(dict.fromkeys(r for m in manifests for r in m.get("source_runs", [])))
    merged = {**first, "source_runs": runs, "merged_from_parts": num_shards}
    _write_json_atomic(root / MANIFEST, merged)
    issue_lines = [
        line + "\n"
        for p in parts
        if (p / ISSUES).exists()
        for line in (p / ISSUES).read_text().splitlines()
        if line.strip()
    ]
    atomic.write_text(root / ISSUES, "".join(issue_lines))
    write_tokens_dataset(root)
    info = {
        "num_shards": num_shards,
        "samples": len(seen),
        "shard_files": number,
        "parts_done": done_ids,
    }
    _write_json_atomic(root / MERGE_DONE, info)
    return info


@contextlib.contextmanager
def merge_lock(store: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the store's merge lock, waiting for another merger. An OS lock (flock): a killed
    merge releases it, and a lock file left behind blocks nothing."""
    root = Path(store)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / MERGE_LOCK, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("store %s: another process is merging; waiting for it", root)
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _merged_done_ids(root: Path) -> list[str | None] | None:
    try:
        info = json.loads((root / MERGE_DONE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    ids = info.get("parts_done") if isinstance(info, dict) else None
    return list(ids) if isinstance(ids, list) else None


def maybe_merge(store: str | os.PathLike[str], num_shards: int) -> dict[str, Any] | None:
    """Merge when every part is done. Finishers take turns on the merge lock; a merge that a
    part finished during is redone, and one that already covers every finished part is kept.

    Returns the merge info, or None when parts are missing (the last of them merges).
    """
    if num_shards == 1:
        return None  # a single shard writes the store directly
    root = Path(store)
    _, missing = parts_status(root, num_shards)
    if missing:
        log.info("store %s: waiting for shards %s before merging", root, missing)
        return None
    with merge_lock(root):
        while True:
            parts, missing = parts_status(root, num_shards)
            if missing:
                log.warning(
                    "store %s: shards %s started again; they merge when they finish", root, missing
                )
                return None
            before = _done_ids(parts)
            if _merged_done_ids(root) == before:
                log.info("store %s: already merged from these parts", root)
                return dict(json.loads((root / MERGE_DONE).read_text()))
            try:
                info = merge_parts(root, num_shards)
            except RuntimeError:
                if parts_status(root, num_shards)[1]:
                    continue  # a part restarted mid-merge: the check above reports it
                raise
            if _done_ids(parts) == info["parts_done"]:
                return info
            log.warning("store %s: a shard finished during the merge; merging again", root)


# --- the sharded stage run (any backend) ------------------------------------------------------
def resolve_for_shard(
    job: ExtractJob, backend: Any, records: Path, shard: int, num_shards: int
) -> dict[str, Any]:
    """Target resolution (`extraction.resolve`) of this work shard's records, when the job
    enables it and the backend can score (`backend.suffix_scorer()`)."""

    settings = job.resolve
    if not settings.enabled:
        return {"enabled": False}
    make_scorer = getattr(backend, "suffix_scorer", None)
    summary = resolve_records(
        records,
        make_scorer() if make_scorer is not None else None,
        settings,
        mine=lambda sid: num_shards == 1 or shard_of(sid, num_shards) == shard,
        # The split check and a bounded set's gaps (extraction/gap_bounds.py) read it.
        vocab=_split_vocabulary(job),
    )
    if summary.get("counts"):
        counted = ", ".join(f"{name} {n}" for name, n in summary["counts"].items())
        print(f"[extract] target resolution: {counted}", file=sys.stderr, flush=True)
    return summary


def _split_vocabulary(job: ExtractJob) -> Any:
    """The records' tokenizer as the split check and the gaps' classes see it (None: no model
    config here), loaded only when a record needs it (benchmarks/bench_extract.py: seconds per
    stage run)."""

    node = job.model
    if node is None:
        return None
    return LazyVocabulary(lambda: load_model(node).tokenizer)


def run_sharded(job: ExtractJob, backend: Any) -> dict[str, Any]:
    """Extract work shard `extract.shard` of `extract.num_shards` with `backend` into its part
    of the store, with OOM halving and NaN/inf marking; merge when the last part finishes.

    `backend` follows `token_samples.Backend` (store_fields, forward, close). Optional
    attributes: `packed` (True: a batch costs the sum of its lengths, no padding),
    `max_batch_tokens` / `max_batch_samples` (engine limits that cap the budget).
    """

    shard, num_shards = job.shard, job.num_shards
    check_shard(shard, num_shards)
    records = job.records_path()
    # Closed candidate sets are decided by the target first, so that the states below are
    # captured on the chosen ids only (the records file is rewritten atomically).
    resolution = resolve_for_shard(job, backend, records, shard, num_shards)
    samples, counts = read_token_records(records, only_ok=job.only_ok, accept=job.accept)
    samples, len_counts = apply_max_len(samples, job.max_len, job.over_max_len)
    counts.update(len_counts)
    mine = select_shard(samples, shard, num_shards)
    # Longest first: an out-of-memory shows on the first batch, not after hours.
    mine.sort(key=lambda s: (-len(s.input_ids), s.id))
    store = job.store_path()
    part = part_dir(store, shard, num_shards)
    manifest = make_manifest(
        **backend.store_fields,
        final_dtype=job.get("final_store_dtype"),
        loss_mask=job.loss_mask_convention(),
        source_runs=[str(records.parent.resolve())],
        backend=job.backend,
    )
    tokens = int(job.settings["batch_tokens"])
    engine_cap = getattr(backend, "max_batch_tokens", None)
    if engine_cap is not None and engine_cap < tokens:
        log.warning(
            "extract.batch_tokens %d > engine capacity %d; using %d", tokens, engine_cap, engine_cap
        )
        tokens = int(engine_cap)
    caps = [c for c in (job.get("max_batch"), getattr(backend, "max_batch_samples", None)) if c]
    max_samples = min(caps) if caps else None
    budget = TokenBudget(tokens, max_samples=max_samples)
    packed = bool(getattr(backend, "packed", False))
    print(
        f"[extract] shard {shard}/{num_shards}: {len(mine)} of {len(samples)} samples -> {part}",
        file=sys.stderr,
        flush=True,
    )
    if num_shards > 1:
        mark_part_started(part)
    writer = StoreWriter(
        part,
        manifest,
        shard_samples=int(job.settings["shard_samples"]),
        shard_tokens=job.get("shard_tokens"),
        head_weight=teacher_head(job, backend, manifest),
    )
    issues = IssueLog(part)
    stats = capture_into(backend.forward, mine, writer, issues, budget, padded=not packed)  # type: ignore[arg-type]
    writer.close()
    summary: dict[str, Any] = {
        "records": str(records),
        "store": str(store),
        "part": str(part),
        "shard": shard,
        "num_shards": num_shards,
        "backend": job.backend,
        "max_len": job.get("max_len"),
        "over_max_len": job.over_max_len,
        "counts": dict(sorted(counts.items())),
        "capture": stats.as_dict(),
        "final_fp8_rounding": writer.rounding.as_dict() if writer.teacher is not None else None,
        "final_batch_tokens": budget.tokens,
        "samples_in_part": len(writer.done_ids),
        "resolve": resolution,
    }
    _write_json_atomic(part / "extract_summary.json", summary)
    if num_shards > 1:
        mark_part_done(part, summary)
        merged = maybe_merge(store, num_shards)
        summary["merged"] = merged
    return summary


ROUNDINGS = ("keep_teacher", "nearest")


def teacher_head(job: ExtractJob, backend: object, manifest: dict[str, Any]) -> torch.Tensor | None:
    """The LM head when an fp8 final state is to keep the teacher (extract.final_fp8_rounding)."""
    how = str(job.get("final_fp8_rounding") or "keep_teacher")
    if how not in ROUNDINGS:
        raise ConfigError(f"extract.final_fp8_rounding must be one of {ROUNDINGS}, not {how!r}")
    if how == "nearest" or state_dtypes(manifest)["hidden_state"] != FP8:
        return None
    head = getattr(backend, "output_head", None)
    if head is None:
        raise ConfigError(
            f"extract.backend={job.backend} cannot give the LM head that keeps the teacher of "
            "an fp8 final state; set extract.final_fp8_rounding=nearest or "
            "extract.final_store_dtype=bfloat16"
        )
    return head()  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    """`python -m kimi_pipe.extraction.sharding STORE NUM_SHARDS`: merge finished parts by hand."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kimi_pipe.extraction.sharding STORE NUM_SHARDS", file=sys.stderr)
        return EXIT_USER_ERROR
    store, n = args[0], int(args[1])
    _, missing = parts_status(store, n)
    if missing:
        print(f"shards {missing} of {n} have not finished; rerun them first", file=sys.stderr)
        return EXIT_FAILED
    with merge_lock(store):
        print(json.dumps(merge_parts(store, n)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
