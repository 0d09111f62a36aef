"""The target's bound on what a bounded open set leaves unlisted (core/gaps.py).

A gap is a reading short of its bill that stands for every sequence made of it by putting
whitespace back at its text pieces' edges (and, in a tool-call section, any text a parser
drops there). Each such sequence agrees with the reading up to some site k (at or after the
gap's `start`) and there takes an id of the site's class (any id but the reading's own, where
the class is None). So the mass of all of them is at most

    sum over sites k:  P(reading[:k] | prompt) * P(the class at k | prompt, reading[:k])

under the request's sampler (a class id outside the nucleus adds nothing: the sampler could
not have drawn it). Sites that several gaps share (the same ids before them) are counted
once, with the union of their classes. The reading itself is a rival too, at its own
probability: short of the bill it is not what an honest bill counts, but a provider that
bills more than it served makes it the answer (tests/fixtures/kimi_k25_responses.jsonl,
`billing_mismatch`). Target resolution adds these bounds to the listed options' rivals, so
the posterior it reports stays a lower bound (extraction/resolve.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kimi_pipe.core.gaps import site_classes
from kimi_pipe.core.splits import NextTokenScorer, Vocabulary
from kimi_pipe.extraction.sampler import logsumexp


def _all_but(logprob: float) -> float:
    """log(1 - p) for p = exp(logprob): the mass of every other id."""
    if logprob >= 0.0:
        return -math.inf
    return math.log1p(-math.exp(logprob))


def gap_bounds(
    prompt: Sequence[int],
    gaps: Sequence[Mapping[str, Any]],
    vocab: Vocabulary,
    scorer: NextTokenScorer,
) -> list[float]:
    """Log upper bounds on the mass the gaps stand for: one per distinct site (-inf where the
    sampler could draw none of its class), then each gap's reading."""
    prompt = list(prompt)
    # (ids before the site) -> (log P of them, {class id: log P of it there})
    sites: dict[tuple[int, ...], tuple[float, dict[int, float]]] = {}
    readings: list[float] = []  # log P(reading | prompt) of each gap
    for gap in gaps:
        ids = [int(t) for t in gap["output_ids"]]
        start = int(gap["start"])
        open_end = bool(gap.get("open_end"))
        classes = site_classes(
            ids, start, vocab, open_end=open_end, section_start=gap.get("section_start")
        )
        wanted: list[list[int]] = [[t] for t in ids[:start]]
        wanted += [
            ([ids[start + i]] if start + i < len(ids) else []) + (cls or [])
            for i, cls in enumerate(classes)
        ]
        rows = scorer.logprobs_along(prompt + ids, len(prompt), wanted)
        before = 0.0  # log P(ids[:k] | prompt)
        for k, row in enumerate(rows):
            if k >= start:
                own = 1 if k < len(ids) else 0
                _, found = sites.setdefault(tuple(ids[:k]), (before, {}))
                if classes[k - start] is None:
                    # Any id (key -1): all the mass but the reading's own id's there.
                    found[-1] = _all_but(row[0]) if own else 0.0
                else:
                    found.update(zip(wanted[k][own:], row[own:], strict=True))
            if k < len(ids):
                before += row[0]
            if before == -math.inf:
                break  # the sampler could not have drawn this reading's ids from here on
        readings.append(before)
    bounds = [before + logsumexp(list(found.values())) for before, found in sites.values()]
    return bounds + readings
