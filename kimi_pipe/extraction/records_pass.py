"""The records pass of target resolution: score every resolvable record of a run's
records file, run the split check on the text-proven ones, draw the opt-in posterior rung
(`resolve.posterior_sampled`, core/posterior.py) last, and rewrite the file once, under
the run directory's lock, through store/atomic.py (extraction/resolve.rewrite_records).

It sits above both checks (extraction/resolve.py scores candidate sets,
extraction/split_check.py searches other splits of the same text), so neither imports the
other's caller.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kimi_pipe.core.evidence import POSTERIOR_SAMPLED
from kimi_pipe.core.issue_codes import Code
from kimi_pipe.core.posterior import sample_posterior
from kimi_pipe.core.token_record import TokenRecord
from kimi_pipe.extraction.gap_bounds import gap_bounds
from kimi_pipe.extraction.prefix_check import check_prefix, checkable_prefix
from kimi_pipe.extraction.resolve import (
    TARGET_UNRESOLVED,
    ResolveSettings,
    SuffixScorer,
    _digest,
    _line_id,
    blocking_issues,
    covered_issues,
    records_lock,
    resolvable,
    rewrite_records,
    score_record,
)
from kimi_pipe.extraction.split_check import check_record, checkable, next_token_scorer

log = logging.getLogger("kimi_pipe.resolve")


def resolve_records(
    records: str | os.PathLike[str],
    scorer: SuffixScorer | None,
    settings: ResolveSettings,
    *,
    mine: Any = None,
    vocab: Any = None,
) -> dict[str, Any]:
    """Score every resolvable record of the file (those `mine(id)` accepts, e.g. this work
    shard's) and rewrite the file once. Returns counts and the seconds spent. `scorer` None:
    the backend cannot score; resolvable records are counted and left unresolved. With
    `vocab` (a `core.splits.Vocabulary`) and a scorer that holds a transformers model, the
    split check (extraction/split_check.py) then runs on every text-proven record."""
    path = Path(records)
    counts: dict[str, int] = {}
    start = time.monotonic()
    if not settings.enabled or not path.exists():
        return {"enabled": settings.enabled, "counts": counts, "seconds": 0.0}
    latest: dict[str, tuple[bytes, dict[str, Any]]] = {}
    with open(path, "rb") as fh:
        for raw in fh:
            sid, obj = _line_id(raw)
            if sid is not None and obj is not None and raw.endswith(b"\n"):
                latest[sid] = (raw, obj)
    updates: dict[str, tuple[str, TokenRecord]] = {}
    for sid, (raw, rec) in latest.items():
        if mine is not None and not mine(sid):
            continue
        why = resolvable(rec, max_options=settings.max_options)
        if why is None and scorer is None:
            why = "backend_cannot_score"
        if why is None and _already_scored(rec, scorer.model_name, settings):  # type: ignore[union-attr]
            why = "scored_before"
        if why is not None:
            if why not in ("already_ok", "no_candidates"):
                counts[f"not_resolved_{why}"] = counts.get(f"not_resolved_{why}", 0) + 1
            continue
        assert scorer is not None
        unlisted = None
        if rec["candidates"].get("gaps") is not None:
            # A bounded open set: its gaps' bounds under the request's sampling.
            target = getattr(scorer, "model", None)
            sampling = settings.sampling_of(rec)
            if vocab is None or target is None:
                key = "not_resolved_no_vocabulary"
                counts[key] = counts.get(key, 0) + 1
                continue
            if sampling is not None:  # else score_record answers None: no temperature known
                unlisted = gap_bounds(
                    rec.get("prompt_ids") or [],
                    rec["candidates"]["gaps"],
                    vocab,
                    next_token_scorer(target, sampling),
                )
        new = score_record(rec, scorer, settings, unlisted=unlisted)
        if new is None:  # no temperature known (a set too large was counted above)
            counts["not_resolved_no_sampling"] = counts.get("not_resolved_no_sampling", 0) + 1
            continue
        key = "resolved" if new.get("ok") else TARGET_UNRESOLVED
        counts[key] = counts.get(key, 0) + 1
        updates[sid] = (_digest(raw), new)
    split = _split_check_pass(latest, updates, scorer, settings, mine, vocab, counts)
    if settings.posterior_sampled:
        _posterior_pass(latest, updates, settings, mine, counts)
    scored_s = time.monotonic() - start
    written = 0
    if updates:
        with records_lock(path, settings.lock_timeout_s):
            written = rewrite_records(path, updates)
    summary = {
        "enabled": True,
        "counts": dict(sorted(counts.items())),
        "rewritten": written,
        "seconds": time.monotonic() - start,
        "scoring_seconds": scored_s,
        "prefix_tokens": getattr(scorer, "prefix_tokens", None),
        "suffix_tokens": getattr(scorer, "suffix_tokens", None),
        **split,
    }
    if counts.get("not_resolved_backend_cannot_score"):
        log.warning(
            "%s: %d records have candidate sets but this backend cannot score them (no "
            "suffix_scorer); they stay unresolved (docs/resolve.md)",
            path,
            counts["not_resolved_backend_cannot_score"],
        )
    elif counts:
        log.debug("target resolution of %s: %s", path, summary)  # the figures (counted below)
    return summary


def _split_check_pass(
    latest: Mapping[str, tuple[bytes, dict[str, Any]]],
    updates: dict[str, tuple[str, TokenRecord]],
    scorer: SuffixScorer | None,
    settings: ResolveSettings,
    mine: Any,
    vocab: Any,
    counts: dict[str, int],
) -> dict[str, Any]:
    """The split check of every checkable record (after candidate scoring), into `updates`."""
    model = getattr(scorer, "model", None)
    if not settings.split_check or vocab is None or model is None or scorer is None:
        return {"split_check": False}
    started = time.monotonic()
    tokens = 0
    for sid, (raw, rec) in latest.items():
        if mine is not None and not mine(sid):
            continue
        current = updates[sid][1] if sid in updates else rec
        if checkable_prefix(current):
            # A proven prefix is weighed like a text-proven record (extraction/prefix_check.py).
            checked, cost = check_prefix(current, model, vocab, settings, scorer.model_name)
            tokens += cost
            if checked is not None:
                key = (
                    Code.PREFIX_SPLIT_CHECKED
                    if "prefix" in checked
                    else Code.PREFIX_SPLIT_AMBIGUOUS
                )
                counts[key] = counts.get(key, 0) + 1
                updates[sid] = (_digest(raw), checked)
            continue
        if checkable(current, settings.billing_splits) is not None:
            continue
        new, cost = check_record(current, model, vocab, settings, scorer.model_name)
        tokens += cost
        if new is None:
            counts["split_not_checked_no_sampling"] = (
                counts.get("split_not_checked_no_sampling", 0) + 1
            )
            continue
        outcome = _split_outcome(new)
        counts[outcome] = counts.get(outcome, 0) + 1
        updates[sid] = (_digest(raw), new)
    return {
        "split_check": True,
        "split_check_seconds": time.monotonic() - started,
        "split_check_tokens": tokens,
    }


def _posterior_pass(
    latest: Mapping[str, tuple[bytes, dict[str, Any]]],
    updates: dict[str, tuple[str, TokenRecord]],
    settings: ResolveSettings,
    mine: Any,
    counts: dict[str, int],
) -> None:
    """Draw one option for each record target resolution left unresolved, after the prefix
    check: a record whose prefix the target withdrew (`prefix_split_ambiguous`) is not drawn
    and keeps its issue; a drawn record keeps the prefix as it stood (checked or not)."""
    for sid, (raw, rec) in latest.items():
        if mine is not None and not mine(sid):
            continue
        current = updates[sid][1] if sid in updates else rec
        cands = current.get("candidates")
        covered = covered_issues(cands) if isinstance(cands, Mapping) else frozenset()
        blocking = blocking_issues(current.get("issues") or [])
        drawn = sample_posterior(current, settings.posterior_seed, blocking, covered)
        if drawn is None:
            continue
        counts[POSTERIOR_SAMPLED] = counts.get(POSTERIOR_SAMPLED, 0) + 1
        updates[sid] = (_digest(raw), drawn)


def _split_outcome(record: Mapping[str, Any]) -> str:
    check = record.get("split_check") or {}
    if not record.get("ok"):
        return "split_unresolved"
    if check.get("chosen") == "other":
        return "split_resolved_other"
    return (
        Code.SPLIT_CHECKED
        if check.get("posterior") == 1.0 and check.get("paths") == 1
        else ("split_resolved_record")
    )


def _already_scored(rec: Mapping[str, Any], model: str, settings: ResolveSettings) -> bool:
    """Scored by this model at this threshold before: scoring again would give the same."""
    res = rec.get("resolution")
    return (
        isinstance(res, Mapping)
        and res.get("model") == model
        and res.get("min_posterior") == settings.min_posterior
    )
