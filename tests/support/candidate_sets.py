"""Every id sequence a candidate set stands for: each option at every combination of its
choice points (core/candidates.ChoicePoint). The corpora's "the truth is in every closed
set" checks ask this, not only the options' own ids. A bounded open set also stands for
what its gaps leave unlisted (core/gaps.py): `covers` asks both."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kimi_pipe.core.gaps import site_classes
from kimi_pipe.core.splits import Vocabulary
from kimi_pipe.extraction.resolve import option_ids

MAX_COMBINATIONS = 100_000  # a test's set; far above the 400 two calls' edges make


def sequences_of(options: Iterable[Any]) -> set[tuple[int, ...]]:
    """`options`: the record's option dicts or core/candidates.Option objects."""
    out: set[tuple[int, ...]] = set()
    for option in options:
        as_dict = option if isinstance(option, Mapping) else option.to_record()
        points = as_dict.get("points") or []
        sizes = [len(p["alternatives"]) for p in points]
        total = 1
        for n in sizes:
            total *= n
        assert total <= MAX_COMBINATIONS, f"{total} combinations: too many to list in a test"
        for choices in itertools.product(*(range(n) for n in sizes)):
            out.add(tuple(option_ids(as_dict, list(choices))))
    return out


def covers(candidates: Mapping[str, Any], truth: Sequence[int], vocab: Vocabulary) -> bool:
    """The truth is one of the sequences the options stand for, or (a bounded open set) a
    gap's reading, or it leaves a gap at a site, at or after the gap's start, with an id of
    that site's class: the sequences target resolution bounds (extraction/gap_bounds.py)."""
    if tuple(truth) in sequences_of(candidates.get("options") or []):
        return True
    for gap in candidates.get("gaps") or []:
        ids, start = gap["output_ids"], gap["start"]
        if list(ids) == list(truth):
            return True  # a bill over what was served: the reading is a rival too
        n = 0
        while n < min(len(ids), len(truth)) and ids[n] == truth[n]:
            n += 1
        if n < start or n >= len(truth) or (n == len(ids) and not gap["open_end"]):
            continue
        classes = site_classes(
            ids, start, vocab, open_end=gap["open_end"], section_start=gap.get("section_start")
        )
        if classes[n - start] is None or truth[n] in classes[n - start]:
            return True  # None: any id there
    return False
