"""Prompt ids equal the official Kimi K2.5 rendering encoded as the reference tokenizer does
(#9 item 5): long texts cut before BPE, the history reasoning field the official template
reads, null values as the template prints them. The oracle is tests/support/kimi_reference.py (a
Jinja template rendered to one string, split at added tokens, cut character by character)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kimi_pipe.core.models import Model
from kimi_pipe.core.prompt_render import PromptError, prompt_ids
from kimi_pipe.core.reconstruction import reconstruct
from kimi_pipe.core.tokenizers import TextChunking, split_for_bpe
from tests.support.kimi_reference import cut_runs, reference_pieces, reference_prompt_ids

# Characters on both sides of str.isspace, including the less obvious ones (U+001C is
# whitespace to Python, U+00A0 and U+3000 too).
ALPHABET = [" ", "\n", "\t", "\x1c", "\u00a0", "\u3000", "a", "Z", "7", "é", "中", "😀", "."]


def test_cuts_match_a_character_by_character_reference() -> None:
    rng = random.Random(9)
    for _ in range(3000):
        max_chars, max_run = rng.randint(1, 40), rng.randint(1, 8)
        text = "".join(
            rng.choice(ALPHABET[:6]) * rng.randint(1, 12)
            if rng.random() < 0.5
            else rng.choice(ALPHABET[6:]) * rng.randint(1, 12)
            for _ in range(rng.randint(0, 12))
        )
        ours = split_for_bpe(text, TextChunking(max_chars=max_chars, max_run=max_run))
        assert ours == reference_pieces(text, max_chars, max_run), (text, max_chars, max_run)
        assert "".join(ours) == text


def test_reference_cutter_cuts_where_the_reference_does() -> None:
    # The oracle itself, on hand-checked cases: a run is cut before its 4th character.
    assert list(cut_runs("abcdefg", 3)) == ["abc", "def", "g"]
    assert list(cut_runs("ab    cd", 3)) == ["ab   ", " cd"]
    assert reference_pieces("abcdefgh  ij", 5, 3) == ["abc", "de", "fgh  ", "ij"]


def test_no_chunking_declared_means_one_piece() -> None:
    assert split_for_bpe("a" * 30, None) == ["a" * 30]
    assert split_for_bpe("", TextChunking(max_chars=5, max_run=2)) == []


@pytest.mark.kimi
def test_long_space_run_gives_the_official_count(kimi: Model, kimi_dir: Path) -> None:
    messages = [{"role": "user", "content": "x" + " " * 25002 + "y"}]
    ids = prompt_ids(kimi, messages)
    assert len(ids) == 110  # the official tokenizer; one whole-string encode gives 109
    assert ids == reference_prompt_ids(kimi, kimi_dir, messages)
    whole = replace(kimi, chunking=None)
    assert len(prompt_ids(whole, messages)) == 109


LONG = [
    pytest.param([{"role": "user", "content": "xyz" * 20_001}], None, True, id="non_space_run"),
    pytest.param([{"role": "user", "content": "7" * 60_001}], None, True, id="digit_run"),
    pytest.param(
        [{"role": "user", "content": "The quick brown fox jumps. " * 16_000}],
        None,
        True,
        id="over_400k_characters",
    ),
    pytest.param(
        [
            {"role": "system", "content": "s" * 20_000},
            {"role": "user", "content": "u" * 20_000},
        ],
        None,
        False,  # 40,000 non-space characters in a row, but a marker sits between them
        id="runs_restart_after_markers",
    ),
    pytest.param(
        [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "\n" * 30_000 + "think",
                "tool_calls": [
                    {
                        "id": "functions.f:0",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"q": "' + "q" * 26_000 + '"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "functions.f:0", "content": "\t " * 13_000 + "x"},
        ],
        [{"type": "function", "function": {"name": "f", "description": "d" * 25_500}}],
        True,
        id="history_tool_result_and_declaration",
    ),
]


@pytest.mark.kimi
@pytest.mark.parametrize(("messages", "tools", "cut_changes_ids"), LONG)
def test_long_texts_match_reference(
    kimi: Model, kimi_dir: Path, messages: list[dict[str, Any]], tools: Any, cut_changes_ids: bool
) -> None:
    ours = prompt_ids(kimi, messages, tools)
    assert ours == reference_prompt_ids(kimi, kimi_dir, messages, tools)
    # Where a cut falls inside what one whole encode makes a single token, ids differ.
    whole = prompt_ids(replace(kimi, chunking=None), messages, tools)
    assert (ours != whole) == cut_changes_ids


def _turns(assistant: dict[str, Any]) -> list[dict[str, Any]]:
    # The assistant turn calls a tool, so it keeps its reasoning in the prompt.
    return [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
            **assistant,
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "rain"},
    ]


@pytest.mark.kimi
@pytest.mark.parametrize(
    ("fields", "shown"),
    [
        ({"reasoning": "only the OpenRouter spelling"}, "<think></think>"),
        ({"reasoning_content": None}, "<think>None</think>"),
        ({"reasoning_content": None, "reasoning": "r"}, "<think>None</think>"),
        ({"reasoning_content": "rc", "reasoning": "r"}, "<think>rc</think>"),
    ],
)
def test_history_reasoning_reads_what_the_official_template_reads(
    kimi: Model, kimi_dir: Path, fields: dict[str, Any], shown: str
) -> None:
    messages = _turns(fields)
    ids = prompt_ids(kimi, messages)
    assert ids == reference_prompt_ids(kimi, kimi_dir, messages)
    assert shown in kimi.tokenizer.decode(ids)


@pytest.mark.kimi
def test_history_reasoning_fields_are_configurable(kimi: Model) -> None:
    both = ("reasoning_content", "reasoning")
    prompt = replace(kimi.format.prompt, history_reasoning_fields=both)
    model = replace(kimi, format=replace(kimi.format, prompt=prompt))
    text = model.tokenizer.decode(prompt_ids(model, _turns({"reasoning": "r"})))
    assert "<think>r</think>" in text


@pytest.mark.kimi
def test_history_reasoning_that_is_not_text_is_flagged(kimi: Model) -> None:
    with pytest.raises(PromptError, match="reasoning_content"):
        prompt_ids(kimi, _turns({"reasoning_content": ["a"]}))
    response = {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]}
    result = reconstruct(kimi, _turns({"reasoning_content": 5}), None, response)
    assert not result.ok and "bad_prompt" in result.issues


@pytest.mark.kimi
def test_null_tool_arguments_render_as_the_template_does(kimi: Model, kimi_dir: Path) -> None:
    messages = _turns({"reasoning_content": "r"})
    messages[1]["tool_calls"][0]["function"]["arguments"] = None
    ids = prompt_ids(kimi, messages)
    assert ids == reference_prompt_ids(kimi, kimi_dir, messages)
    assert "<|tool_call_argument_begin|>null<|tool_call_end|>" in kimi.tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("chunking", "message"),
    [
        ({"max_chars": 0, "max_run": 5}, ">= 1"),
        ({"max_chars": 10}, "needs integer max_chars and max_run"),
        ({"max_chars": "many", "max_run": 5}, "needs integer max_chars and max_run"),
        ({"max_chars": 10, "max_run": 5, "step": 1}, "unknown model.tokenizer.chunking keys"),
    ],
)
def test_bad_chunking_config_is_refused_clearly(chunking: dict[str, Any], message: str) -> None:
    from kimi_pipe.core.tokenizers import TokenizerSpec

    with pytest.raises(ValueError, match=message):
        TokenizerSpec.from_config({"backend": "tiktoken", "chunking": chunking})
