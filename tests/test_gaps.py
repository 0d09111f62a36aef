"""Bounded open sets (core/gaps.py): a reading short of the bill stands for itself with
whitespace put back at its text pieces' edges, and every such sequence leaves it at a site,
at or after its start, with an id of that site's class.

Checked end to end on the stack that drops whitespace in the most places (vLLM 0.33's Kimi
parser, tests/stack_models.vllm_0_33: the reasoning's tail, a whitespace-only content, the
arguments' edges, and coercion rewriting the arguments): each answer's truth is a listed
sequence, a gap's reading, or leaves a gap at a site of its class (`covers`).
"""

from __future__ import annotations

import random
import sys
from collections import Counter

import pytest
from stack_models import Answer, vllm_0_33

from kimi_pipe.core.gaps import WHITESPACE, consistent, whitespace_run
from kimi_pipe.core.models import Model
from kimi_pipe.core.record_builder import RecordBuilder
from kimi_pipe.core.resolvability import resolvable
from kimi_pipe.core.serving import UNKNOWN_PROFILE
from kimi_pipe.extraction.split_check import vocabulary_of
from tests.support.candidate_sets import covers
from tests.test_closed_sets import pieces
from tests.test_dropped_whitespace import COMPACT, DUMPS, MESSAGES, REASONING, TOOLS, _response

# Spellings a coercing stack returns as json.dumps writes {"a": 2, "b": 3} (and that itself).
SPELLINGS = (DUMPS, COMPACT, '{"a":2,"b":"3"}', '{"a": "2", "b": 3}', '{"a":"2","b":"3"}')
# Whitespace a model may write where a stack strips it, Unicode's included (str.strip()).
SPACES = (" ", "\n", "\t", "  ", "\n\n", "\r\n", "\xa0", "\u3000", "\u2028", " \t", "\x0b")


def test_whitespace_is_what_str_strip_removes() -> None:
    everything = "".join(chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace())
    assert everything == WHITESPACE
    assert all(("x" + ch).strip() == "x" for ch in WHITESPACE)


def test_which_bytes_a_gaps_sequence_can_put_at_a_site() -> None:
    rest = b"Paris."
    assert consistent(b"Par", rest, piece_start=False)  # another split of the text
    assert consistent(b"Paris.\n", rest, piece_start=False)  # the text, then whitespace
    assert consistent(b".\n", b".", piece_start=False)
    assert not consistent(b" Paris", rest, piece_start=False)  # whitespace inside a piece
    assert consistent(b" Paris", rest, piece_start=True)  # before a piece
    assert consistent(b"\n\n", b"", piece_start=True)  # a whitespace piece before a marker
    assert not consistent(b"x", b"", piece_start=True)
    assert not consistent(b"Paris. x", rest, piece_start=False)
    cut = "\u3000".encode()[:2]  # a token may end inside a whitespace character's bytes
    assert whitespace_run(cut) and consistent(cut, b"", piece_start=True)
    assert consistent(b"Paris." + cut, rest, piece_start=False)
    assert not whitespace_run("\u3001".encode())  # the same lead bytes, not whitespace


@pytest.mark.kimi
def test_every_sequence_a_bounded_set_leaves_out_is_covered(kimi: Model) -> None:
    """Random answers: whitespace at every place vLLM 0.33 strips it, each call's arguments in
    any spelling its coercion rewrites to json.dumps's, billed at the truth's length. Where
    the set is bounded, nothing it leaves out escapes its gaps."""
    vocab = vocabulary_of(kimi.tokenizer)
    rng = random.Random(7)
    builder = RecordBuilder(kimi, UNKNOWN_PROFILE)

    def space() -> str:
        if rng.random() < 0.5:
            return ""
        return "".join(rng.choice(SPACES) for _ in range(rng.randint(1, 3)))

    seen: Counter[str] = Counter()
    for _ in range(40):
        calls = tuple(
            (name, space() + rng.choice(SPELLINGS) + space(), index)
            for index, name in enumerate(("add", "multiply"))
        )
        answer = Answer(REASONING + space(), space() if rng.random() < 0.5 else "", calls)
        truth = kimi.encode(pieces(answer))
        record = builder.build(MESSAGES, TOOLS, _response(vllm_0_33(answer, 0, TOOLS), len(truth)))
        cands = record.get("candidates") or {}
        assert not record["ok"] or record["output_ids"] == truth, answer
        if not record["ok"] and cands.get("gaps") is not None:
            seen["bounded"] += 1
            assert cands["closed"] is False
            assert covers(cands, truth, vocab), answer
            seen["resolvable"] += resolvable(record, max_options=64) is None
    assert seen["bounded"] >= 20 and seen["resolvable"] >= 15, seen


@pytest.mark.kimi
def test_text_a_parser_drops_in_a_tool_section_is_any_text(kimi: Model) -> None:
    """vLLM 0.34's Kimi parser suppresses whatever the model writes after its tool calls, not
    only whitespace: past the section's opening marker, a marker after a marker is a site of
    any id. Before it (the content's place) only whitespace."""
    vocab = vocabulary_of(kimi.tokenizer)
    calls = (("add", DUMPS, 0), ("multiply", COMPACT, 1))
    reading = kimi.encode(pieces(Answer(REASONING, "", calls)))
    end = kimi.markers["<|im_end|>"]
    section = reading.index(kimi.markers["<|tool_calls_section_begin|>"])
    gap = {"output_ids": reading, "start": 5, "open_end": False, "section_start": section}
    word = kimi.tokenizer.encode_ordinary("Done")
    after = reading[:-1] + word + [end]  # text after the section, dropped by the parser
    before = reading[:section] + word + reading[section:]  # text as content: returned
    spaced = reading[:section] + kimi.tokenizer.encode_ordinary("\n\n") + reading[section:]
    candidates = {"options": [], "gaps": [gap]}
    assert covers(candidates, after, vocab)
    assert not covers(candidates, before, vocab)
    assert covers(candidates, spaced, vocab)
    assert not covers({"options": [], "gaps": [{**gap, "section_start": None}]}, after, vocab)
