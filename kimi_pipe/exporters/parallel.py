"""Export over units in several processes, rows streamed: memory follows a unit, not the run.

The engine (`kimi_pipe.exporters.export`) plans and shuffles the samples once; this module
cuts the plan into **tasks**, one per stored data object (a unit store's part object, a
hidden store's shard), each task's samples in file order. A task reads its object's samples
(one object fetch on an object store), writes their per-sample files (names depend on the
shuffled index only) and a **fragment**: its rows as JSON lines in index order. The parent
merges the fragments by index (`heapq.merge`, a bounded number open at once) and streams the
rows to the exporter and to export_index.jsonl. So the files, the rows and the index are the
same whatever the number of workers, and no process holds more than one task's plan, one
sample and one row per open fragment (tests/test_export_parallel.py).

`workers=1` runs the tasks in this process; `workers=N` in a `ProcessPoolExecutor` of N
spawned processes (no inherited threads or locks: s3fs's loop, a test's S3 server), each
opening the stores and the exporter once.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Protocol

import torch

from kimi_pipe.config import whole_number
from kimi_pipe.errors import ConfigError
from kimi_pipe.exporters.base import Exporter, load_exporter
from kimi_pipe.exporters.stores import open_stores
from kimi_pipe.store.conventions import final_state_as
from kimi_pipe.store.hidden_store import HiddenStore

PARTS_DIR = ".export_parts"  # fragments, removed once merged
MAX_OPEN_FRAGMENTS = 128  # merged in rounds above this (open files, one row buffered each)


class Planned(Protocol):
    """One planned sample (the engine's `PlannedSample`)."""

    @property
    def index(self) -> int: ...
    @property
    def store(self) -> int: ...
    @property
    def id(self) -> str: ...


@dataclass
class Job:
    """What a worker process needs to redo the parent's setup: picklable, no tensors."""

    stores: list[str]  # the sorted store references the plan's positions point into
    storage_options: dict[str, Any]
    fmt: str
    settings: dict[str, Any]
    output: str
    want: str | None
    rows: bool  # whether fragments carry input_ids / loss_mask (row formats)
    # The store's aux states the files take (their positions, in the files' order); None: all.
    aux_columns: list[int] | None = None
    hidden_size: int = 0
    threads: int = 0  # torch threads a worker process uses (0: torch's default)


@dataclass
class TaskResult:
    counts: dict[str, int] = field(
        default_factory=lambda: {"written": 0, "already_written": 0, "skipped_non_finite": 0}
    )
    fragment: str = ""


def check_workers(value: Any) -> int:
    """`export.workers`: a whole number >= 1."""
    n = whole_number(value, "export.workers")
    if n is None:
        return 1
    if n < 1:
        raise ConfigError(f"export.workers={n}: must be >= 1 (1 = this process)")
    return n


def tasks_of(stores: Sequence[HiddenStore], planned: Sequence[Planned]) -> list[list[Planned]]:
    """The plan cut by data object: one task per (store, object), its samples in file order,
    tasks in (store, object) order. Independent of the number of workers."""
    groups: dict[tuple[int, str], list[Planned]] = {}
    for p in planned:
        groups.setdefault((p.store, stores[p.store].entry(p.id).shard), []).append(p)
    out = []
    for key in sorted(groups):
        entry = stores[key[0]].entry
        out.append(sorted(groups[key], key=lambda p: entry(p.id).offset))  # noqa: B023
    return out


# --------------------------------------------------------------------------- one task

_WORKER: dict[str, Any] = {}  # per process: the job, its stores and exporter


def _setup(job: Job) -> None:
    if job.threads:
        # N workers each with torch's default (one thread a core) oversubscribe the cores,
        # and OpenMP's spinning threads then cost more than the work (measured: 5x slower).
        torch.set_num_threads(job.threads)
    _WORKER["job"] = job
    _WORKER["stores"] = open_stores(job.stores, storage_options=job.storage_options)
    _WORKER["exporter"] = load_exporter(job.fmt, job.settings)


def _run_in_worker(number: int, task: list[tuple[int, int, str]]) -> TaskResult:
    job: Job = _WORKER["job"]
    return run_task(job, _WORKER["stores"], _WORKER["exporter"], number, task)


def run_task(
    job: Job,
    stores: Sequence[HiddenStore],
    exporter: Exporter,
    number: int,
    task: Sequence[tuple[int, int, str]],
) -> TaskResult:
    """Write the per-sample files of one task ((index, store, id) in file order) and its
    fragment (rows in index order)."""
    out = Path(job.output)
    manifest = stores[0].manifest
    result = TaskResult()
    counts = result.counts
    rows: list[tuple[int, str]] = []
    for index, si, sid in task:
        store = stores[si]
        path = exporter.sample_path(out, index)
        if path is not None and not path.exists():
            sample = store[sid]
            if not (
                torch.isfinite(sample["aux_hidden_state"]).all()
                and torch.isfinite(sample["hidden_state"]).all()
            ):
                counts["skipped_non_finite"] += 1
                print(f"export: {store.path} {sid}: NaN/inf state, skipped", file=sys.stderr)
                continue
            refused = exporter.refuse_sample(sample)
            if refused is not None:
                key = f"skipped_{refused}"
                counts[key] = counts.get(key, 0) + 1
                continue
            if job.aux_columns is not None:
                sample["aux_hidden_state"] = select_aux(
                    sample["aux_hidden_state"], job.aux_columns, job.hidden_size
                )
            if job.want is not None:
                sample["hidden_state"] = final_state_as(manifest, sample["hidden_state"], job.want)
            exporter.write_sample(out, index, sample)
            counts["written"] += 1
            t = {"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"]}
            del sample
        else:
            counts["already_written" if path is not None else "written"] += 1
            t = store.tokens(sid)
        ids = t["input_ids"].tolist()
        mask = t["loss_mask"].tolist()
        row: dict[str, Any] = {"i": index, "s": si, "id": sid, "n": len(ids), "loss": sum(mask)}
        if path is not None:
            row["file"] = str(path.relative_to(out))
        if job.rows:
            row["ids"] = ids
            row["mask"] = mask
        rows.append((index, json.dumps(row)))
    rows.sort()  # one task's rows (its object's samples), in index order
    fragment = out / PARTS_DIR / f"{number:08d}.jsonl"
    fragment.parent.mkdir(parents=True, exist_ok=True)
    with open(fragment, "w") as f:
        for _, line in rows:
            f.write(line + "\n")
    result.fragment = str(fragment)
    return result


