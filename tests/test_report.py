"""kimi_pipe.stages.report on run directories built here in the generate record schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from kimi_pipe.reporting.recommend import Policy, exclusion_reasons, recommend, routing_overrides
from kimi_pipe.reporting.runs import find_run_dirs, load_run
from kimi_pipe.reporting.stats import percentile, quantization_of, summarize
from kimi_pipe.stages import report
from kimi_pipe.stages.jobs.report import read_saved_config

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def make_record(
    i: int,
    *,
    provider: str = "exact",
    reported: int = 100,
    rebuilt: int | None = None,
    latency: float = 1.0,
    attempts: int = 1,
    cost: float | None = 0.001,
    error: dict[str, Any] | None = None,
    issues: list[str] | None = None,
    tool_args: list[str] | None = None,
    quantization: str | None = None,
) -> dict[str, Any]:
    """One generate record; `rebuilt` != `reported` makes it a drifting, not-ok sample."""
    if error is not None:
        return {
            "id": f"s{i}", "ok": False, "issues": [], "error": error, "attempts": attempts,
            "latency_s": latency, "cost": None, "provider": None, "usage": None,
            "response": None, "messages": [], "tools": None,
            "completion_tokens_reported": None, "completion_tokens_reconstructed": None,
        }  # fmt: skip
    rebuilt = reported if rebuilt is None else rebuilt
    message: dict[str, Any] = {"role": "assistant", "content": "hi"}
    if tool_args is not None:
        message["tool_calls"] = [
            {"id": f"functions.get_weather:{k}", "type": "function",
             "function": {"name": name, "arguments": args}}
            for k, (name, args) in enumerate(
                (a.split("|", 1) if "|" in a else ("get_weather", a)) for a in tool_args
            )
        ]  # fmt: skip
    response: dict[str, Any] = {
        "id": f"gen-{i}",
        "provider": provider,
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"completion_tokens": reported, "prompt_tokens": 20, "cost": cost},
    }
    if quantization:
        response["quantization"] = quantization
    return {
        "id": f"s{i}",
        "ok": rebuilt == reported,  # issue notes leave ok as it is
        "issues": issues
        if issues is not None
        else ([] if rebuilt == reported else ["billing_mismatch"]),
        "prompt_ids": [1, 2],
        "output_ids": list(range(rebuilt)),
        "loss_mask": [0, 0] + [1] * rebuilt,
        "completion_tokens_reported": reported,
        "completion_tokens_reconstructed": rebuilt,
        "messages": [{"role": "user", "content": f"q{i}"}],
        "tools": [WEATHER_TOOL] if tool_args is not None else None,
        "request": {"model": "m"},
        "response": response,
        "usage": response["usage"],
        "cost": cost,
        "provider": provider,
        "latency_s": latency,
        "attempts": attempts,
        "error": None,
    }


def write_run(
    run_dir: Path,
    records: list[dict[str, Any]],
    *,
    pinned: str | None = None,
    quantization: str | None = None,
    extra_lines: list[str] = (),  # type: ignore[assignment]
) -> Path:
    run_dir.mkdir(parents=True)
    with (run_dir / "records.jsonl").open("w") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")
        for line in extra_lines:
            fh.write(line)
    if pinned is not None or quantization is not None:
        provider: dict[str, Any] = {"name": pinned or "x"}
        if pinned is not None:
            provider["order"] = [pinned]
            provider["allow_fallbacks"] = False
        if quantization is not None:
            provider["quantization"] = quantization
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"provider": provider}))
    (run_dir / "summary.json").write_text(json.dumps({"stop_reason": "done"}))
    return run_dir


def routing_from(md: str) -> dict[str, Any]:
    block = md.split("## Recommended routing", 1)[1].split("```yaml\n", 1)[1].split("```")[0]
    return yaml.safe_load(block)["provider"]


def assert_png(path: Path) -> None:
    """A real, non-empty image: PNG signature, decodes, and is not one flat colour."""
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    img = mpimg.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100, path
    assert float(img[..., :3].std()) > 0.01, f"{path} is a blank image"


@pytest.fixture()
def sweep(tmp_path: Path) -> Path:
    """Five behaviours like the issue's fake providers, 20 samples each."""
    root = tmp_path / "sweep"
    n = 20
    write_run(
        root / "exact",
        [make_record(i, provider="exact", latency=1.0, tool_args=['{"city": "Paris"}'])
         for i in range(n)],
        pinned="exact",
    )  # fmt: skip
    write_run(
        root / "strip",
        [make_record(i, provider="strip", rebuilt=97 if i % 2 else 100, latency=1.0)
         for i in range(n)],
        pinned="strip",
    )  # fmt: skip
    write_run(
        root / "slow",
        [make_record(i, provider="slow", latency=4.0) for i in range(n)],
        pinned="slow",
    )
    write_run(
        root / "renumber",
        [make_record(i, provider="renumber", issues=["tool_call_ids_rebuilt"],
                     tool_args=['{"city": "Oslo"}']) for i in range(n)],
        pinned="renumber",
    )  # fmt: skip
    flaky = [make_record(i, provider="flaky", latency=1.0) for i in range(n - 1)]
    flaky[3]["attempts"] = 2
    flaky.append(make_record(n - 1, error={"class": "APIError", "message": "x", "status": 502}))
    write_run(root / "flaky", flaky, pinned="flaky")
    return root


