"""Issue 40's two lost answers: a reading of coerced arguments that is a few ids short of the
bill. Where could whitespace the stack dropped have held those ids?

vLLM 0.33's Kimi parser (its `kimi_k2_config`: `strip_trailing_reasoning_whitespace`,
`drop_whitespace_only_content_before_tools`; `_extract_args_json`: `raw_args.strip()`) drops
them in three places, and a coercion writes the arguments again with json.dumps, which keeps
no edge at all: the reasoning's tail, a whitespace-only content before the tool calls, and the
edges of every call's arguments. tests/stack_models.vllm_0_33 (checked against that code's
answers on ground-truth ids) returns the same message, at the same bill, for the missing ids
in any of them. So a set that places them only after the think-end and before the section
leaves out sequences the story admits: it may never be called closed, under any profile.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from stack_models import Answer, vllm_0_33

from kimi_pipe.core.models import Model
from kimi_pipe.core.record_builder import RecordBuilder
from kimi_pipe.core.serving import UNKNOWN_PROFILE
from kimi_pipe.extraction.split_check import vocabulary_of
from tests.support.candidate_sets import covers, sequences_of
from tests.test_closed_sets import declared, pieces

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    for name in ("add", "multiply")
]
REASONING = "I should call both tools in the same block."
COMPACT = '{"a":"2","b":3}'  # coerced by the stack: returned as json.dumps writes {"a": 2, "b": 3}
DUMPS = '{"a": 2, "b": 3}'
# The same three ids of whitespace, at each place the stack drops it (the counts are checked).
PLACES = {
    "content": Answer(REASONING, " \t \t", (("add", COMPACT, 0), ("multiply", DUMPS, 1))),
    "reasoning tail": Answer(
        REASONING + " \t \t", "", (("add", COMPACT, 0), ("multiply", DUMPS, 1))
    ),
    "coerced call's edges": Answer(
        REASONING, "", (("add", "\n" + COMPACT + " \t ", 0), ("multiply", DUMPS, 1))
    ),
    "other call's edges": Answer(
        REASONING, "", (("add", COMPACT, 0), ("multiply", " \t" + DUMPS + "  ", 1))
    ),
}
MESSAGES = [{"role": "user", "content": "Add and multiply 2 and 3."}]


def _response(message: dict[str, Any], billed: int) -> dict[str, Any]:
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
    return {"choices": [choice], "usage": {"completion_tokens": billed}}


@pytest.mark.kimi
def test_missing_ids_may_sit_in_content_tail_or_argument_edges_alike(kimi: Model) -> None:
    reading = Answer(REASONING, "", (("add", COMPACT, 0), ("multiply", DUMPS, 1)))
    short = len(kimi.encode(pieces(reading)))
    truths = {place: kimi.encode(pieces(answer)) for place, answer in PLACES.items()}
    messages = {place: vllm_0_33(answer, 0, TOOLS) for place, answer in PLACES.items()}
    # One message and one bill, four different id sequences, each 3 ids over the reading.
    assert all(len(ids) == short + 3 for ids in truths.values()), {
        p: len(ids) - short for p, ids in truths.items()
    }
    assert len({tuple(ids) for ids in truths.values()}) == len(PLACES)
    first = messages["content"]
    assert all(m == first for m in messages.values())
    assert first["content"] is None and first["tool_calls"][0]["function"]["arguments"] == DUMPS


@pytest.mark.kimi
@pytest.mark.parametrize(
    "profile",
    ["unknown", "vllm_0_33", "vllm_0_33 tail kept", "vllm_0_33 tail and edges kept"],
)
def test_a_reading_short_of_the_bill_leaves_the_set_open(kimi: Model, profile: str) -> None:
    """Under every profile that admits the coercion: a declared `reasoning_tail: kept` does
    not close it, since the content and the arguments' edges drop whitespace under any."""
    chosen = {
        "unknown": UNKNOWN_PROFILE,
        "vllm_0_33": declared("vllm_0_33"),
        "vllm_0_33 tail kept": replace(declared("vllm_0_33"), reasoning_tail="kept"),
        "vllm_0_33 tail and edges kept": replace(
            declared("vllm_0_33"), reasoning_tail="kept", argument_edges="kept"
        ),
    }[profile]
    vocab = vocabulary_of(kimi.tokenizer)
    for place, answer in PLACES.items():
        truth = kimi.encode(pieces(answer))
        if profile.endswith("kept") and place == "reasoning tail":
            continue  # the declared profile says no stack strips it
        if profile.endswith("edges kept") and "edges" in place:
            continue
        response = _response(vllm_0_33(answer, 0, TOOLS), len(truth))
        record = RecordBuilder(kimi, chosen).build(MESSAGES, TOOLS, response)
        where = (profile, place, record["issues"])
        assert not record["ok"], where
        candidates = record.get("candidates")
        assert candidates is not None, where
        assert candidates["closed"] is False, where
        assert "may have dropped whitespace" in (candidates["why_open"] or ""), where
        # Nothing listed is the truth's reading 3 ids short: every option fits the bill.
        assert all(len(ids) == len(truth) for ids in sequences_of(candidates["options"]))
        # But each such reading is a gap, and the truth leaves one at a site of its class:
        # the target bounds it among the options' rivals (core/gaps.py).
        assert candidates["gaps"], where
        assert covers(candidates, truth, vocab), where
