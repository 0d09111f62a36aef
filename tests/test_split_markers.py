"""split_markers: the pre-check that skips the regex gives the regex's own answer."""

from __future__ import annotations

import random
import re

from kimi_pipe.core.formats import Marker, Piece, split_markers

NAMES = ("<|a|>", "<|bb|>", "<think>", "</think>")


def _by_regex(text: str) -> list[Piece]:
    alternatives = sorted(NAMES, key=len, reverse=True)
    split = re.compile("(" + "|".join(re.escape(n) for n in alternatives) + ")")
    return [Marker(c) if c in NAMES else c for c in split.split(text) if c]


def test_marker_after_many_starts_is_found() -> None:
    # More "<" than the pre-check tries: the regex still runs and finds the marker.
    text = "a < b " * 20 + "x</think>y"
    assert split_markers(text, NAMES) == ["a < b " * 20 + "x", Marker("</think>"), "y"]


def test_starts_without_a_marker_stay_one_text() -> None:
    assert split_markers("if a < b and c <t: <|", NAMES) == ["if a < b and c <t: <|"]
    assert split_markers("", NAMES) == []


def test_same_pieces_as_the_regex() -> None:
    rng = random.Random(7)
    alphabet = ["<", "|", "a", "b", ">", "x", " ", "/", "<t", "<|a|>", "</think>", "<think"]
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(40)))
        assert split_markers(text, NAMES) == _by_regex(text), text
