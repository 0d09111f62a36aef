"""Kimi K2.5 instant mode (thinking off) as a mode of the model config (conf/model/
kimi_k25_instant.yaml): prompts id for id against the reference template with `thinking=false`,
answers without reasoning reconstructed exactly, requests sent with reasoning disabled, and a
generate run against the fake provider that yields exact records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kimi_pipe.config import compose
from kimi_pipe.core.models import Model, load_model
from kimi_pipe.core.prompt_render import prompt_ids
from kimi_pipe.core.reconstruction import reconstruct
from kimi_pipe.core.tokenizers import TokenizerNotFound
from kimi_pipe.providers.settings import ProviderSettings
from tests.support.cases import read_cases
from tests.support.conftest_generate import base_overrides, run_inprocess, write_prompts
from tests.support.fake_openrouter import Behaviour, FakeOpenRouter, KimiCounter
from tests.support.kimi_reference import reference_encode, reference_prompt_ids

THINK, THINK_END, IM_END = 163606, 163607, 163586
CASES = read_cases("kimi_k25_responses.jsonl")
# As the thinking-mode check (tests/test_reconstruction.py): the oracle encodes one string, so
# marker text typed by a user cannot stay text there.
PROMPT_CASES = [c for c in CASES if not any("<|" in str(m.get("content")) for m in c["messages"])]


@pytest.fixture(scope="module")
def instant(kimi_dir: Path) -> Model:
    cfg = compose(["model=kimi_k25_instant", f"model.tokenizer.path={kimi_dir}"]).model
    try:
        return load_model(cfg)
    except TokenizerNotFound as exc:  # kimi_dir already skips when the files are missing
        pytest.skip(str(exc))


def test_the_mode_is_data_over_the_thinking_config(kimi: Model, instant: Model) -> None:
    assert instant.markers == kimi.markers and instant.chunking == kimi.chunking
    assert instant.format.output.reasoning is None
    assert instant.format.prompt.keep_reasoning == "none"
    think = prompt_ids(kimi, [{"role": "user", "content": "Hi"}])
    fast = prompt_ids(instant, [{"role": "user", "content": "Hi"}])
    assert think[-1] == THINK and fast[-2:] == [THINK, THINK_END] and fast[:-1] == think


@pytest.mark.parametrize("case", PROMPT_CASES, ids=[c["id"] for c in PROMPT_CASES])
def test_prompt_ids_match_the_template_with_thinking_false(
    instant: Model, kimi_dir: Path, case: dict[str, Any]
) -> None:
    ours = prompt_ids(instant, case["messages"], case.get("tools"))
    assert ours == reference_prompt_ids(
        instant, kimi_dir, case["messages"], case.get("tools"), thinking=False
    )


def test_history_reasoning_is_never_rendered(instant: Model, kimi: Model, kimi_dir: Path) -> None:
    """Multi-turn with tools: thinking mode keeps the reasoning after the last final answer;
    with thinking=false every assistant turn is `<think></think>`."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {
                    "id": "functions.weather:0",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.weather:0", "content": "12 C, rain"},
    ]
    fast = prompt_ids(instant, messages)
    assert fast == reference_prompt_ids(instant, kimi_dir, messages, thinking=False)
    reasoning = instant.tokenizer.encode_ordinary("I should call the tool.")
    text = instant.tokenizer.decode(fast)
    assert "I should call the tool." not in text
    assert "I should call the tool." in kimi.tokenizer.decode(prompt_ids(kimi, messages))
    assert reasoning  # the text is not empty, so the check above means something


