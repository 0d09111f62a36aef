"""Prefix split check: the target confirms a proven prefix as the split check confirms a
text-proven record (docs/design.md, "Proven prefixes").

A `prefix_proven` record's prefix is what every reading of its closed set shares at its
canonical split. An engine that drew a non-canonical split of one reading returned the same
text and count, and that split may depart from the prefix before the cut: on the 500-answer
calibration (SmolLM2, T=1, top_p 0.9) 18 of 254 such prefixes were wrong that way. So, as
`split_check` does for a whole record, the target weighs every reading the sampler could
have drawn at the billed length: each option's splits, and the splits of the near readings
(`split_check.neighbour_readings`, the same search and budget). The prefix stands when the
readings that leave it before the cut hold at most 1 - `resolve.min_posterior` of their
mass and the search was complete; otherwise the record becomes `unresolved` with issue
`prefix_split_ambiguous` (nothing of it reaches training).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, cast

from kimi_pipe.core.evidence import PREFIX_PROVEN, UNRESOLVED, evidence_of
from kimi_pipe.core.issue_codes import PREFIX_SPLIT_AMBIGUOUS, PREFIX_SPLIT_CHECKED
from kimi_pipe.core.splits import Vocabulary, search_splits
from kimi_pipe.core.token_record import TokenRecord
from kimi_pipe.extraction.resolve import ResolveSettings
from kimi_pipe.extraction.sampler import logsumexp
from kimi_pipe.extraction.split_check import neighbour_readings, next_token_scorer


def checkable_prefix(record: Mapping[str, Any]) -> bool:
    """A prefix_proven record whose prefix the target has not weighed yet."""
    prefix = record.get("prefix")
    return (
        evidence_of(record) == PREFIX_PROVEN
        and isinstance(prefix, Mapping)
        and "split_check" not in prefix
    )


def check_prefix(
    record: Mapping[str, Any],
    model: Any,
    vocab: Vocabulary,
    settings: ResolveSettings,
    model_name: str,
) -> tuple[TokenRecord | None, int]:
    """The record after its prefix check (None: the request's temperature is unknown), and
    the forward tokens it cost."""
    sampling = settings.sampling_of(record)
    if sampling is None:
        return None, 0
    scorer = next_token_scorer(model, sampling)
    options = record["candidates"]["options"]
    k = int(record["prefix"]["prefix_tokens"])
    prefix = tuple(options[0]["output_ids"][:k])
    billed = record.get("completion_tokens_reported")
    billed = billed if isinstance(billed, int) and billed >= 0 else None
    # Option 0 stands for the record; every other option and near reading is a neighbour.
    first = list(options[0]["output_ids"])
    as_resolved = copy.deepcopy(dict(record))
    as_resolved["output_ids"] = first
    as_resolved["resolution"] = {"chosen": 0}
    search = search_splits(record["prompt_ids"], first, billed, vocab, scorer)
    neighbours, limits = neighbour_readings(
        as_resolved, search, billed, vocab, scorer, settings.near_reading_branches
    )
    paths: dict[tuple[int, ...], float] = {}
    for path in search.options(first):
        paths.setdefault(tuple(path.output_ids), path.logprob)
    for reading in neighbours:
        paths.setdefault(tuple(reading.output_ids), reading.logprob)
    limits = sorted({*search.limits, *limits})
    total = logsumexp(list(paths.values()))
    early = logsumexp([lp for ids, lp in paths.items() if ids[:k] != prefix])
    posterior = 0.0 if total == -math.inf else 1.0 - math.exp(early - total)
    facts = {
        "model": model_name,
        "min_posterior": settings.min_posterior,
        "posterior": posterior,
        "paths": sum(lp > -math.inf for lp in paths.values()),
        "closed": not limits,
        **({"limits": limits} if limits else {}),
    }
    out = cast(TokenRecord, copy.deepcopy(dict(record)))
    if not limits and total > -math.inf and posterior >= settings.min_posterior:
        out["prefix"] = {**out["prefix"], "split_check": facts}
        out["notes"] = list(dict.fromkeys([*(record.get("notes") or []), PREFIX_SPLIT_CHECKED]))
        return out, scorer.tokens
    out.pop("prefix", None)
    out["evidence"] = UNRESOLVED
    out["issues"] = list(dict.fromkeys([*(record.get("issues") or []), PREFIX_SPLIT_AMBIGUOUS]))
    out["prefix_split_check"] = facts  # kept: why the prefix was withdrawn
    return out, scorer.tokens
