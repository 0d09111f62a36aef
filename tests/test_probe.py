"""Conformance probes against imitated stacks over real HTTP (tests/support/fake_stacks.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kimi_pipe.conformance.probe import (
    CLEAN,
    SEEN,
    UNKNOWN,
    ProbeError,
    check_answer,
    default_battery,
    load_battery,
)
from kimi_pipe.core.models import Model
from kimi_pipe.stages.jobs.report import read_saved_config
from kimi_pipe.stages.probe import main, run_probes
from tests.support.fake_openrouter import Behaviour, KimiCounter
from tests.support.fake_stacks import Stack, routed_fake, stacks


@pytest.fixture
def stack_server(kimi: Model) -> Any:
    counter = KimiCounter(kimi)
    behaviours = {
        name: Behaviour(provider_name=name, counter=counter, stack=stack)
        for name, stack in stacks(kimi).items()
    }
    # A stack the battery has no profile for beyond the ids: SGLang ids and vLLM spacing.
    behaviours["spaced_foreign"] = Behaviour(
        provider_name="spaced_foreign",
        counter=counter,
        stack=Stack(
            kimi, "spaced_foreign", marker_spacing=True, foreign_ids=True, strip_argument_edges=True
        ),
    )
    behaviours["vllm_033_logprobs"] = Behaviour(
        provider_name="vllm_033_logprobs",
        counter=counter,
        stack=Stack(kimi, "vllm_033_logprobs", strip_reasoning_end=True, logprobs="whole"),
    )
    srv = routed_fake(Behaviour(counter=counter), behaviours)
    yield srv, behaviours
    srv.stop()


def test_verdicts_per_imitated_stack(
    stack_server: Any, kimi_dir: Path, tmp_path: Path, api_key_env: str
) -> None:
    srv, behaviours = stack_server
    battery = load_battery(default_battery("kimi_k25"))
    overrides = [
        f"provider.api_base={srv.url()}",
        f"model.tokenizer.path={kimi_dir}",
        "provider.retry.base_delay_s=0.01",
        "provider.concurrency=6",
    ]
    results = {
        r.provider: r for r in run_probes(list(behaviours), tmp_path, battery, 1.6, overrides)
    }
    # Every probe pinned to its provider, logprobs asked for but not required.
    for seen in srv.requests:
        assert seen.body["provider"]["order"] == [seen.behaviour]
        assert seen.body["provider"]["allow_fallbacks"] is False
        assert seen.body["logprobs"] is True
        assert seen.body["provider"]["require_parameters"] is False
    expect_seen = {
        "exact_whole": set(),
        # The Kimi parsers of vLLM and SGLang strip the arguments' edges (`\s*`).
        "vllm_spaced": {"marker_spacing", "argument_edges_stripped"},
        "vllm_033": {
            "argument_reserialised",
            "dotted_name_truncated",
            "marker_text_deleted",
            "argument_edges_stripped",
        },
        "sglang_0514": {"tool_index_rule", "argument_edges_stripped"},
        "stripping": {"content_whitespace_stripped"},
        "dropped_think": {"think_end_dropped"},
        "spaced_foreign": {"marker_spacing", "foreign_tool_ids", "argument_edges_stripped"},
        # The engine's tokens show the whitespace the text lost.
        "vllm_033_logprobs": {"reasoning_whitespace_stripped"},
    }
    for name, seen_quirks in expect_seen.items():
        got = {q for q, v in results[name].quirks.items() if v == SEEN}
        assert got == seen_quirks, name
    exact = results["exact_whole"]
    assert set(exact.quirks.values()) == {CLEAN}
    assert exact.logprobs == "whole" and exact.logprob_agree == exact.answered == 8
    assert exact.noncanonical_splits >= 8  # one sampled split per answer, recovered
    assert results["vllm_spaced"].logprobs == "content"
    assert results["vllm_033"].logprobs == "none"
    # Whitespace the model wrote is lost at the same token count: no evidence either way.
    assert results["vllm_033"].quirks["reasoning_whitespace_stripped"] == UNKNOWN
    profiles = {name: (r.profile, r.usable) for name, r in results.items()}
    # One vocabulary: every fitted profile is a conf/serving name (plus the fields that
    # differ from it), so `serving=NAME serving.FIELD=VALUE` is what the probe found.
    assert profiles == {
        "exact_whole": ("exact", True),
        "vllm_spaced": ("vllm_spaced", True),
        "vllm_033": (None, False),
        "sglang_0514": ("sglang_0_5_14", True),
        "stripping": (None, False),
        "dropped_think": (None, False),
        "spaced_foreign": ("vllm_spaced+tool_call_ids=foreign", True),
        "vllm_033_logprobs": (None, False),
    }
    assert results["spaced_foreign"].fields["tool_call_ids"] == "foreign"
    assert results["sglang_0514"].fields == {
        "marker_spacing": "none", "reasoning_tail": "kept", "tool_call_ids": "double_count",
        "tool_names": "full", "argument_types": "verbatim", "think_end": "kept",
        "argument_edges": "stripped",
        # The prompt's fields are weighed by each answer's bill, not fitted by probes.
        "history": "unknown", "think_open": "unknown",
    }  # fmt: skip
    assert results["exact_whole"].fields["argument_edges"] == "kept"
    table = (tmp_path / "conformance.md").read_text()
    assert "| vllm_033 |" in table and "argument_reserialised" in table
    assert (tmp_path / "conformance.json").is_file()


def _record(message: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"response": {"choices": [{"message": message}]}, "issues": [], **extra}


def test_checks_say_unknown_when_the_model_did_not_comply() -> None:
    probe = {"id": "b", "check": {"kind": "begins_with", "word": "Paris"}}
    # The model answered something else: nothing can be said about spacing.
    assert "marker_spacing" not in check_answer(probe, _record({"content": "Lyon is nice."}))
    assert check_answer(probe, _record({"content": " Paris!"}))["marker_spacing"][0] == SEEN
    assert check_answer(probe, {"error": {"class": "timeout"}, "response": None}) == {}
    tool = {"id": "t", "check": {"kind": "string_argument", "tool": "f", "key": "s", "value": "30"}}
    call = {"id": "functions.f:0", "function": {"name": "f", "arguments": '{"s": "31"}'}}
    assert check_answer(tool, _record({"content": "", "tool_calls": [call]})) == {}
    call["function"]["arguments"] = '{"s": 30}'
    got = check_answer(tool, _record({"content": "", "tool_calls": [call]}))
    assert got["argument_reserialised"][0] == SEEN
    # Compact JSON with a billing check that fails: re-serialised, even with "30" kept.
    call["function"]["arguments"] = '{"s":"30"}'
    compact = _record({"content": "", "tool_calls": [call]}, issues=["billing_mismatch"])
    assert check_answer(tool, compact)["argument_reserialised"][0] == SEEN
    compact["issues"] = []  # no evidence the model did not write it so
    assert check_answer(tool, compact)["argument_reserialised"][0] == CLEAN
    index = {"id": "i", "check": {"kind": "tool_index", "tool": "f", "index": 2}}
    call = {"id": " functions.f:2", "function": {"name": "f", "arguments": "{}"}}
    got = check_answer(index, _record({"content": "", "tool_calls": [call]}))
    assert got["marker_spacing"][0] == SEEN and got["tool_index_rule"][0] == CLEAN
    ws = {"id": "w", "check": {"kind": "reasoning_trailing_whitespace"}}
    rec = _record(
        {"content": "OK", "reasoning": "done."},
        issues=["billing_mismatch"],
        completion_tokens_reported=9,
        completion_tokens_reconstructed=8,
    )
    assert check_answer(ws, rec)["reasoning_whitespace_stripped"][0] == SEEN
    rec["completion_tokens_reconstructed"] = 10  # more tokens than billed: not this quirk
    assert check_answer(ws, rec) == {}


def test_bad_battery_names_the_file_and_probe(tmp_path: Path) -> None:
    bad = tmp_path / "b.yaml"
    bad.write_text(
        "quirks: {}\nprobes:\n  - id: a\n    messages: [{role: user, content: x}]\n"
        "    check: {kind: nonsense}\n"
    )
    with pytest.raises(ProbeError, match=r"b.yaml: probe 0 \(a\): check.kind 'nonsense'"):
        load_battery(bad)
    with pytest.raises(ProbeError, match="not found"):
        load_battery(tmp_path / "missing.yaml")
    assert main(["probe.usd=1"]) == 2  # no providers
    assert main(["usd=1"]) == 2  # the old form: names its new key


def test_report_routes_only_to_faithful_providers(
    stack_server: Any, kimi_dir: Path, tmp_path: Path, api_key_env: str
) -> None:
    """Probes, then a small generate run per imitated stack, then report.md: the conformance
    table, logprob agreement, share per code, and a routing without the unfaithful ones.
    KIMI_PIPE_SWEEP_EXAMPLE=DIR copies the report there (docs/example-sweep)."""
    import json
    import os
    import shutil

    from kimi_pipe.reporting.report import build_report
    from tests.support.conftest_generate import base_overrides, run_inprocess, write_prompts

    srv, _ = stack_server
    chosen = list(stacks_names())
    battery = load_battery(default_battery("kimi_k25"))
    common = [f"provider.api_base={srv.url()}", f"model.tokenizer.path={kimi_dir}"]
    run_probes(chosen, tmp_path / "probes", battery, 0.1 * len(chosen), common)
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 4, tools_every=2, text=lambda i: f"Question {i}: call calc for {i}.")
    for slug in chosen:
        out = tmp_path / slug
        overrides = [
            *base_overrides(prompts, srv.url(), out, kimi_dir),
            f"provider.routing.order=[{slug}]",
            "provider.routing.allow_fallbacks=false",
            # Ask every provider for logprobs without requiring them, as the probes do.
            "++provider.params.logprobs=true",
            "provider.routing.require_parameters=false",
        ]
        status, _ = run_inprocess(overrides, out)
        assert status == 0
    md = build_report(tmp_path, tmp_path, read_config=read_saved_config).read_text()
    assert "## Conformance and token-level evidence" in md
    assert "| sglang_0514 |" in md and "sglang_0_5_14" in md
    assert "noncanonical_split" in md  # share of answers per code
    assert "- `exact_whole`: 4/4 answers with logprobs (whole x4); 4/4 agree with the text" in md
    assert "- `vllm_033`: no logprobs in 4 answers" in md
    assert "- `vllm_spaced`: 4/4 answers with logprobs (content x4); 2/4 agree" in md
    routing = json.loads((tmp_path / "report.json").read_text())["routing"]
    # Faithful (exact, or quirks a profile undoes) and not failing billing on these prompts.
    assert set(routing["order"]) <= {"exact_whole", "sglang_0514", "vllm_spaced"}
    assert "exact_whole" in routing["order"] and "sglang_0514" in routing["order"]
    assert set(routing["ignore"]) >= {"vllm_033", "stripping", "dropped_think"}
    assert "conformance probes: quirks that cannot be inverted: content_whitespace_stripped" in md
    # The probe runs are not provider runs of the report.
    assert "probes/" not in md.split("## Details per provider")[0]
    example = os.environ.get("KIMI_PIPE_SWEEP_EXAMPLE")
    if example:
        dest = Path(example)
        dest.mkdir(parents=True, exist_ok=True)
        for path in [tmp_path / "report.md", tmp_path / "report.json", *tmp_path.glob("*.png")]:
            shutil.copy2(path, dest / path.name)
        probes_dest = dest / "probes"
        probes_dest.mkdir(exist_ok=True)
        for name in ("conformance.md", "conformance.json"):
            shutil.copy2(tmp_path / "probes" / name, probes_dest / name)


def stacks_names() -> list[str]:
    return ["exact_whole", "vllm_spaced", "vllm_033", "sglang_0514", "stripping",
            "dropped_think"]  # fmt: skip


def test_probe_stage_of_the_sweep_pipeline(
    stack_server: Any, kimi_dir: Path, tmp_path: Path, api_key_env: str
) -> None:
    """The runner's probe stage and `kimi-pipe sweep`'s own probe step write the same
    table into <sweep_dir>/probes; dataset and budget settings stay with the sweep."""
    from kimi_pipe.config import compose
    from kimi_pipe.pipeline.registry import ProbeStage
    from kimi_pipe.pipeline.stage import StageContext
    from kimi_pipe.stages import sweep

    srv, _ = stack_server
    extra = [f"provider.api_base={srv.url()}", f"model.tokenizer.path={kimi_dir}"]
    cfg = compose(
        [
            "pipeline=sweep",
            "dataset=B5",
            "sweep.providers=[exact_whole,stripping]",
            "sweep.probe_usd=0.2",
            "sweep.overrides=[" + ",".join(f"'{o}'" for o in extra) + ",'dataset.num_samples=3']",
        ]
    )
    stage = ProbeStage()
    ctx = StageContext(cfg, tmp_path / "pipe")
    assert not stage.is_complete(ctx)
    result = stage.run(ctx)
    assert result["usable"] == ["exact_whole"] and result["left_out"] == ["stripping"]
    assert stage.is_complete(ctx)

    # The sweep command's config: the same settings as command-line overrides.
    cli = compose(
        ["dataset=B5", "sweep.providers=[exact_whole,stripping]", "sweep.n=1", "sweep.usd=1",
         "sweep.probe_usd=0.2", *extra, "dataset.num_samples=3", "budget.max_samples=1"]
    )  # fmt: skip
    args = sweep.settings_of(cli)
    assert args.probes and args.probe_usd == 0.2
    sweep.run_probe_step(cli, args, tmp_path / "cli")
    table = (tmp_path / "cli" / "probes" / "conformance.md").read_text()
    assert table == (tmp_path / "pipe" / "probes" / "conformance.md").read_text()
    assert not sweep.settings_of(
        compose(["dataset=B5", "sweep.providers=[a]", "sweep.probes=false"])
    ).probes


def test_probe_cli(stack_server: Any, kimi_dir: Path, tmp_path: Path, api_key_env: str) -> None:
    srv, _ = stack_server
    out = tmp_path / "probe"
    args = [
        "probe.providers=exact_whole",  # one slug, no list
        f"probe.output_dir={out}",
        "probe.usd=0.1",
        f"provider.api_base={srv.url()}",
        f"model.tokenizer.path={kimi_dir}",
        "dataset=B5",  # a sweep's dataset setting: not the probes' business, left out
    ]
    assert main(args) == 0
    assert "| exact_whole |" in (out / "conformance.md").read_text()
    assert main([*args[:-1], f"probe.battery={tmp_path / 'none.yaml'}"]) == 2


def test_argument_edges_kept_stripped_or_not_asked() -> None:
    probe = {"id": "e", "check": {"kind": "argument_edges", "tool": "f"}}

    def answer(arguments: str, **extra: Any) -> dict[str, Any]:
        call = {"id": "functions.f:0", "function": {"name": "f", "arguments": arguments}}
        return _record({"content": "", "tool_calls": [call]}, **extra)

    kept = check_answer(probe, answer('\n{"s": "45"}\n'))
    assert kept["argument_edges_stripped"][0] == CLEAN
    # Billing counts the newline the text lost: the stack stripped it.
    billed = answer(
        '{"s": "45"}', completion_tokens_reported=12, completion_tokens_reconstructed=11
    )
    assert check_answer(probe, billed)["argument_edges_stripped"][0] == SEEN
    # The engine's tokens hold it (logprobs), at the same count.
    trims = [{"engine": '\n{"s": "45"}\n', "text": '{"s": "45"}'}]
    traced = answer('{"s": "45"}', logprobs={"present": True, "stack_trims": trims})
    assert check_answer(probe, traced)["argument_edges_stripped"][0] == SEEN
    # No whitespace and nothing missing: the model did not do what was asked.
    plain = answer('{"s": "45"}', completion_tokens_reported=11, completion_tokens_reconstructed=11)
    assert check_answer(probe, plain) == {}
