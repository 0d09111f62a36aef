"""The generate stage against a real HTTP server on 127.0.0.1 speaking OpenRouter's wire
format (tests/support/fake_openrouter.py), with the real Kimi tokenizer."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from tests.support.conftest_generate import (
    base_overrides,
    read_jsonl,
    run_inprocess,
    write_prompts,
)
from tests.support.fake_openrouter import Behaviour

pytestmark = [pytest.mark.kimi, pytest.mark.slow]

VARIANTS = ["reasoning", "reasoning_content", "reasoning_details", "think_in_content"]


def _by_id(records: list[dict]) -> dict[str, dict]:
    return {r["id"]: r for r in records}


def test_every_reasoning_variant_and_tool_calls_reconstruct_to_the_same_ids(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    behaviours = {v: Behaviour(reasoning_field=v, provider_name=f"P-{v}") for v in VARIANTS}
    behaviours["call_ids"] = Behaviour(tool_call_ids="call", provider_name="P-call_ids")
    srv = fake_openrouter(behaviours=behaviours)
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 6, tools_every=3)
    outputs: dict[str, dict[str, dict]] = {}
    for name in behaviours:
        out = tmp_path / name
        status, summary = run_inprocess(base_overrides(prompts, srv.url(name), out, kimi_dir), out)
        assert status == 0 and summary is not None
        records = _by_id(read_jsonl(out / "records.jsonl"))
        assert sorted(records) == sorted(ids)
        for rec in records.values():
            # ok means the reconstruction matched usage.completion_tokens exactly.
            assert rec["ok"], (name, rec["id"], rec["issues"])
            assert rec["provider"] == f"P-{name}"
            assert rec["completion_tokens_reconstructed"] == rec["usage"]["completion_tokens"]
            assert len(rec["loss_mask"]) == len(rec["prompt_ids"]) + len(rec["output_ids"])
        assert summary["counts"]["ok"] == len(ids)
        assert summary["billing_drift"]["reconstructed_minus_reported"] == 0
        outputs[name] = records
    # Whatever field the reasoning came back in, the model emitted the same tokens.
    reference = outputs["reasoning"]
    for name, records in outputs.items():
        for rid in ids:
            assert records[rid]["output_ids"] == reference[rid]["output_ids"], (name, rid)
    # Tool-call answers really went through the tool-call path.
    tool_ids = [rid for rid in ids if int(rid[1:]) % 3 == 0]
    for rid in tool_ids:
        assert outputs["call_ids"][rid]["response"]["choices"][0]["message"]["tool_calls"]
        assert "tool_call_ids_rebuilt" in outputs["call_ids"][rid]["issues"]
    # The routing object and reasoning settings travelled in the request body.
    body = srv.requests[0].body
    assert body["provider"]["data_collection"] == "deny"
    assert "fp4" not in body["provider"]["quantizations"]
    assert body["reasoning"]["enabled"] is True
    assert body["max_tokens"] == 512


def test_stripped_whitespace_is_flagged_not_hidden(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    srv = fake_openrouter(default=Behaviour(strip_whitespace=True))
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 3)
    out = tmp_path / "run"
    status, summary = run_inprocess(base_overrides(prompts, srv.url(), out, kimi_dir), out)
    assert status == 0 and summary is not None
    assert summary["counts"]["flagged"] == 3
    assert summary["flagged_by_issue"]["billing_mismatch"] == 3
    assert summary["billing_drift"]["reconstructed_minus_reported"] < 0


def test_transient_errors_are_retried_and_every_attempt_counted(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    script = {
        "Question s0:": ["429", "500", "502", "200error"],
        "Question s1:": ["emptybody", "empty", "408", "503"],
        "Question s2:": ["hang"],
        "Question s3:": ["reset"],
    }
    srv = fake_openrouter(default=Behaviour(script=script, retry_after="0", hang_s=8))
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 6)
    out = tmp_path / "run"
    overrides = base_overrides(prompts, srv.url(), out, kimi_dir) + ["provider.timeout_s=1"]
    status, summary = run_inprocess(overrides, out)
    assert status == 0 and summary is not None
    records = _by_id(read_jsonl(out / "records.jsonl"))
    assert sorted(records) == sorted(ids)
    assert all(r["ok"] for r in records.values())
    assert records["s0"]["attempts"] == 5
    assert records["s1"]["attempts"] == 5
    assert records["s2"]["attempts"] == 2
    assert records["s4"]["attempts"] == 1
    failed = read_jsonl(out / "attempt_errors.jsonl")
    classes = {rid: [f["error"]["class"] for f in failed if f["id"] == rid] for rid in ids}
    assert classes["s0"] == ["rate_limited", "server_error", "server_error", "server_error"]
    assert classes["s1"] == ["bad_body", "empty_response", "timeout", "server_error"]
    assert classes["s2"] == ["timeout"]
    # The empty answer was billed for its prompt: that money is in the spend.
    empty = [f for f in failed if f["error"]["class"] == "empty_response"]
    assert empty and empty[0]["cost"] > 0
    # Every request the server saw is an attempt the stage counted: a connection dropped
    # after the request was sent (s3's reset) is our own failed attempt (issue 20), never
    # LiteLLM's unseen re-send on a fresh session.
    s3_seen = [r for r in srv.requests if "Question s3:" in json.dumps(r.body)]
    assert [r.mode for r in s3_seen] == ["reset", "ok"] and records["s3"]["attempts"] == 2
    assert summary["this_run"]["attempts"] == len(srv.requests)
    assert summary["this_run"]["retries"] == len(failed)
    # A timed-out attempt, an HTTP-200 body that could not be read, or a connection lost
    # after sending may still be billed by the provider: it is booked at its worst case, so
    # the spend is the server's bill plus those reservations, never less.
    lost = ("timeout", "bad_body", "connection_lost")
    unseen = [f["cost"] for f in failed if f["error"]["class"] in lost]
    assert len(unseen) == 4 and all(cost > 0 for cost in unseen)
    assert summary["spend_usd"] == pytest.approx(srv.total_cost() + sum(unseen), rel=1e-9)


def test_retry_after_is_honoured(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    srv = fake_openrouter(default=Behaviour(script={"Question s0:": ["429"]}, retry_after="1"))
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 1)
    out = tmp_path / "run"
    status, _ = run_inprocess(base_overrides(prompts, srv.url(), out, kimi_dir), out)
    assert status == 0
    first, second = srv.requests
    assert first.mode == "429" and second.mode == "ok"
    # Backoff alone would be <= 0.05 s here; Retry-After asked for 1 s.
    assert second.time - first.time >= 0.95


def test_permanent_errors_fail_the_sample_without_retry(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    srv = fake_openrouter(
        default=Behaviour(script={"Question s1:": ["400"], "Question s2:": ["403"]})
    )
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 4)
    out = tmp_path / "run"
    status, summary = run_inprocess(base_overrides(prompts, srv.url(), out, kimi_dir), out)
    assert status == 0 and summary is not None
    records = _by_id(read_jsonl(out / "records.jsonl"))
    assert sorted(records) == sorted(ids)
    assert records["s1"]["error"]["class"] == "bad_request"
    assert records["s2"]["error"]["class"] == "forbidden"
    for rid in ("s1", "s2"):
        assert records[rid]["ok"] is False and records[rid]["output_ids"] == []
        assert records[rid]["attempts"] == 1
    assert len(srv.requests) == 4
    assert summary["failed_by_class"] == {"bad_request": 1, "forbidden": 1}
    # Resuming does not buy them again.
    status, _ = run_inprocess(base_overrides(prompts, srv.url(), out, kimi_dir), out)
    assert status == 0 and len(srv.requests) == 4


def test_402_stops_dispatch_cleanly_and_resume_finishes(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    beh = Behaviour(delay_s=0.02)
    srv = fake_openrouter(default=beh)
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 40)
    out = tmp_path / "run"
    # Credit for about 10 answers.
    one = 0.0001
    beh.credit_usd = one * 10
    concurrency = 4
    overrides = base_overrides(prompts, srv.url(), out, kimi_dir, concurrency=concurrency)
    status, summary = run_inprocess(overrides, out)
    assert status == 3 and summary is not None
    assert summary["stop_reason"] == "payment_required"
    assert "402" in summary["stop_message"]
    first_402 = min(r.answered_at for r in srv.requests if r.mode == "402")
    # Once the first 402 went out, nothing new is dispatched: only requests already on
    # their way (at most concurrency - 1) may still arrive.
    assert sum(r.time > first_402 for r in srv.requests) <= concurrency - 1
    records = read_jsonl(out / "records.jsonl")
    assert 0 < len(records) < len(ids)
    assert all(r["error"] is None for r in records)  # a 402 sample is not "answered"
    # Credits added: the same command resumes and finishes, every id exactly once.
    beh.credit_usd = None
    status, summary = run_inprocess(overrides, out)
    assert status == 0 and summary is not None
    final = [r["id"] for r in read_jsonl(out / "records.jsonl")]
    assert sorted(final) == sorted(ids) and len(final) == len(set(final))
    assert summary["spend_usd"] == pytest.approx(srv.total_cost(), rel=1e-9)


def test_a_stop_is_said_once_on_the_terminal(
    tmp_path: Path,
    fake_openrouter,
    kimi_dir: Path,
    api_key_env: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The provider's stop reaches the terminal once, at the end of the run; the run's log
    files keep the moment it happened."""
    srv = fake_openrouter(default=Behaviour(error_rate=1.0, error_mode="401"))
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 6)
    out = tmp_path / "run"
    terminal = io.StringIO()
    handler = logging.StreamHandler(terminal)  # what Hydra's console handler shows
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        status, summary = run_inprocess(
            base_overrides(prompts, srv.url(), out, kimi_dir, concurrency=2), out
        )
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    said = terminal.getvalue() + capsys.readouterr().err
    assert status == 3 and summary is not None and summary["stop_message"]
    assert said.count(summary["stop_message"]) == 1, said


