"""The capture loop every extraction path shares (work shards, unit workers, any backend):
batches under a token budget, out-of-memory halving and retry, NaN/inf marking, and the
per-sample issue log. The work shards and their merge are extraction/sharding.py; the unit
workers are extraction/executors/."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from kimi_pipe.core.issue_codes import BAD_CAPTURE, CAPTURE_OOM, NONFINITE_HIDDEN_STATE

log = logging.getLogger(__name__)

NONFINITE = NONFINITE_HIDDEN_STATE  # skip reasons: core/issue_codes.py says what each means
ISSUES = "issues.jsonl"

T = TypeVar("T")
CaptureFn = Callable[[list[list[int]]], list[tuple[torch.Tensor, torch.Tensor]]]


class SampleLike(Protocol):
    id: str
    input_ids: Sequence[int]
    loss_mask: Sequence[int]


class Sink(Protocol):
    """What the capture loop writes to: `hidden_store.StoreWriter` or a stand-in.

    A sink with a `dtype` attribute (StoreWriter) gets the states cast to it before the
    NaN/inf check, so a value that overflows the storage dtype (> 65504 in float16) is caught.
    """

    done_ids: set[str]

    def add(
        self,
        sample_id: str,
        input_ids: Sequence[int],
        loss_mask: Sequence[int],
        aux: torch.Tensor,
        final: torch.Tensor,
    ) -> None: ...


@dataclass(frozen=True)
class Sample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]


# --- issues -----------------------------------------------------------------------------------
# Issues a rerun would only repeat (the capture is deterministic): resume skips these ids.
# capture_oom is retried: a rerun with more memory or a lower max_len may fit the sample.
PERMANENT = frozenset({NONFINITE, BAD_CAPTURE})


class IssueLog:
    """Append-only JSONL of samples not written (NaN/inf, OOM, bad shape), flushed per line.

    `ids` holds the samples with a permanent issue: a resumed run skips them.
    """

    def __init__(self, directory: str | os.PathLike[str] | None) -> None:
        # None: keep the issues in memory only (nothing written).
        self.path = Path(directory) / ISSUES if directory is not None else None
        self.ids: set[str] = set()
        self.counts: dict[str, int] = {}
        if self.path is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # torn last line of a killed run
                codes = row.get("issues", [])
                if PERMANENT.intersection(codes):
                    self.ids.add(str(row["id"]))
                for code in codes:
                    self.counts[code] = self.counts.get(code, 0) + 1

    def add(self, sample_id: str, code: str, detail: str = "") -> None:
        log.warning("sample %s not written: %s %s", sample_id, code, detail)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps({"id": sample_id, "issues": [code], "detail": detail}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        if code in PERMANENT:
            self.ids.add(sample_id)
        self.counts[code] = self.counts.get(code, 0) + 1


def nonfinite(*tensors: torch.Tensor) -> bool:
    """True when any tensor holds NaN or inf."""
    return any(not bool(torch.isfinite(t).all()) for t in tensors)


# --- out-of-memory handling ------------------------------------------------------------------
def is_oom(exc: BaseException) -> bool:
    """GPU out-of-memory, whatever the engine wrapped it in."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


