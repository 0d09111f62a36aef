"""Property tests: ground-truth ids -> every provider rendering -> the same ids back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import load_or_skip
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_pipe.core.reconstruction import reconstruct

ALPHABET = st.sampled_from(
    list("abcxyz ABC019 \n\t.,:;!?'\"{}[]()<>|/\\-_=+*#`~")
    + ["é", "ß", "中", "文", "日本", "한", "😀", "🇫🇷", "\u200b", "  ", "\n\n"]
)
TEXT = st.lists(ALPHABET, max_size=40).map("".join)
NAMES = st.sampled_from(["get_weather", "search", "run_code", "read_file"])
ARGS = st.dictionaries(st.sampled_from(["city", "q", "n", "path"]), st.one_of(TEXT, st.integers()))


@st.composite
def answers(draw: Any) -> dict[str, Any]:
    calls = draw(st.lists(st.tuples(NAMES, ARGS), max_size=3))
    return {"reasoning": draw(TEXT), "content": draw(TEXT), "calls": calls}


def _ground_truth(model: Any, answer: dict[str, Any]) -> list[int]:
    """Canonical ids of each text piece, real marker ids between them."""
    enc, mk = model.tokenizer.encode_ordinary, model.markers
    ids = enc(answer["reasoning"]) + [mk["</think>"]] + enc(answer["content"])
    if answer["calls"]:
        ids.append(mk["<|tool_calls_section_begin|>"])
        for index, (name, args) in enumerate(answer["calls"]):
            ids += [mk["<|tool_call_begin|>"], *enc(f"functions.{name}:{index}")]
            ids += [mk["<|tool_call_argument_begin|>"], *enc(json.dumps(args, ensure_ascii=False))]
            ids.append(mk["<|tool_call_end|>"])
        ids.append(mk["<|tool_calls_section_end|>"])
    return ids + [mk["<|im_end|>"]]


def _variants(answer: dict[str, Any], split_at: int) -> dict[str, dict[str, Any]]:
    r, c = answer["reasoning"], answer["content"]
    calls = [
        {
            "id": f"call_{i}x",
            "type": "function",
            "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)},
        }
        for i, (n, a) in enumerate(answer["calls"])
    ]
    native = [
        dict(call, id=f"functions.{call['function']['name']}:{i}") for i, call in enumerate(calls)
    ]
    tc = {"tool_calls": calls} if calls else {}
    tn = {"tool_calls": native} if calls else {}
    k = min(split_at, len(r))
    return {
        "reasoning": {"content": c, "reasoning": r, **tn},
        "reasoning_content": {"content": c, "reasoning_content": r, **tc},
        "reasoning_details": {
            "content": c or None,
            "reasoning_details": [
                {"type": "reasoning.text", "text": r[:k]},
                {"type": "reasoning.text", "text": r[k:]},
            ],
            **tc,
        },
        "think_in_content": {"content": f"{r}</think>{c}", **tn},
        "litellm": {
            "content": c,
            "reasoning_content": r,
            "provider_specific_fields": {"reasoning": r},
            **tc,
        },
    }


@pytest.mark.kimi
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answer=answers(), split_at=st.integers(min_value=0, max_value=40))
def test_every_provider_rendering_reconstructs_ground_truth(answer: dict, split_at: int) -> None:
    model = load_or_skip("kimi_k25")
    truth = _ground_truth(model, answer)
    for name, message in _variants(answer, split_at).items():
        response = {
            "choices": [
                {"message": message, "finish_reason": "tool_calls" if answer["calls"] else "stop"}
            ],
            "usage": {"completion_tokens": len(truth)},
        }
        result = reconstruct(model, [{"role": "user", "content": "q"}], None, response)
        assert result.output_ids == truth, name
        assert "billing_mismatch" not in result.issues, name
