"""Issue 40: a proven prefix for an open candidate set whose only doubts lie at or after the
reasoning's tail (core/candidates.TAIL_ONLY_DOUBTS, `shared_by_unlisted`; core/prefix.py).

The proof that the cut is early enough is tests/test_dropped_whitespace.py's counterexample:
one message and one bill for four id sequences, the missing whitespace in the content, the
reasoning's tail, or either call's argument edges. Every one of them (and tails that join the
reasoning's last character) must start with the proven prefix.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
from stack_models import Answer, vllm_0_33

from benchmarks.wild_yield import build, rows
from kimi_pipe.core.candidates import TAIL_ONLY_DOUBTS
from kimi_pipe.core.evidence import PREFIX_PROVEN, UNRESOLVED
from kimi_pipe.core.models import Model
from kimi_pipe.core.prefix import OPEN_RULE, proven_prefix, training_ids, with_prefix
from kimi_pipe.core.record_builder import RecordBuilder
from kimi_pipe.core.serving import UNKNOWN_PROFILE
from tests.test_closed_sets import declared, pieces
from tests.test_dropped_whitespace import COMPACT, DUMPS, MESSAGES, PLACES, REASONING, TOOLS

CALLS = (("add", COMPACT, 0), ("multiply", DUMPS, 1))
# Tails that join the reasoning's last chunk (its final `.`) or stand alone after it.
TAILS = {
    f"reasoning tail {tail!r}": Answer(REASONING + tail, "", CALLS)
    for tail in ("\n", "\n\n", ".\n", " \n", "\r\n\r\n", "  ")
}
PROFILES = {
    "unknown": lambda: UNKNOWN_PROFILE,
    "vllm_0_33": lambda: declared("vllm_0_33"),
    "vllm_0_33 tail kept": lambda: replace(declared("vllm_0_33"), reasoning_tail="kept"),
}


def _record(kimi: Model, profile: str, answer: Answer) -> tuple[dict[str, Any], list[int]]:
    truth = kimi.encode(pieces(answer))
    message = vllm_0_33(answer, 0, TOOLS)
    response = {
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
        "usage": {"completion_tokens": len(truth)},
    }
    builder = RecordBuilder(kimi, PROFILES[profile]())
    return dict(builder.build(MESSAGES, TOOLS, response)), truth


@pytest.mark.kimi
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_true_sequence_starts_with_the_open_prefix(kimi: Model, profile: str) -> None:
    cut = 0
    for place, answer in {**PLACES, **TAILS}.items():
        record, truth = _record(kimi, profile, answer)
        where = (profile, place, record["issues"])
        candidates = record.get("candidates") or {}
        if candidates.get("closed") is not False or record.get("evidence") != PREFIX_PROVEN:
            continue
        k = record["prefix"]["prefix_tokens"]
        assert record["prefix"]["rule"] == OPEN_RULE, where
        assert k <= candidates["shared_by_unlisted"], where
        ids, mask = training_ids(record)
        prompt = record["prompt_ids"]
        assert ids[: len(prompt)] == prompt and len(ids) == len(prompt) + k, where
        assert ids[len(prompt) :] == truth[:k], where  # the truth starts with the prefix
        assert len(mask) == len(ids) and any(mask[len(prompt) :]), where
        cut = max(cut, k)
    if profile != "vllm_0_33 tail kept":
        # Not vacuous: these sets are cut (the declared `kept` tail leaves some closed).
        assert cut > 0, profile
    # The cut stops before the reasoning's last chunk (" block."): never in the tail's reach.
    whole = kimi.tokenizer.encode_ordinary(REASONING)
    assert cut <= len(kimi.tokenizer.encode_ordinary(REASONING[: REASONING.rindex(" ")]))
    assert cut < len(whole)


@pytest.mark.kimi
def test_the_four_places_are_each_cut_before_their_drop_site(kimi: Model) -> None:
    """The counterexample itself, under the `unknown` profile: every place gets a prefix, and
    each of the four truths (different sequences) starts with each record's prefix."""
    truths = {place: kimi.encode(pieces(answer)) for place, answer in PLACES.items()}
    for place, answer in PLACES.items():
        record, _ = _record(kimi, "unknown", answer)
        assert record["evidence"] == PREFIX_PROVEN, (place, record["issues"])
        k = record["prefix"]["prefix_tokens"]
        head = record["candidates"]["options"][0]["output_ids"][:k]
        for other, truth in truths.items():
            assert truth[:k] == head, (place, other)


@pytest.mark.kimi
def test_wild_open_sets_keep_no_prefix(kimi: Model) -> None:
    """The two recorded open sets of issue 40 keep no proven prefix. AtlasCloud's (`<think>`
    billed as output, a tool-call turn one marker short of its bill) lists a reading where the
    model wrote no `<think>` at all: its readings differ at id 0 (`diverge_at`). (Until
    2026-12-07 only the tool section inside the reasoning was read there, and the ids before the
    reasoning's last lone space, 86, were kept.) Chutes's set lists the readings under "the
    stack added the space after `<think>`" too (a bounded set is listed whole, core/gaps.py):
    its reasoning starts `The`, not ` The`, a reading that differs at id 0, which
    `shared_by_unlisted` saw before the listing held it."""
    builder = RecordBuilder(kimi)
    found = {}
    for row in rows("kimi_k25_wild.jsonl"):
        if row["id"] == "7b93cdc983":
            found[row["provider"]] = build(builder, row)
    atlas, chutes = found["AtlasCloud"], found["Chutes"]
    assert atlas["candidates"]["closed"] is False
    assert atlas["candidates"]["diverge_at"] == 0
    assert any(
        o["output_ids"][0] != kimi.markers["<think>"] for o in atlas["candidates"]["options"]
    )
    assert atlas["evidence"] == UNRESOLVED and "prefix" not in atlas
    assert chutes["candidates"]["closed"] is False
    assert chutes["candidates"]["diverge_at"] == 0
    assert any("marker spaces removed" in o["label"] for o in chutes["candidates"]["options"])
    assert chutes["candidates"]["shared_by_unlisted"] == 0
    assert chutes["evidence"] == UNRESOLVED and "prefix" not in chutes


