"""What extraction reads: token records -> samples, length limits, paths and the backend.

Shared by the extract stage and the engine-agnostic capture loop (`sharding`). A backend is
the module `kimi_pipe.extraction.<backend>_backend` (chosen by `extract.backend`; the package
`kimi_pipe.extraction.sglang` for `sglang`) with `open_backend(job: ExtractJob) -> Backend`.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kimi_pipe.core.evidence import (
    DEFAULT_ACCEPT,
    LADDER,
    POSTERIOR_SAMPLED,
    evidence_of,
    taken_whole,
    usable,
)
from kimi_pipe.core.issue_codes import Code
from kimi_pipe.core.prefix import training_ids
from kimi_pipe.core.token_record import record_problem
from kimi_pipe.errors import ConfigError, MissingFile
from kimi_pipe.extraction.job import ExtractJob
from kimi_pipe.plugins import BACKENDS, resolve_plugin
from kimi_pipe.store.records import ReadStats, iter_records

log = logging.getLogger("kimi_pipe.extract")


class Backend(Protocol):
    store_fields: dict[str, Any]

    def forward(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TokenSample:
    """One sequence to run: the record's ids, never re-tokenised."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]


# --------------------------------------------------------------------------- records


def read_token_records(
    path: str | os.PathLike[str], only_ok: bool = True, accept: Sequence[str] | None = None
) -> tuple[list[TokenSample], Counter[str]]:
    """Read token records; bad lines/records are reported and counted, never fatal.

    `accept`: the evidence rungs kept (core/evidence.py); None derives it from `only_ok`
    (true: the proven rungs and proven prefixes; false: every rung). A partial_character
    record is never kept; a prefix_proven one is cut to its proven prefix (core/prefix.py); a
    posterior_sampled one (drawn, not bought) is kept whole only where `accept` names it,
    else cut to its proven prefix where it has one (counted: `drawn_posterior_sampled`).
    A later record with the same id replaces an earlier one (a retried sample).
    """

    rungs = tuple(accept) if accept else (DEFAULT_ACCEPT if only_ok else LADDER)
    path = Path(path)
    if not path.exists():
        raise MissingFile(
            f"token records {path} not found: run `python -m kimi_pipe generate` (records.jsonl "
            "in its run dir) or `python -m kimi_pipe reconstruct` first"
        )
    counts: Counter[str] = Counter()
    by_id: dict[str, TokenSample] = {}
    read = ReadStats()
    for rec in iter_records(path, read):  # bad and torn lines are logged and counted there
        if rec.get("output_ids") and not usable(rec, rungs):
            counts["skipped_not_ok" if not rec.get("ok") else "skipped_by_accept"] += 1
            counts[f"skipped_evidence_{evidence_of(rec)}"] += 1
            continue
        if only_ok and accept is None and not rec.get("ok", False) and not usable(rec, rungs):
            counts["skipped_not_ok"] += 1  # an error record (no ids)
            continue
        problem = record_problem(rec)
        if problem:
            counts[f"skipped_{problem}"] += 1
            log.warning("%s: record %r unusable (%s), skipped", path, rec.get("id"), problem)
            continue
        try:
            # a prefix_proven record: its proven prefix only; a drawn one as the policy says
            ids, mask = training_ids(rec, rungs)
        except ValueError as exc:
            counts["skipped_prefix_not_proven"] += 1
            log.warning("%s: %s, skipped", path, exc)
            continue
        if len(ids) < len(rec["prompt_ids"]) + len(rec["output_ids"]):
            counts["cut_to_proven_prefix"] += 1
            counts["tokens_dropped_by_prefix"] += (
                len(rec["prompt_ids"]) + len(rec["output_ids"]) - len(ids)
            )
        if evidence_of(rec) == POSTERIOR_SAMPLED and taken_whole(rec, rungs):
            counts["drawn_posterior_sampled"] += 1  # ids drawn from the target, not bought
        sid = str(rec["id"])
        if sid in by_id:
            counts["replaced_duplicate_id"] += 1
            del by_id[sid]  # keep file order of the surviving record
        by_id[sid] = TokenSample(sid, ids, mask)
    bad = len(read.bad_lines) + int(read.torn_tail)
    counts["lines"] = read.records + bad
    if bad:
        counts["skipped_bad_json"] = bad
    counts["usable"] = len(by_id)
    return list(by_id.values()), counts


def apply_max_len(
    samples: Iterable[TokenSample], max_len: int | None, over_max_len: str
) -> tuple[list[TokenSample], Counter[str]]:
    """Truncate or skip samples longer than max_len; count what happened."""
    if over_max_len not in ("truncate", "skip"):
        raise ConfigError(
            f"extract.over_max_len must be 'truncate' or 'skip', not {over_max_len!r}"
        )
    counts: Counter[str] = Counter()
    kept: list[TokenSample] = []
    for s in samples:
        if max_len is None or len(s.input_ids) <= max_len:
            kept.append(s)
        elif over_max_len == "skip":
            counts["skipped_over_max_len"] += 1
        elif not any(s.loss_mask[:max_len]):
            # Nothing left to learn from: the cut removed every loss token.
            counts["skipped_no_loss_after_truncation"] += 1
        else:
            counts[Code.TRUNCATED] += 1
            counts["tokens_dropped_by_truncation"] += len(s.input_ids) - max_len
            kept.append(TokenSample(s.id, s.input_ids[:max_len], s.loss_mask[:max_len]))
    return kept, counts


# --------------------------------------------------------------------------- backend


def load_backend(job: ExtractJob) -> Backend:
    """`extract.backend`: a name in kimi_pipe/plugins.py's BACKENDS, or `package.module:attr`
    of a function open_backend(job: ExtractJob) of your own."""
    open_backend = resolve_plugin("extract.backend", job.backend, BACKENDS)
    return open_backend(job)  # type: ignore[no-any-return]