def test_401_ends_the_run(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    srv = fake_openrouter(default=Behaviour(error_rate=1.0, error_mode="401"))
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 20)
    out = tmp_path / "run"
    status, summary = run_inprocess(
        base_overrides(prompts, srv.url(), out, kimi_dir, concurrency=2), out
    )
    assert status == 3 and summary is not None
    assert summary["stop_reason"] == "auth"
    assert len(srv.requests) <= 3
    assert read_jsonl(out / "records.jsonl") == []


@pytest.mark.parametrize("from_listing", [True, False])
def test_budget_is_never_exceeded_at_concurrency_64(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str, from_listing: bool
) -> None:
    beh = Behaviour(delay_s=0.2)
    srv = fake_openrouter(default=beh)
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 300, tools_every=7)
    out = tmp_path / "run"
    # 64 worst cases (128 output tokens each) fit in the cap, 300 real answers do not.
    cap = 0.03
    overrides = base_overrides(prompts, srv.url(), out, kimi_dir, usd=cap, concurrency=64)
    # The plain reservation mechanics: no overbilling guard (tested in test_generate_hostile)
    # and no slow start (test_generate_money).
    overrides += ["provider.params.max_tokens=128", "budget.reserve_factor=1.0"]
    overrides += ["budget.overbill_guard=1.0", "budget.slow_start=false"]
    if not from_listing:
        overrides += [
            f"provider.pricing.input_usd_per_mtok={beh.input_price * 1e6}",
            f"provider.pricing.output_usd_per_mtok={beh.output_price * 1e6}",
        ]
    status, summary = run_inprocess(overrides, out)
    assert status == 0 and summary is not None
    billed = srv.total_cost()
    assert billed <= cap
    assert summary["stop_reason"] == "budget_usd"
    answered = read_jsonl(out / "records.jsonl")
    assert 0 < len(answered) < len(ids)
    # Dispatch really ran 64 wide (the cap did not serialise it).
    assert _max_in_flight(srv.requests) > 32
    assert summary["spend_usd"] == pytest.approx(billed, rel=1e-9)
    # A rerun spends nothing more: the money already spent counts against the cap.
    n = len(srv.requests)
    status, summary = run_inprocess(overrides, out)
    assert srv.total_cost() <= cap
    assert len(srv.requests) - n <= 64


