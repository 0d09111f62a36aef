"""A closed candidate set, or an `ok` record, is a claim about every stack a profile admits
(issue 30): the truth must be in every set called closed, and no record is `ok` with ids that
are not the truth.

Two halves. The stack models (tests/stack_models.py) are checked against the answers the real
servers' code returned on ground-truth ids (tests/fixtures/server_shapes). Then hypothesis
draws answers of the format's shapes (whitespace-only fields, fields that begin or end with
whitespace, markers next to whitespace, parallel calls, second turns whose index restarts at
0), runs each through every stack model, and builds the record under `unknown` and under the
stack's declared profile.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stack_models import DECLARED, STACKS, VARIANT, Answer

from kimi_pipe.core.formats import Marker, Piece
from kimi_pipe.core.models import Model
from kimi_pipe.core.record_builder import RecordBuilder
from kimi_pipe.core.serving import UNKNOWN_PROFILE, ServingProfile
from tests.support.candidate_sets import sequences_of
from tests.support.cases import tool_history
from tests.support.server_shapes import shipped_profile

SHAPES = Path(__file__).resolve().parent / "fixtures" / "server_shapes"
THINK_END, END = "</think>", "<|im_end|>"
SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
CALL = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_timer",
            "parameters": {
                "type": "object",
                "properties": {"seconds": {"type": "integer"}, "label": {"type": "string"}},
            },
        },
    },
]
# set_timer's arguments as a model may write them: typed values as strings or not, values of
# the string property that are numbers' text or numbers, spaced or compact JSON.
TIMER_VALUES = st.sampled_from([30, "30", "5"])
LABEL_VALUES = st.sampled_from(["tea", "12", 7, True, None])


@cache
def declared(stack: str) -> ServingProfile:
    name, overrides = DECLARED[stack]
    return replace(shipped_profile(name), **overrides)


def pieces(answer: Answer) -> list[Piece]:
    out: list[Piece] = [answer.reasoning, Marker(THINK_END), answer.content]
    if answer.calls:
        out.append(Marker(SECTION[0]))
        for name, arguments, index in answer.calls:
            out += [Marker(CALL[0]), f"functions.{name}:{index}", Marker(CALL[1]), arguments]
            out.append(Marker(CALL[2]))
        out.append(Marker(SECTION[1]))
    return [*out, Marker(END)]


def fields(kimi: Model, ids: list[int]) -> Answer | None:
    """The model's own output in fields, from its ids; None for shapes the models leave out
    (cut answers, text between calls or after the section's begin, no think-end)."""
    names = {v: k for k, v in kimi.markers.items()}
    parts: list[Any] = []
    run: list[int] = []
    for token in ids:
        if token in names:
            parts += [kimi.tokenizer.decode(run), names[token]]
            run = []
        else:
            run.append(token)
    if run or not parts or parts[-1] != END or THINK_END not in parts:
        return None
    reasoning, _, content = parts[0], parts[1], parts[2]
    if parts[1] != THINK_END:
        return None
    rest = parts[3:]
    calls: list[tuple[str, str, int]] = []
    if rest[0] == SECTION[0]:
        body = rest[1:-3]
        if rest[-3:] != [SECTION[1], "", END] or body[:1] != [""]:
            return None
        body = body[1:]
        while body:
            if len(body) < 6 or body[0] != CALL[0] or body[2] != CALL[1] or body[4] != CALL[2]:
                return None
            head, _, index = body[1].rpartition(":")
            if body[5] != "" or not head.startswith("functions."):
                return None
            calls.append((head.removeprefix("functions."), body[3], int(index)))
            body = body[6:]
    elif rest != [END]:
        return None
    return Answer(reasoning, content, tuple(calls))


def _comparable(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = message.get("reasoning", message.get("reasoning_content"))
    calls = [
        (
            "chatcmpl-tool-" if str(c.get("id")).startswith("chatcmpl-tool-") else c.get("id"),
            c["function"]["name"],
            c["function"]["arguments"],
        )
        for c in message.get("tool_calls") or []
    ]
    return {
        "reasoning": reasoning or None,
        "content": message.get("content") or None,
        "calls": calls,
    }


@pytest.mark.kimi
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_stack_models_reproduce_the_real_servers(kimi: Model, stack: str) -> None:
    compared = 0
    path = SHAPES / f"{VARIANT[stack]}.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        answer = fields(kimi, record["ground_truth_output_ids"])
        if answer is None or record["response"]["choices"][0]["finish_reason"] == "length":
            continue
        typed = {"get_weather", "set_timer"} if stack == "vllm_0_33" else {"get_weather"}
        if any(name not in typed for name, _, _ in answer.calls):
            continue  # dotted tools (name cuts) and others' coercion: modelled elsewhere
        if "<" in answer.reasoning + answer.content:
            continue  # literal marker text, which the stacks delete: modelled elsewhere
        if stack == "vllm_0_15_stream" and any(a[-1:].isspace() for _, a, _ in answer.calls):
            continue  # see stack_models.vllm_0_15_stream
        history = sum(len(m.get("tool_calls") or []) for m in record["messages"])
        model_message = STACKS[stack](answer, history, record["tools"])
        real = record["response"]["choices"][0]["message"]
        assert _comparable(model_message) == _comparable(real), (record["id"], answer)
        compared += 1
    assert compared >= 70, compared


WHITESPACE = st.sampled_from(["", " ", "  ", "\n", "\n\n", " \n", "\t", "\r\n"])
WORDS = st.sampled_from(["", "Hi", "Ok.", "Sure, yes.", "x = 1", "天气", "Done!"])


@st.composite
def answers(draw: st.DrawFn) -> tuple[Answer, int]:
    def field() -> str:
        return draw(WHITESPACE) + draw(WORDS) + draw(WHITESPACE)

    history = draw(st.sampled_from([0, 2]))
    first = history if not draw(st.booleans()) else 0  # a second turn may restart at 0
    n_calls = draw(st.integers(0, 2))
    cities = st.sampled_from(["Rome", " Rome ", "Oslo", "", "2024"])

    def arguments() -> tuple[str, str]:
        if draw(st.booleans()):
            return "get_weather", json.dumps({"city": draw(cities)})
        values = {"seconds": draw(TIMER_VALUES), "label": draw(LABEL_VALUES)}
        layout = draw(st.sampled_from([(", ", ": "), (",", ":")]))
        return "set_timer", json.dumps(values, separators=layout)

    calls = []
    for n in range(n_calls):
        name, written = arguments()
        calls.append((name, draw(WHITESPACE) + written + draw(WHITESPACE), first + n))
    return Answer(field(), field(), tuple(calls)), history


def _history(calls: int) -> list[dict[str, Any]]:
    return tool_history(calls, "Weather?")


@pytest.mark.kimi
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(drawn=answers())
def test_the_truth_is_in_every_closed_set_of_every_stack(
    kimi: Model, drawn: tuple[Answer, int]
) -> None:
    answer, history = drawn
    truth = kimi.encode(pieces(answer))
    messages = _history(history)
    for stack, serve in STACKS.items():
        message = serve(answer, history, TOOLS)
        response = {
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if answer.calls else "stop",
                }
            ],
            "usage": {"completion_tokens": len(truth)},
        }
        for profile in (UNKNOWN_PROFILE, declared(stack)):
            record = RecordBuilder(kimi, profile).build(messages, TOOLS, response)
            where = (stack, profile.name, answer, record["issues"])
            if record["ok"]:
                assert record["output_ids"] == truth, where
            candidates = record.get("candidates")
            if candidates and candidates["closed"]:
                assert tuple(truth) in sequences_of(candidates["options"]), where
                assert candidates["proven_against"]["profile"] == profile.name
            if "single_candidate" in record["issues"]:
                stacks = record["proven_against"]["stacks"]
                assert stacks["marker_spacing"] == (
                    ["none", "spaces", "leading"]
                    if profile.marker_spacing == "unknown"
                    else [profile.marker_spacing]
                )