def _open_record() -> dict[str, Any]:
    option = {"output_ids": [5, 6, 7, 8, 9], "loss_mask": [1, 1, 1, 1, 1], "label": "a"}
    other = {"output_ids": [5, 6, 7, 8, 4], "loss_mask": [1, 1, 1, 1, 1], "label": "b"}
    return {
        "id": "x",
        "ok": False,
        "issues": ["tool_arguments_edges_unverifiable"],
        "prompt_ids": [1, 2],
        "output_ids": [5, 6, 7, 8, 9],
        "loss_mask": [0, 0, 1, 1, 1, 1, 1],
        "completion_tokens_reported": 5,
        "candidates": {
            "closed": False,
            "why_open": "a reading short of the bill: the stack may have dropped whitespace",
            "classes": ["argument_edges"],
            "diverge_at": 4,
            "options": [option, other],
            "shared_by_unlisted": 2,
        },
    }


def test_open_prefix_is_min_of_listed_diverge_and_unlisted() -> None:
    record = _open_record()
    prefix = proven_prefix(record)
    assert prefix is not None and prefix["prefix_tokens"] == 2 and prefix["rule"] == OPEN_RULE
    record["candidates"]["shared_by_unlisted"] = 9
    assert proven_prefix(record)["prefix_tokens"] == 4  # type: ignore[index]
    record["candidates"]["shared_by_unlisted"] = 0
    assert proven_prefix(record) is None


@pytest.mark.parametrize(
    "why",
    [
        "billing tolerance 2: billing cannot bound the options",
        "no billed completion_tokens to bound the stripped tail",
        "the stack may have stripped a whitespace-only reasoning",
        "an argument's ids could not be told apart in the output",
        "a reading short of the bill: the stack may have dropped whitespace; "
        "billing tolerance 1: billing cannot bound the options",
    ],
)
def test_open_set_with_another_doubt_is_never_cut(why: str) -> None:
    record = _open_record()
    record["candidates"]["why_open"] = why
    assert proven_prefix(record) is None
    out = with_prefix(copy.deepcopy(record))  # type: ignore[arg-type]
    assert out["evidence"] == UNRESOLVED and "prefix" not in out


def test_every_whitelisted_reason_is_one_the_enumeration_gives() -> None:
    """A reason reworded in core/candidates.py and not here would only lose prefixes; one
    here that the enumeration never gives would be dead weight: each is written there."""
    from pathlib import Path

    source = Path(__file__).resolve().parent.parent / "kimi_pipe/core/candidates.py"
    text = " ".join(source.read_text(encoding="utf-8").split())
    joined = text.replace('" "', "")  # adjacent string literals, as Python joins them
    for reason in TAIL_ONLY_DOUBTS:
        assert joined.count(f'"{reason}"') >= 2, reason  # the whitelist and the append


def test_training_ids_refuse_an_open_prefix_past_what_every_reading_shares() -> None:
    record = _open_record()
    record["evidence"] = PREFIX_PROVEN
    record["prefix"] = {"prefix_tokens": 3, "rule": OPEN_RULE}
    with pytest.raises(ValueError, match="not proven"):
        training_ids(record)
    record["prefix"]["prefix_tokens"] = 2
    ids, mask = training_ids(record)
    assert ids == [1, 2, 5, 6] and mask == [0, 0, 1, 1]
    record["candidates"]["closed"] = None  # not an open set any more: no exception applies
    with pytest.raises(ValueError):
        training_ids(record)


def test_output_lead_follows_the_prompt_bill_and_refuses_when_readings_disagree() -> None:
    """The ids before the output's own pieces: the generation prompt's end, where the billed
    prompt is one reading without it; none where some reading fits as rendered and another
    without it (a reading of the truth may then start either way)."""
    from kimi_pipe.core.candidates import _output_lead
    from kimi_pipe.core.prompt_proof import PromptReading, PromptReadings

    def usage(billed: int) -> dict[str, Any]:
        return {"usage": {"prompt_tokens": billed}}

    one = PromptReadings((PromptReading("template", [1, 2, 9]),), generation_open=(9,))
    assert _output_lead(one, usage(2)) == [9]  # billed without `9`: the model wrote it
    assert _output_lead(one, usage(3)) == []
    assert _output_lead(one, {}) == []  # no bill: the template's boundary stands
    two = PromptReadings(
        (PromptReading("template", [1, 2, 9]), PromptReading("other", [1, 9])),
        generation_open=(9,),
    )
    assert _output_lead(two, usage(2)) is None  # [1, 2] + output `9`, or [1, 9] as rendered