def answer(
    content: str, completion_tokens: int, calls: list | None = None, prompt_tokens: int = 0
) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {
        "choices": [{"message": message, "finish_reason": "tool_calls" if calls else "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
    }


def expected_ids(model: Model, kimi_dir: Path, raw: str) -> list[int]:
    """The raw model text encoded with every marker recognised (the oracle's encoder)."""
    return reference_encode(model, kimi_dir, raw)


def test_answers_without_reasoning_are_exact(instant: Model, kimi_dir: Path) -> None:
    messages = [{"role": "user", "content": "Say hi."}]
    raw = "Hi there!<|im_end|>"
    want = expected_ids(instant, kimi_dir, raw)
    n_prompt = len(prompt_ids(instant, messages))
    rec = reconstruct(instant, messages, None, answer("Hi there!", len(want), None, n_prompt))
    assert rec.ok and rec.output_ids == want and rec.issues == []
    call = {
        "id": "functions.calc:0",
        "type": "function",
        "function": {"name": "calc", "arguments": '{"expr": "2+2"}'},
    }
    raw = (
        "Let me compute.<|tool_calls_section_begin|><|tool_call_begin|>functions.calc:0"
        '<|tool_call_argument_begin|>{"expr": "2+2"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
    )
    want = expected_ids(instant, kimi_dir, raw)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    n_prompt = len(prompt_ids(instant, messages, tools))
    rec = reconstruct(
        instant, messages, tools, answer("Let me compute.", len(want), [call], n_prompt)
    )
    assert rec.ok and rec.output_ids == want, rec.issues
    assert THINK_END not in rec.output_ids


def test_a_provider_that_thinks_anyway_is_not_exact(instant: Model) -> None:
    """Reasoning sent back in instant mode: the model did think, so the ids are not the
    content alone; the bill (which counts the reasoning) shows it."""
    thought, content = "Hmm, let me think about it.", "Hi!"
    enc = instant.tokenizer.encode_ordinary
    billed = len(enc(thought)) + 1 + len(enc(content)) + 1
    response = answer(content, billed)
    response["choices"][0]["message"]["reasoning"] = thought
    rec = reconstruct(instant, [{"role": "user", "content": "Hi"}], None, response)
    assert not rec.ok and "billing_mismatch" in rec.issues


def test_requests_go_out_with_reasoning_disabled() -> None:
    for model, enabled in (("kimi_k25", True), ("kimi_k25_instant", False)):
        cfg = compose([f"model={model}", "provider=openrouter"])
        settings = ProviderSettings.from_config(cfg.provider)
        assert settings.extra_body["reasoning"]["enabled"] is enabled


def test_generate_in_instant_mode_yields_exact_records(
    tmp_path: Path, kimi: Model, instant: Model, kimi_dir: Path, api_key_env: str
) -> None:
    counter = KimiCounter(kimi, instant=instant)
    with FakeOpenRouter(Behaviour(counter=counter)) as srv:
        prompts = tmp_path / "p.jsonl"
        ids = write_prompts(prompts, 6, tools_every=3)
        out = tmp_path / "run"
        overrides = [
            o if o != "model=kimi_k25" else "model=kimi_k25_instant"
            for o in base_overrides(prompts, srv.url(), out, kimi_dir)
        ]
        status, summary = run_inprocess(overrides, out)
        seen = [r.body for r in srv.requests]
    assert status == 0, summary
    assert seen and all(b["reasoning"]["enabled"] is False for b in seen)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(ids)
    for rec in records:
        assert rec["ok"] and rec["evidence"] == "text_proven", rec["issues"]
        assert rec["completion_tokens_reconstructed"] == rec["completion_tokens_reported"]
        assert THINK_END not in rec["output_ids"] and rec["output_ids"][-1] == IM_END
        assert rec["prompt_ids"][-2:] == [THINK, THINK_END]
        want = prompt_ids(instant, rec["messages"], rec.get("tools"))
        assert rec["prompt_ids"] == want


def test_probes_tell_a_provider_that_ignores_the_switch(
    kimi: Model, instant: Model, kimi_dir: Path, tmp_path: Path, api_key_env: str
) -> None:
    from kimi_pipe.conformance.probe import CLEAN, SEEN, default_battery, load_battery
    from kimi_pipe.stages.probe import run_probes
    from tests.support.fake_stacks import routed_fake

    counter = KimiCounter(kimi, instant=instant)
    behaviours = {
        "honours": Behaviour(provider_name="honours", counter=counter),
        "ignores": Behaviour(
            provider_name="ignores", counter=counter, honours_reasoning_switch=False
        ),
    }
    srv = routed_fake(Behaviour(counter=counter), behaviours)
    try:
        battery = load_battery(default_battery("kimi_k25_instant"))
        overrides = [
            "model=kimi_k25_instant",
            f"provider.api_base={srv.url()}",
            f"model.tokenizer.path={kimi_dir}",
            "provider.retry.base_delay_s=0.01",
        ]
        results = {r.provider: r for r in run_probes(list(behaviours), tmp_path, battery, 1.0,
                                                     overrides)}  # fmt: skip
        assert all(s.body["reasoning"]["enabled"] is False for s in srv.requests)
    finally:
        srv.stop()
    assert results["honours"].quirks["thinking_switch_ignored"] == CLEAN
    assert results["ignores"].quirks["thinking_switch_ignored"] == SEEN
    assert not results["ignores"].usable


def test_an_export_mixing_modes_counts_each(tmp_path: Path) -> None:
    from kimi_pipe.exporters import export
    from tests.test_export_formats import make_store

    stores = []
    # Where the config is saved: the generate command's Hydra dir, a pipeline's config file.
    for name, mode, n, saved in (
        ("think", "thinking", 3, ".hydra/generate/config.yaml"),
        ("fast", "instant", 4, "demo_config.yaml"),
        ("old", None, 2, ".hydra/generate/config.yaml"),
    ):
        run = tmp_path / name
        (run / saved).parent.mkdir(parents=True, exist_ok=True)
        model = {"name": f"kimi_k25_{name}", **({"mode": mode} if mode else {})}
        (run / saved).write_text(json.dumps({"model": model}))
        stores.append(make_store(run / "store", n=n))
    summary = export(stores, tmp_path / "out", "tokens")
    modes = summary["modes"]
    assert {k: v["samples"] for k, v in modes.items()} == {
        "thinking": 3,
        "instant": 4,
        "unknown": 2,
    }
    assert modes["instant"]["tokens"] == sum(3 + i for i in range(4))
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| instant | 4 |" in card and "| thinking | 3 |" in card
