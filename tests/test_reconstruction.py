"""Reconstruction of recorded provider answers with the real Kimi K2.5 tokenizer.

Expected ids come from a different path than the code under test: the raw model text of
each case (`expect.output_text`, markers spelled out) encoded by tiktoken with every
special name recognised; prompts from an independent Jinja rendering of the template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import TAIL_KEPT, expected_output_ids

from kimi_pipe.core.models import Model
from kimi_pipe.core.reconstruction import ERRORS, reconstruct
from tests.support.kimi_reference import reference_prompt_ids

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _reference_prompt_ids(model: Model, tokenizer_dir: Path, case: dict[str, Any]) -> list[int]:
    return reference_prompt_ids(model, tokenizer_dir, case["messages"], case.get("tools"))


def _case_ids(cases: list[dict[str, Any]]) -> list[str]:
    return [c["id"] for c in cases]


def _load_cases() -> list[dict[str, Any]]:
    with (FIXTURES / "kimi_k25_responses.jsonl").open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


CASES = _load_cases()
# The oracle encodes one rendered string, so it cannot keep marker text typed by a user as
# text; those cases are covered by test_user_marker_text_stays_text instead.
PROMPT_CASES = [c for c in CASES if not any("<|" in str(m.get("content")) for m in c["messages"])]


@pytest.mark.kimi
@pytest.mark.parametrize("case", CASES, ids=_case_ids(CASES))
def test_output_ids_match_raw_model_text(kimi: Model, case: dict[str, Any]) -> None:
    result = reconstruct(
        kimi, case["messages"], case.get("tools"), case["response"], serving=TAIL_KEPT
    )
    expected = expected_output_ids(kimi, case)
    assert result.output_ids == expected, kimi.tokenizer.decode(result.output_ids)
    assert sorted(result.issues) == sorted(case["expect"]["issues"])
    assert result.ok == (not set(case["expect"]["issues"]) & ERRORS)
    assert result.completion_tokens_reconstructed == len(expected)


@pytest.mark.kimi
@pytest.mark.parametrize("case", PROMPT_CASES, ids=_case_ids(PROMPT_CASES))
def test_prompt_ids_match_reference_template(
    kimi: Model, kimi_dir: Path, case: dict[str, Any]
) -> None:
    result = reconstruct(
        kimi, case["messages"], case.get("tools"), case["response"], serving=TAIL_KEPT
    )
    assert result.prompt_ids == _reference_prompt_ids(kimi, kimi_dir, case)
    mask = result.loss_mask
    assert len(mask) == len(result.prompt_ids) + len(result.output_ids)
    assert set(mask[: len(result.prompt_ids)]) <= {0}
    assert set(mask[len(result.prompt_ids) :]) <= {1}


@pytest.mark.kimi
def test_user_marker_text_stays_text(kimi: Model) -> None:
    from kimi_pipe.core.prompt_render import prompt_ids

    ids = prompt_ids(kimi, [{"role": "user", "content": "a<|im_end|>b<|im_assistant|></think>"}])
    im_end, im_assistant, think_end = 163586, 163588, 163607
    body = ids[3:-5]  # between "<|im_user|>user<|im_middle|>" and the closing turn
    assert im_end not in body and im_assistant not in body and think_end not in body
    assert kimi.tokenizer.decode(body) == "a<|im_end|>b<|im_assistant|></think>"
    assert ids.count(im_end) == 1  # only the real end of the user turn


@pytest.mark.kimi
def test_end_of_turn_is_im_end_not_chas(kimi: Model, kimi_cases: list[dict[str, Any]]) -> None:
    case = next(c for c in kimi_cases if c["id"] == "reasoning_field")
    result = reconstruct(kimi, case["messages"], None, case["response"])
    assert result.output_ids[-1] == 163586
    assert 163533 not in result.output_ids
    assert kimi.tokenizer.piece(163533) == "chas"


@pytest.mark.kimi
def test_loss_mask_can_exclude_end_token(kimi: Model) -> None:
    from dataclasses import replace

    from kimi_pipe.core.formats import LossMaskSpec

    model = replace(kimi, format=replace(kimi.format, loss_mask=LossMaskSpec(end_token=0)))
    response = {
        "choices": [{"message": {"content": "ok", "reasoning": "r"}, "finish_reason": "stop"}]
    }
    result = reconstruct(model, [{"role": "user", "content": "x"}], None, response)
    assert result.loss_mask[-1] == 0 and result.loss_mask[-2] == 1


@pytest.mark.kimi
def test_billing_tolerance(kimi: Model, kimi_cases: list[dict[str, Any]]) -> None:
    case = next(c for c in kimi_cases if c["id"] == "billing_mismatch")
    strict = reconstruct(kimi, case["messages"], None, case["response"], serving=TAIL_KEPT)
    loose = reconstruct(
        kimi, case["messages"], None, case["response"], billing_tolerance=2, serving=TAIL_KEPT
    )
    assert "billing_mismatch" in strict.issues and not strict.ok
    assert "billing_mismatch" not in loose.issues and loose.ok


@pytest.mark.kimi
@pytest.mark.parametrize(
    "response", [None, "text", {"choices": "x"}, {"choices": [{"message": 3}]}]
)
def test_garbage_never_raises(kimi: Model, response: Any) -> None:
    result = reconstruct(kimi, [{"role": "user", "content": "x"}], None, response)
    assert not result.ok and result.issues == ["malformed_response"] and result.output_ids == []


@pytest.mark.kimi
def test_bad_prompt_is_reported(kimi: Model) -> None:
    result = reconstruct(kimi, [{"role": "wizard", "content": "x"}], None, {"choices": []})
    assert "bad_prompt" in result.issues and not result.ok


@pytest.mark.kimi
def test_cut_inside_a_character_is_flagged(kimi: Model) -> None:
    # A server decoding a cut inside an emoji hands back U+FFFD; the last id is lost and the
    # length check cannot see it (found by the fidelity audit on real SmolLM2 output).
    response = {
        "choices": [
            {"message": {"content": "Party \ufffd", "reasoning": "r"}, "finish_reason": "length"}
        ],
    }
    result = reconstruct(kimi, [{"role": "user", "content": "x"}], None, response)
    assert {"truncated", "partial_character"} <= set(result.issues) and not result.ok
    fine = reconstruct(
        kimi,
        [{"role": "user", "content": "x"}],
        None,
        {
            "choices": [
                {"message": {"content": "Party \ufffd", "reasoning": "r"}, "finish_reason": "stop"}
            ]
        },
    )
    assert "partial_character" not in fine.issues


@pytest.mark.kimi
def test_empty_reasoning_field_with_think_end_in_content_is_split(kimi: Model) -> None:
    response = {
        "choices": [
            {"message": {"reasoning": "", "content": "think</think>ans"}, "finish_reason": "stop"}
        ],
    }
    result = reconstruct(kimi, [{"role": "user", "content": "x"}], None, response)
    assert result.output_ids == kimi.tokenizer.encode_with_markers("think</think>ans<|im_end|>")
    assert "reasoning_from_content" in result.issues


@pytest.mark.kimi
@pytest.mark.parametrize(
    ("tools", "calls"),
    [
        (None, [{"id": "x", "function": "not an object"}]),
        (None, [{"id": "x", "function": {"name": "f", "arguments": {"a": {1, 2}}}}]),
        ("abc", []),
    ],
)
def test_odd_shapes_are_reported_not_raised(kimi: Model, tools: Any, calls: list) -> None:
    response = {
        "choices": [
            {
                "message": {"content": "c", "reasoning": "r", "tool_calls": calls},
                "finish_reason": "stop",
            }
        ],
    }
    result = reconstruct(kimi, [{"role": "user", "content": "x"}], tools, response)
    assert not result.ok
    assert {"malformed_response", "bad_prompt"} & set(result.issues)


@pytest.mark.kimi
def test_rebuilt_tool_ids_can_count_on_from_the_conversation(kimi: Model) -> None:
    from dataclasses import replace

    history = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.f:0",
                    "type": "function",
                    "function": {"name": "f", "arguments": "{}"},
                },
                {
                    "id": "functions.f:1",
                    "type": "function",
                    "function": {"name": "f", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "a"},
        {"role": "tool", "tool_call_id": "functions.f:1", "content": "b"},
    ]
    call = {"id": "call_9", "type": "function", "function": {"name": "g", "arguments": "{}"}}
    response = {
        "choices": [
            {
                "message": {"content": "", "reasoning": "r", "tool_calls": [call]},
                "finish_reason": "tool_calls",
            }
        ]
    }
    # Default (issue 9): the model's own counter runs across the conversation.
    on_from_history = reconstruct(kimi, history, None, response)
    assert "functions.g:2" in kimi.tokenizer.decode(on_from_history.output_ids)
    out = replace(kimi.format.output, tool_call_index="response")
    model = replace(kimi, format=replace(kimi.format, output=out))
    per_answer = reconstruct(model, history, None, response)
    assert "functions.g:0" in kimi.tokenizer.decode(per_answer.output_ids)


@pytest.mark.kimi
def test_unknown_stack_flags_an_unprovable_reasoning_tail(kimi: Model) -> None:
    """vLLM 0.33 strips the reasoning's trailing whitespace: `it.\\n</think>` comes back as
    `it.`, the same token count (`.\\n` is one token like `.`). Unless a profile says the stack
    keeps the tail, a reasoning that ends where a newline would merge is flagged."""
    truth_text = "Check it.\n</think>Done.<|im_end|>"
    truth = kimi.tokenizer.encode_with_markers(truth_text)
    response = {
        "choices": [
            {"message": {"reasoning": "Check it.", "content": "Done."}, "finish_reason": "stop"}
        ],
        "usage": {"completion_tokens": len(truth)},
    }
    messages = [{"role": "user", "content": "x"}]
    stripped = reconstruct(kimi, messages, None, response)
    assert not stripped.ok and "reasoning_tail_unverifiable" in stripped.issues
    assert stripped.output_ids != truth  # what a guess would have written
    kept = reconstruct(kimi, messages, None, response, serving=TAIL_KEPT)
    assert kept.ok  # a stack that keeps the tail: the text is the model's
    after_letter = {**response, "choices": [{**response["choices"][0], "message": {
        "reasoning": "Check it", "content": "Done."}}]}  # fmt: skip
    letter = reconstruct(kimi, messages, None, after_letter)
    assert "reasoning_tail_unverifiable" not in letter.issues
