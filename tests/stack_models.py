"""What four real serving stacks do to Kimi K2.5's output text, as pure functions (issue 30).

Written from the stacks' own code and checked against the answers that code returned on
ground-truth ids (tests/fixtures/server_shapes, tools/make_server_fixtures.py;
test_stack_models_reproduce_the_real_servers): each model takes the model's own output in
fields (reasoning, content, calls as (name, arguments, index) in the order written) and
returns the chat-completion message that stack sends.

  sglang_0_5_23   reasoning and content as decoded; the tool parser's `\\s*{args}\\s*` strips
                  the arguments' edges; ids rebuilt as functions.{name}:{history + position}
  vllm_0_33       the reasoning's trailing whitespace stripped, a whitespace-only content
                  before calls dropped; arguments' edges stripped, and values coerced to the
                  request's schema (a whole number written as a string for an integer
                  property, a number, boolean or null for a string one), the whole object
                  then written again by json.dumps (its parser engine's `_fix_arg_types`);
                  the model's ids
  vllm_0_15       spaces_between_special_tokens: one space each side of every kept marker;
                  arguments stripped; ids replaced (chatcmpl-tool-...), dotted names cut
  vllm_0_15_stream  the same stack streaming: only the space after each marker arrives; the
                  model's ids with that space; only the arguments' leading whitespace dropped

Each maps to the serving profile it is declared as (`DECLARED`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Call = tuple[str, str, int]  # (name, arguments as written, the model's index)


@dataclass(frozen=True)
class Answer:
    reasoning: str
    content: str
    calls: tuple[Call, ...]


def _message(reasoning: str | None, content: str | None, calls: list[dict[str, Any]]) -> Any:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def sglang_0_5_23(answer: Answer, history: int, tools: Sequence[dict[str, Any]] = ()) -> Any:
    calls = [
        _call(f"functions.{name}:{history + n}", name, args.strip())
        for n, (name, args, _) in enumerate(answer.calls)
    ]
    return _message(answer.reasoning, answer.content or None, calls)


def _schema_coerced(name: str, arguments: str, tools: Sequence[dict[str, Any]]) -> str:
    """vLLM 0.33's schema coercion, for the schema shapes these tests declare (flat
    properties typed integer or string)."""
    properties: dict[str, Any] = {}
    for tool in tools:
        if tool["function"]["name"] == name:
            properties = tool["function"].get("parameters", {}).get("properties", {})
    try:
        values = json.loads(arguments)
    except ValueError:
        return arguments
    if not isinstance(values, dict):
        return arguments
    changed = False
    for key, value in values.items():
        kind = (properties.get(key) or {}).get("type")
        if kind == "integer" and isinstance(value, str) and value.isdigit():
            values[key], changed = int(value), True
        elif kind == "string" and (value is None or isinstance(value, bool | int | float)):
            values[key], changed = json.dumps(value), True
    return json.dumps(values, ensure_ascii=False) if changed else arguments


def vllm_0_33(answer: Answer, history: int, tools: Sequence[dict[str, Any]] = ()) -> Any:
    calls = [
        _call(f"functions.{name}:{index}", name, _schema_coerced(name, args.strip(), tools))
        for name, args, index in answer.calls
    ]
    content: str | None = answer.content
    if calls and not answer.content.strip():
        content = None
    return _message(answer.reasoning.rstrip() or None, content, calls)


def vllm_0_15(answer: Answer, history: int, tools: Sequence[dict[str, Any]] = ()) -> Any:
    calls = [
        _call(f"chatcmpl-tool-{n:016x}", name.rsplit(".", 1)[-1], args.strip())
        for n, (name, args, _) in enumerate(answer.calls)
    ]
    # The join puts one space between the pieces either side of a marker: an empty content
    # between two markers is one space; an empty content at the end is nothing.
    if calls:
        content: str | None = " " + answer.content + " " if answer.content else " "
    else:
        content = " " + answer.content if answer.content else None
    return _message(" " + answer.reasoning + " " if answer.reasoning else " ", content, calls)


def vllm_0_15_stream(answer: Answer, history: int, tools: Sequence[dict[str, Any]] = ()) -> Any:
    # The streaming tool parser drops the arguments' leading whitespace; what it does with
    # trailing whitespace depends on how the deltas fall (the real corpus covers it), so the
    # model keeps it and the check against the servers leaves such answers out.
    calls = [
        _call(f" functions.{name}:{index}", name.rsplit(".", 1)[-1], args.lstrip())
        for name, args, index in answer.calls
    ]
    content = " " + answer.content if answer.content else None
    return _message(" " + answer.reasoning if answer.reasoning else None, content, calls)


STACKS: dict[str, Callable[[Answer, int, Sequence[dict[str, Any]]], Any]] = {
    "sglang_0_5_23": sglang_0_5_23,
    "vllm_0_33": vllm_0_33,
    "vllm_0_15": vllm_0_15,
    "vllm_0_15_stream": vllm_0_15_stream,
}
# The shipped profile each stack is declared as, with a deployment's overrides.
DECLARED: dict[str, tuple[str, dict[str, str]]] = {
    "sglang_0_5_23": ("sglang_0_5_23", {}),
    "vllm_0_33": ("vllm_0_33", {"marker_spacing": "none"}),
    "vllm_0_15": ("vllm_0_15", {}),
    "vllm_0_15_stream": (
        "vllm_0_15",
        {"marker_spacing": "leading", "tool_call_ids": "model"},
    ),
}
# The fixture variant whose real answers each model reproduces.
VARIANT: dict[str, str] = {
    "sglang_0_5_23": "sglang-0.5.23-nospaces",
    "vllm_0_33": "vllm-0.33.0-nospaces",
    "vllm_0_15": "vllm-0.15.1-spaces",
    "vllm_0_15_stream": "vllm-0.15.1-spaces-stream",
}