@dataclass
class TokenBudget:
    """Tokens per batch; halved on every OOM (down to one sample per batch) for the rest of
    the run, so a too-large budget costs one failed forward, not one per batch."""

    tokens: int
    max_samples: int | None = None
    halvings: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"batch token budget must be >= 1, got {self.tokens}")

    def halve(self) -> None:
        self.tokens = max(1, self.tokens // 2)
        self.halvings += 1


def next_batch(
    pending: deque[T], budget: TokenBudget, length: Callable[[T], int], padded: bool = False
) -> list[T]:
    """Pop the next batch: as many samples as fit in the budget (a longer one goes alone).

    Cost of a batch: the sum of its lengths (packed engines such as SGLang), or rows x the
    longest row when `padded` (engines that pad every row, such as transformers).
    """
    batch: list[T] = []
    total = longest = 0
    while pending:
        n = length(pending[0])
        full = budget.max_samples is not None and len(batch) >= budget.max_samples
        cost = (len(batch) + 1) * max(longest, n) if padded else total + n
        if batch and (cost > budget.tokens or full):
            break
        batch.append(pending.popleft())
        total += n
        longest = max(longest, n)
    return batch


@dataclass
class CaptureStats:
    samples_in: int = 0
    skipped_done: int = 0
    written: int = 0
    tokens_written: int = 0
    batches: int = 0
    oom_retries: int = 0
    issues: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_written / self.seconds if self.seconds > 0 else None
        return d


def _capture_halving(
    capture: CaptureFn,
    batch: list[SampleLike],
    budget: TokenBudget,
    issues: IssueLog,
    stats: CaptureStats,
) -> list[tuple[SampleLike, torch.Tensor, torch.Tensor]]:
    """Capture a batch; on OOM halve the budget and retry each half (a lone sample that still
    does not fit is reported as `capture_oom` and the run goes on)."""
    try:
        outs = capture([list(s.input_ids) for s in batch])
    except Exception as exc:  # noqa: BLE001 - only OOM is handled, the rest re-raised
        if not is_oom(exc):
            raise
        stats.oom_retries += 1
        budget.halve()
        if len(batch) == 1:
            issues.add(batch[0].id, CAPTURE_OOM, f"{len(batch[0].input_ids)} tokens")
            return []
        log.warning(
            "out of memory on %d samples; batch budget now %d tokens", len(batch), budget.tokens
        )
        mid = len(batch) // 2
        return [
            *_capture_halving(capture, batch[:mid], budget, issues, stats),
            *_capture_halving(capture, batch[mid:], budget, issues, stats),
        ]
    if len(outs) != len(batch):
        raise RuntimeError(f"engine returned {len(outs)} results for {len(batch)} samples")
    return [(s, aux, final) for s, (aux, final) in zip(batch, outs, strict=True)]


def capture_into(
    capture: CaptureFn,
    samples: Iterable[SampleLike],
    sink: Sink,
    issues: IssueLog,
    budget: TokenBudget,
    *,
    progress_every_s: float = 30.0,
    padded: bool = False,
) -> CaptureStats:
    """Run every sample not yet in `sink` (or in `issues`) through `capture` into `sink`.

    `padded`: the engine pads each row to the longest (batch cost = rows x longest).
    """
    stats = CaptureStats()
    todo: list[SampleLike] = []
    for s in samples:
        stats.samples_in += 1
        if s.id in sink.done_ids or s.id in issues.ids:
            stats.skipped_done += 1
        else:
            todo.append(s)
    pending = deque(todo)
    total = len(todo)
    store_dtype: torch.dtype | None = getattr(sink, "dtype", None)
    start = last_report = time.monotonic()
    done = 0
    while pending:
        batch = next_batch(pending, budget, lambda s: len(s.input_ids), padded)
        stats.batches += 1
        for sample, aux, final in _capture_halving(capture, batch, budget, issues, stats):
            done += 1
            if store_dtype is not None:
                # Check what will be stored: a finite float32 can overflow to inf in float16.
                aux, final = aux.to(store_dtype), final.to(store_dtype)
            if nonfinite(aux, final):
                issues.add(sample.id, NONFINITE)
                continue
            try:
                sink.add(sample.id, sample.input_ids, sample.loss_mask, aux, final)
            except ValueError as exc:  # a bad record is reported, the batch goes on
                issues.add(sample.id, BAD_CAPTURE, str(exc))
                continue
            stats.written += 1
            stats.tokens_written += len(sample.input_ids)
        now = time.monotonic()
        if now - last_report >= progress_every_s or not pending:
            rate = stats.tokens_written / max(now - start, 1e-9)
            print(
                f"[extract] {done}/{total} samples, {stats.tokens_written} tokens written, "
                f"{rate:.0f} tok/s, budget {budget.tokens} tok/batch",
                file=sys.stderr,
                flush=True,
            )
            last_report = now
    stats.seconds = time.monotonic() - start
    stats.issues = dict(issues.counts)
    return stats