def test_sweep_report_ranks_and_ignores(sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    path = report.build_report(sweep, out, read_config=read_saved_config)
    md = path.read_text()
    routing = routing_from(md)
    # Fidelity first (strip drifts -> ignored; renumber's ids are guessed), then errors
    # (flaky), then speed (slow).
    assert routing == {"order": ["exact", "slow", "flaky", "renumber"], "ignore": ["strip"],
                       "allow_fallbacks": False}  # fmt: skip
    assert "`strip`: ignored: reconstruction ok rate 50%" in md
    assert md.count("run ended: done") == 5
    data = json.loads((out / "report.json").read_text())
    assert data["routing"] == routing
    assert [r["provider"] for r in data["runs"]] == ["exact", "slow", "flaky", "renumber", "strip"]
    assert data["runs"][-1]["ok_rate"] == 0.5 and data["runs"][-1]["issues"] == {
        "billing_mismatch": 10
    }
    # Table rows follow the recommended order.
    rows = [ln.split("|")[1].strip() for ln in md.splitlines() if ln.startswith("| ")]
    rows = [r for r in rows if r != "---"]
    assert rows[1:] == ["exact", "slow", "flaky", "renumber", "strip"]
    assert "`renumber`: rank 4:" in md and "tool_call_ids_rebuilt x20" in md
    charts = sorted(p.name for p in out.glob("*.png"))
    assert charts == sorted(
        ["ok_rate.png", "billing_drift.png", "issues.png", "tool_calls.png", "cost.png",
         "latency.png", "throughput.png", "errors.png"]
    )  # fmt: skip
    for name in charts:
        assert f"]({name})" in md
        assert_png(out / name)


def test_figures_per_provider(sweep: Path) -> None:
    stats = {s.provider: s for s in (summarize(load_run(d, sweep, read_saved_config))
                                     for d in find_run_dirs(sweep))}  # fmt: skip
    strip = stats["strip"]
    assert strip.ok_rate == 0.5
    assert strip.drift_tokens == -30  # 10 samples lost 3 tokens each
    assert strip.drift_total_pct == pytest.approx(-30 / 2000 * 100)
    assert sorted(set(strip.drift_pct)) == [-3.0, 0.0]
    assert strip.issues == {"billing_mismatch": 10}
    flaky = stats["flaky"]
    assert (flaky.requests, flaky.answered, flaky.errors, flaky.retried) == (20, 19, 1, 1)
    assert flaky.error_rate == 0.05
    assert flaky.error_classes == {"APIError (502)": 1}
    slow = stats["slow"]
    assert slow.p50_latency == 4.0 and slow.median_tokens_per_s == 25.0
    exact = stats["exact"]
    assert exact.usd_per_mtok == pytest.approx(20 * 0.001 / 2000 * 1e6)
    assert (exact.tool_calls, exact.tool_calls_valid) == (20, 20)


def test_single_run_gives_one_row_report(tmp_path: Path) -> None:
    run = write_run(tmp_path / "runs" / "B5" / "openrouter",
                    [make_record(i, provider="Moonshot AI") for i in range(3)])  # fmt: skip
    md = report.build_report(run, run, read_config=read_saved_config).read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert len(rows) == 2  # header + one provider
    # No pinned config: the slug falls back to the provider the answers name.
    assert routing_from(md)["order"] == ["Moonshot AI"]
    assert (run / "report.md").is_file() and (run / "ok_rate.png").is_file()


def test_tool_call_validity(tmp_path: Path) -> None:
    rec = make_record(
        0,
        tool_args=[
            '{"city": "Paris", "days": 2}',  # valid
            '{"city": "Paris"',  # torn JSON
            '{"city": 3}',  # wrong type
            '{"days": 2}',  # missing required
            '["Paris"]',  # not an object
            'nope|{"city": "Paris"}',  # undeclared function
        ],
    )
    run = write_run(tmp_path / "r", [rec], pinned="p")
    s = summarize(load_run(run, tmp_path, read_saved_config))
    assert (s.tool_calls, s.tool_calls_valid) == (6, 1)
    assert s.tool_problems == {
        "arguments_not_json": 1, "schema_mismatch": 2, "arguments_not_object": 1,
        "unknown_function": 1,
    }  # fmt: skip
    # Low validity keeps the provider out of the routing.
    rec_ = recommend([s], Policy())
    assert rec_.ignore == ["p"] and "tool-call validity 17%" in rec_.reasons["p"]


def test_torn_lines_and_resumed_duplicates(tmp_path: Path) -> None:
    first = make_record(0, error={"class": "Timeout", "message": "t", "status": 408})
    retry = make_record(0)  # the resumed run answered it later
    run = write_run(tmp_path / "r", [first, retry, make_record(1)],
                    extra_lines=['{"id": "s2", "ok": tr'])  # fmt: skip
    loaded = load_run(run, tmp_path, read_saved_config)
    assert loaded.bad_lines == 1
    s = summarize(loaded)
    assert (s.requests, s.errors, s.ok) == (2, 0, 2)
    md = report.build_report(run, tmp_path / "out", read_config=read_saved_config).read_text()
    assert "1 unreadable line(s)" in md


def test_quantization_sources_and_policy(tmp_path: Path) -> None:
    from_response = write_run(tmp_path / "a", [make_record(0, quantization="FP8")], pinned="a")
    from_config = write_run(tmp_path / "b", [make_record(0)], pinned="b", quantization="fp4")
    absent = write_run(tmp_path / "c", [make_record(0)], pinned="c")
    q = {p.name: quantization_of(load_run(p, tmp_path, read_saved_config))
         for p in (from_response, from_config, absent)}  # fmt: skip
    assert q == {"a": "fp8", "b": "fp4", "c": "unknown"}
    rec = recommend(
        [summarize(load_run(p, tmp_path, read_saved_config)) for p in (from_response, from_config)],
        Policy(),
    )
    assert rec.order == ["a"] and rec.ignore == ["b"]
    assert "quantisation fp4" in rec.reasons["b"]


def test_rank_step_lets_price_beat_one_noisy_sample(tmp_path: Path) -> None:
    # 49/50 ok at half the price vs 50/50 ok: same 2% bucket -> the cheaper one first.
    cheap = [make_record(i, cost=0.0005) for i in range(50)]
    cheap[0] = make_record(0, cost=0.0005, rebuilt=101)
    dear = [make_record(i, cost=0.001) for i in range(50)]
    stats = [summarize(load_run(write_run(tmp_path / n, r, pinned=n), tmp_path, read_saved_config))
             for n, r in (("dear", dear), ("cheap", cheap))]  # fmt: skip
    assert recommend(stats, Policy()).order == ["cheap", "dear"]
    strict = Policy(rank_step=0.0)
    assert recommend(stats, strict).order == ["dear", "cheap"]


def test_percentile_matches_numpy() -> None:
    values = [0.3, 5.0, 1.2, 9.9, 2.2, 2.2, 7.1]
    for q in (0, 50, 95, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


def test_cli_end_to_end_and_errors(
    sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    done = subprocess.run(
        [sys.executable, "-m", "kimi_pipe", "report", f"report.sweep_dir={sweep}",
         f"report.out_dir={out}", "report.max_error_rate=0.01"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert routing_from((out / "report.md").read_text())["ignore"] == ["flaky", "strip"]
    assert "[report] 5/5 reading" in done.stderr

    missing = tmp_path / "nowhere"
    done = subprocess.run(
        [sys.executable, "-m", "kimi_pipe", "report", f"report.sweep_dir={missing}"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and str(missing) in done.stderr and "make sweep" in done.stderr
    capsys.readouterr()
    assert report.main([f"report.sweep_dir={sweep}", "colour=red"]) == 2
    assert "colour" in capsys.readouterr().err
    assert report.main([]) == 2
    assert "report.sweep_dir=PATH is required" in capsys.readouterr().err
    # The policy's numbers are typed; the old `key=value` form names its new key.
    assert report.main([f"report.sweep_dir={sweep}", "report.rank_step=wide"]) == 2
    assert "report.rank_step='wide': expected a number" in capsys.readouterr().err
    assert report.main([f"sweep_dir={sweep}"]) == 2
    assert "sweep_dir= is now report.sweep_dir=" in capsys.readouterr().err


def test_report_group_defaults_are_the_policy_defaults() -> None:
    """conf/report/default.yaml spells out the Policy a Python caller gets by default."""
    from kimi_pipe.config import compose

    settings = report.settings_of(compose([]))
    assert settings.policy() == Policy()
    assert (settings.sweep_dir, settings.out_dir) == (None, None)
    short = report.settings_of(compose(["report.ignore_quantizations=fp4"]))  # one, no list
    assert short.policy().ignore_quantizations == ("fp4",)


def test_given_up_samples_and_failed_attempt_cost(tmp_path: Path) -> None:
    # s1 ran out of retries (only in attempt_errors.jsonl); s0 needed a second attempt.
    run = write_run(tmp_path / "r", [make_record(0, attempts=2, cost=0.002)], pinned="p")
    attempts = [
        {"id": "s0", "attempt": 1, "error": {"class": "server_error", "status": 502}, "cost": 0},
        {"id": "s1", "attempt": 1, "error": {"class": "timeout", "status": 408}, "cost": 0.001},
        {"id": "s1", "attempt": 2, "error": {"class": "timeout", "status": 408}, "cost": 0.001},
    ]
    (run / "attempt_errors.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts))
    s = summarize(load_run(run, tmp_path, read_saved_config))
    assert (s.requests, s.answered, s.errors, s.retried) == (2, 1, 1, 2)
    assert s.error_classes == {"timeout (408), given up": 1}
    assert s.cost_usd == pytest.approx(0.004)  # failed attempts were billed too
    assert s.usd_per_mtok == pytest.approx(0.004 / 100 * 1e6)
    assert s.attempt_failure_rate == pytest.approx(3 / 4)
    assert s.mean_attempts == 2.0


def test_sweep_job_config_is_resolved(tmp_path: Path) -> None:
    # What Hydra saves for a sweep job: the pinned order is an interpolation.
    run = write_run(tmp_path / "deepinfra" / "fp8", [make_record(0, provider="DeepInfra")])
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text(
        "provider:\n  name: deepinfra/fp8\n  routing:\n    order:\n    - ${provider.name}\n"
        "    quantizations: [int4, fp8]\n    allow_fallbacks: false\n"
        "output_dir: ${hydra:runtime.output_dir}\n"
    )
    loaded = load_run(run, tmp_path, read_saved_config)
    assert loaded.name == "deepinfra/fp8"
    assert loaded.config["output_dir"] == "${hydra:runtime.output_dir}"  # kept as written
    s = summarize(loaded)
    assert s.provider == "deepinfra/fp8" and s.allowed_quantizations == ("int4", "fp8")


def test_slug_from_request_and_allow_list(tmp_path: Path) -> None:
    rec = make_record(0, provider="Some Vendor", quantization="bf16")
    rec["request"] = {"extra_body": {"provider": {"order": ["vendor"], "allow_fallbacks": False}}}
    run = write_run(tmp_path / "run", [rec])
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text(
        yaml.safe_dump({"provider": {"routing": {"order": None, "quantizations": ["int4"]}}})
    )
    s = summarize(load_run(run, tmp_path, read_saved_config))
    assert s.provider == "vendor"
    why = recommend([s], Policy()).reasons["vendor"]
    assert "not in the run's allow-list ['int4']" in why
    # int4 is not ignored by default: it is Kimi K2.5's native quantisation.
    assert exclusion_reasons(s, Policy(ignore_quantizations=())) != []
    s.quantization = "int4"
    assert exclusion_reasons(s, Policy()) == []


def test_run_with_no_answers_still_reports(tmp_path: Path) -> None:
    err = {"class": "payment_required", "message": "402", "status": 402}
    write_run(tmp_path / "sweep" / "broke", [make_record(0, error=err)], pinned="broke")
    write_run(tmp_path / "sweep" / "fine", [make_record(0)], pinned="fine")
    md = report.build_report(
        tmp_path / "sweep", tmp_path / "out", read_config=read_saved_config
    ).read_text()
    routing = routing_from(md)
    assert routing["order"] == ["fine"] and routing["ignore"] == ["broke"]
    assert "no answered requests" in md and "error rate 100%" in md
    for chart in (tmp_path / "out").glob("*.png"):
        assert_png(chart)


def test_routing_overrides_compose_into_the_generate_config() -> None:
    import shlex

    from kimi_pipe.config import compose

    rec = report.Recommendation(order=["moonshotai", "deepinfra/fp8"], ignore=[], reasons={})
    cfg = compose(shlex.split(routing_overrides(rec)))
    assert list(cfg.provider.routing.order) == ["moonshotai", "deepinfra/fp8"]
    assert list(cfg.provider.routing.ignore) == []
    assert cfg.provider.routing.allow_fallbacks is False