def select_aux(aux: torch.Tensor, columns: Sequence[int], hidden_size: int) -> torch.Tensor:
    """The aux states [L, n*H] of the layers at `columns` (store order), concatenated in that
    order: [L, len(columns)*H]. Values are copied, never recomputed."""
    length = aux.shape[0]
    per_layer = aux.reshape(length, -1, hidden_size)
    return per_layer[:, list(columns), :].reshape(length, len(columns) * hidden_size).clone()


# --------------------------------------------------------------------------- all tasks


def run_tasks(
    job: Job,
    stores: Sequence[HiddenStore],
    exporter: Exporter,
    tasks: Sequence[Sequence[Planned]],
    workers: int,
) -> tuple[dict[str, int], list[str]]:
    """Run every task (here, or in `workers` processes); (counts, fragments in task order)."""
    parts = Path(job.output) / PARTS_DIR
    if parts.exists():
        shutil.rmtree(parts)  # a killed export's fragments: its tasks run again
    counts = {"written": 0, "already_written": 0, "skipped_non_finite": 0}
    fragments: list[str] = [""] * len(tasks)
    total = sum(len(t) for t in tasks)
    done = 0
    last = time.monotonic()

    def took(number: int, size: int, result: TaskResult) -> None:
        nonlocal done, last
        fragments[number] = result.fragment
        for k, v in result.counts.items():
            counts[k] = counts.get(k, 0) + v
        done += size
        now = time.monotonic()
        if now - last >= 30 or done == total:
            print(f"export: {done}/{total} samples -> {job.output}", file=sys.stderr, flush=True)
            last = now

    def plain(task: Sequence[Planned]) -> list[tuple[int, int, str]]:
        return [(p.index, p.store, p.id) for p in task]

    if workers == 1 or len(tasks) <= 1:
        for number, task in enumerate(tasks):
            took(number, len(task), run_task(job, stores, exporter, number, plain(task)))
    else:
        context = get_context("spawn")
        procs = min(workers, len(tasks))
        threads = job.threads or max(1, (os.cpu_count() or 1) // procs)
        with ProcessPoolExecutor(
            max_workers=procs,
            mp_context=context,
            initializer=_setup,
            initargs=(dataclasses.replace(job, threads=threads),),
        ) as pool:
            futures = {
                pool.submit(_run_in_worker, number, plain(task)): (number, len(task))
                for number, task in enumerate(tasks)
            }
            for future, (number, size) in futures.items():
                took(number, size, future.result())
    return counts, fragments


def _read_fragment(path: str) -> Iterator[tuple[int, str]]:
    with open(path) as f:
        for line in f:
            yield int(line[line.index(":") + 1 : line.index(",")]), line


def merged_rows(fragments: Sequence[str]) -> Iterator[dict[str, Any]]:
    """Every fragment's rows in index order, at most MAX_OPEN_FRAGMENTS files open at once
    (more are merged in rounds into larger fragments first)."""
    paths = [f for f in fragments if f]
    round_no = 0
    while len(paths) > MAX_OPEN_FRAGMENTS:
        merged = []
        for start in range(0, len(paths), MAX_OPEN_FRAGMENTS):
            group = paths[start : start + MAX_OPEN_FRAGMENTS]
            target = f"{group[0]}.r{round_no}"
            with open(target, "w") as out:
                for _, line in heapq.merge(*(_read_fragment(p) for p in group)):
                    out.write(line)
            for p in group:
                os.unlink(p)
            merged.append(target)
        paths = merged
        round_no += 1
    for _, line in heapq.merge(*(_read_fragment(p) for p in paths)):
        yield json.loads(line)


def row_summary(row: Mapping[str, Any]) -> tuple[int, int]:
    return int(row["n"]), int(row["loss"])
