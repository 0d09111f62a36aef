"""Coercion readings (core/coercion.py) against what vLLM 0.33's real parser returned
(tests/fixtures/server_shapes: the model's own arguments beside the server's answer) and
against the recorded answers in the wild."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kimi_pipe.core.coercion import coerce_text, coercion_readings, schema_types

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ARGUMENTS = re.compile(r"<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S)


def _properties(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool["function"].get("parameters", {}).get("properties", {})
    return {}


def _pairs(path: Path) -> list[tuple[str, str, dict[str, Any]]]:
    """(arguments the model wrote, arguments the server returned, the tool's properties)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        written = ARGUMENTS.findall(record.get("decoded_text") or "")
        response = record.get("response")
        if not isinstance(response, dict) or "choices" not in response:
            continue
        calls = response["choices"][0]["message"].get("tool_calls") or []
        for model_text, call in zip(written, calls, strict=False):
            name = call["function"]["name"]
            out.append(
                (model_text, call["function"]["arguments"], _properties(record["tools"], name))
            )
    return out


def test_every_value_vllm_coerced_is_read_back() -> None:
    coerced = 0
    for path in sorted((FIXTURES / "server_shapes").glob("vllm-0.33.0-*.jsonl")):
        for written, returned, properties in _pairs(path):
            readings = coercion_readings(returned, properties)
            if written.strip() != returned:
                # The server changed the text beyond its edges: the model's text is a reading.
                assert readings is not None, (path.name, written, returned)
                assert written.strip() in readings.texts, (path.name, written, readings)
                assert readings.texts[0] == returned
                coerced += 1
    assert coerced >= 20, coerced


def test_arguments_no_coercion_can_have_written_are_not_read_anew() -> None:
    integer = {"a": {"type": "integer"}, "b": {"type": "integer"}}
    # Not json.dumps's layout: a coercing stack writes the whole object again when it changes
    # anything, so compact arguments are the model's own.
    assert coercion_readings('{"a":2,"b":3}', integer) is None
    assert coercion_readings('{"city": "Paris"}', {"city": {"type": "string"}}) is None
    assert coercion_readings('{"a": "x"}', integer) is None  # no int() of "x"
    # Undeclared keys are skipped by the stack.
    assert coercion_readings('{"n": "12"}', {"other": {"type": "string"}}) is None


def test_readings_of_typed_values_and_numbers_text() -> None:
    integer = {"a": {"type": "integer"}, "b": {"type": "integer"}}
    readings = coercion_readings('{"a": 2, "b": 3}', integer)
    assert readings is not None and readings.complete
    assert readings.texts[0] == '{"a": 2, "b": 3}'
    assert {'{"a": "2", "b": 3}', '{"a":"2","b":"3"}', '{"a": 2, "b": "3"}'} <= set(readings.texts)
    as_text = coercion_readings('{"expr": "12345"}', {"expr": {"type": "string"}})
    assert as_text is not None and as_text.complete
    assert as_text.texts == ('{"expr": "12345"}', '{"expr": 12345}', '{"expr":12345}')
    # A number or boolean had other spellings ("2.50", "True"): listed, never complete.
    number = coercion_readings('{"x": 2.5}', {"x": {"type": "number"}})
    assert number is not None and not number.complete
    assert not coercion_readings('{"on": true}', {"on": {"type": "boolean"}}).complete  # type: ignore[union-attr]
    # A nested value the schema types is not listed: incomplete.
    nested = {
        "o": {"type": "object", "properties": {"n": {"type": "integer"}}},
        "a": {"type": "integer"},
    }
    deep = coercion_readings('{"o": {"n": 1}, "a": 2}', nested)
    assert deep is not None and not deep.complete


@pytest.mark.parametrize(
    ("text", "types", "value"),
    [
        ("30", {"integer"}, 30),
        ("2.0", {"number"}, 2),
        ("2.5", {"number"}, 2.5),
        ("1", {"boolean"}, True),
        ("null", {"null", "string"}, None),
        ("5", {"string"}, "5"),
        ("5", {"string", "integer"}, 5),
        ("x", {"integer"}, "x"),
    ],
)
def test_coerce_text_follows_vllms_order(text: str, types: set[str], value: Any) -> None:
    assert coerce_text(text, types) == value and type(coerce_text(text, types)) is type(value)


def test_schema_types_read_like_the_stack() -> None:
    assert schema_types(None) == {"string"}
    assert schema_types({}) == {"string"}
    assert schema_types({"type": "int"}) == {"integer"}
    assert schema_types({"enum": [1, "a", None]}) == {"integer", "string", "null"}
    assert schema_types({"anyOf": [{"type": "integer"}, {"type": "null"}]}) == {"integer", "null"}