def _max_in_flight(requests: list) -> int:
    """Most requests the server was working on at the same moment."""
    events = sorted([(r.time, 1) for r in requests] + [(r.answered_at, -1) for r in requests])
    best = cur = 0
    for _, step in events:
        cur += step
        best = max(best, cur)
    return best


def test_max_samples_and_max_output_tokens(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    srv = fake_openrouter()
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 30)
    out = tmp_path / "run"
    overrides = base_overrides(prompts, srv.url(), out, kimi_dir) + ["budget.max_samples=7"]
    status, summary = run_inprocess(overrides, out)
    assert status == 0 and summary is not None
    assert summary["stop_reason"] == "max_samples"
    assert len(read_jsonl(out / "records.jsonl")) == 7
    out2 = tmp_path / "run2"
    overrides = base_overrides(prompts, srv.url(), out2, kimi_dir) + [
        "budget.max_output_tokens=600",
        "provider.params.max_tokens=100",
    ]
    status, summary = run_inprocess(overrides, out2)
    assert status == 0 and summary is not None
    assert summary["stop_reason"] == "max_output_tokens"
    used = sum(r["usage"]["completion_tokens"] for r in read_jsonl(out2 / "records.jsonl"))
    assert 0 < used <= 600


def test_missing_key_stops_start_up_with_how_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kimi_dir: Path, capsys
) -> None:
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 1)
    out = tmp_path / "run"
    status, summary = run_inprocess(
        base_overrides(prompts, "http://127.0.0.1:9/api/v1", out, kimi_dir), out
    )
    assert status == 2 and summary is None
    err = capsys.readouterr().err
    assert "export OPENROUTER_API_KEY=" in err


