"""Every id sequence a candidate set stands for: each option at every combination of its
choice points (core/candidates.ChoicePoint). The corpora's "the truth is in every closed
set" checks ask this, not only the options' own ids."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

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
