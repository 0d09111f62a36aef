"""`argument_edge_readings` counts each whitespace reading on a few characters at the edge
of an argument instead of the whole argument (a cut at a lone space between non-whitespace
splits every GPT-style pre-tokenizer the same way). Checked against the plain definition,
every reading counted on the whole argument, with hypothesis and three real tokenizers
(Kimi's tiktoken, Qwen's and SmolLM2's byte-level BPE)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_pipe.core import reconstruction
from kimi_pipe.core.models import Model
from tests.support.cases import load_or_skip


def whole_argument_readings(model: Model, arguments: str) -> list[tuple[str, str]]:
    """The definition: every (lead, trail) whose whole text has the argument's count."""
    count = model.tokenizer.encode_ordinary
    base = len(count(arguments))
    leads = [""] + (
        []
        if arguments[0].isspace()
        else [w for w in reconstruction._EDGE_LEADS if len(count(w + arguments)) == base]
    )
    trails = [""] + (
        []
        if arguments[-1].isspace()
        else [w for w in reconstruction._EDGE_TRAILS if len(count(arguments + w)) == base]
    )
    return [
        (lead, trail)
        for lead in leads
        for trail in trails
        if (lead, trail) == ("", "") or len(count(lead + arguments + trail)) == base
    ]


def call(arguments: str) -> dict[str, Any]:
    return {"id": "functions.f:0", "function": {"name": "f", "arguments": arguments}}


@pytest.fixture(scope="module", params=["kimi_k25", "qwen3_5", "smollm2"])
def model(request: pytest.FixtureRequest) -> Model:
    return load_or_skip(request.param)


# Text that stresses the pre-tokenizer at the edges: letters, digits, punctuation, CJK,
# every kind of whitespace, and JSON around it.
EDGE_TEXT = st.lists(
    st.sampled_from(
        list("ab Z9'\".,:;{}[]()!?-_\\/") + ["\n", "\r\n", "\t", "  ", "\u3000", "中", "é", "'s"]
    ),
    min_size=1,
    max_size=40,
).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=EDGE_TEXT, as_json=st.booleans())
def test_edge_readings_equal_the_whole_argument_count(
    model: Model, text: str, as_json: bool
) -> None:
    arguments = json.dumps({"code": text, "n": 3}) if as_json else text
    if not arguments.strip():
        return
    readings = reconstruction.argument_edge_readings(model, call(arguments))
    assert readings == whole_argument_readings(model, arguments)
    # The flag's short cut asks the same question without listing the pairs.
    assert reconstruction._edges_ambiguous(model, call(arguments)) == (len(readings) > 1)


def test_edge_readings_on_real_looking_arguments(model: Model) -> None:
    """Long arguments with code, where the fast path cuts: the same readings, and whitespace
    readings are found at both edges (a newline after the closing brace costs no id)."""
    code = "def f(x):\n    return x + 1  # done.\n\nprint(f(2))"
    for arguments in (
        json.dumps({"code": code, "path": "/tmp/a b.py"}),
        json.dumps({"query": "weather in Paris, France", "units": "metric"}, indent=2),
        "plain text argument with words. And a stop.",
    ):
        got = reconstruction.argument_edge_readings(model, call(arguments))
        assert got == whole_argument_readings(model, arguments)
        assert reconstruction._edge_windows(model, arguments)


def test_kept_whole_argument_readings_are_a_bounded_copy(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An argument with no two safe cuts is counted whole once and kept: each call gets its
    own list (a caller's change does not reach the next), and the kept ones stay bounded."""
    arguments = '{"a":"b\\n"}'  # no lone space: no windows
    assert reconstruction._edge_windows(model, arguments) is None
    first = reconstruction.argument_edge_readings(model, call(arguments))
    first.append(("x", "y"))
    assert reconstruction.argument_edge_readings(model, call(arguments)) == (
        whole_argument_readings(model, arguments)
    )
    # The tokenizer is shared by every test in this process: start from its own empty store,
    # so an argument another test kept cannot skip the bound's clear.
    monkeypatch.setitem(reconstruction._WHOLE_READINGS, model.tokenizer, {})
    monkeypatch.setattr(reconstruction, "_WHOLE_READINGS_KEPT", 3)
    for n in range(10):
        reconstruction.argument_edge_readings(model, call(f'{{"n":{n}}}'))
        assert len(reconstruction._WHOLE_READINGS[model.tokenizer]) <= 3