def test_budget_below_one_request_says_so(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    srv = fake_openrouter()
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 2)
    out = tmp_path / "run"
    status, summary = run_inprocess(
        base_overrides(prompts, srv.url(), out, kimi_dir, usd=0.0000001), out
    )
    assert status == 0 and summary is not None
    assert summary["stop_reason"] == "budget_usd"
    assert "worst case" in summary["stop_message"]
    assert srv.requests == []


def test_summary_is_json_with_counts(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    srv = fake_openrouter(default=Behaviour(script={"Question s1:": ["400"]}))
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 3)
    out = tmp_path / "run"
    run_inprocess(base_overrides(prompts, srv.url(), out, kimi_dir), out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"] == {"records": 3, "answered": 2, "ok": 2, "flagged": 0, "failed": 1}
    assert summary["tokens"]["completion_reported"] == sum(b.completion_tokens for b in srv.bills)
    # Yield in tokens and dollars (issue 33): both answers are proven whole.
    block = summary["yield"]
    bought = summary["tokens"]["completion_reported"]
    assert block["completion_tokens_bought"] == bought == block["exact_accepted"]
    price = summary["budget"]["price_out_usd_per_mtok"] / 1e6
    assert block["listed_usd_per_exact_token"] == pytest.approx(price)
    assert block["spend_usd_per_exact_token"] == pytest.approx(summary["spend_usd"] / bought)


def test_prices_fall_back_when_the_server_has_no_listing(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str, capsys
) -> None:
    srv = fake_openrouter(default=Behaviour(list_models=False))
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 2)
    out = tmp_path / "run"
    status, summary = run_inprocess(base_overrides(prompts, srv.url(), out, kimi_dir), out)
    assert status == 0 and summary is not None
    assert summary["budget"]["price_source"] == "fallback"
    assert summary["budget"]["price_out_usd_per_mtok"] == 8.0
    # Without fallback prices a missing listing stops start-up, saying what to set.
    out2 = tmp_path / "run2"
    overrides = base_overrides(prompts, srv.url(), out2, kimi_dir) + [
        "provider.pricing.fallback_input_usd_per_mtok=null"
    ]
    status, summary = run_inprocess(overrides, out2)
    assert status == 2 and summary is None
    assert "provider.pricing.input_usd_per_mtok" in capsys.readouterr().err
    assert len(srv.requests) == 2  # only the first run's two prompts were sent


def test_a_provider_without_a_key_variable_needs_no_key(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    srv = fake_openrouter()
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 2)
    out = tmp_path / "run"
    overrides = base_overrides(prompts, srv.url(), out, kimi_dir) + ["provider.api_key_env=null"]
    status, summary = run_inprocess(overrides, out)
    assert status == 0 and summary is not None and summary["counts"]["ok"] == 2
    assert {r.headers.get("authorization") for r in srv.requests} == {"Bearer no-key"}


def test_a_wrong_model_stops_after_consecutive_failures(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    srv = fake_openrouter(default=Behaviour(error_rate=1.0, error_mode="400"))
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 40)
    out = tmp_path / "run"
    overrides = base_overrides(prompts, srv.url(), out, kimi_dir, concurrency=2) + [
        "provider.retry.max_consecutive_failures=5"
    ]
    status, summary = run_inprocess(overrides, out)
    assert status == 3 and summary is not None
    assert summary["stop_reason"] == "too_many_failures"
    assert "provider.model" in summary["stop_message"]
    # 5 in a row, plus at most the one other request in flight.
    assert 5 <= len(read_jsonl(out / "records.jsonl")) <= 6
    assert len(srv.requests) <= 6
