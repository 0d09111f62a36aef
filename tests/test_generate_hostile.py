"""The generate stage against a hostile provider (tests/support/fake_openrouter.py hostile modes,
real HTTP on 127.0.0.1, real Kimi tokenizer): the USD cap and the files hold whatever the
provider says. Each test names the finding of issue 10 it covers (F1-F10, lower items)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.conftest_generate import (
    FAKE_KEY,
    base_overrides,
    read_jsonl,
    records_by_id,
    run_inprocess,
    run_prompts,
    write_prompts,
)
from tests.support.fake_openrouter import Behaviour

pytestmark = [pytest.mark.kimi, pytest.mark.slow]


def test_f4_invalid_costs_book_the_reservation_and_flag_the_sample(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    modes = ["cost_nan", "cost_inf", "cost_neg", "cost_true", "no_usage"]
    srv = fake_openrouter(
        default=Behaviour(script={f"Question s{i}:": [m] for i, m in enumerate(modes)})
    )
    status, summary, out, ids = run_prompts(tmp_path, srv.url(), kimi_dir, n=6)
    assert status == 0 and summary is not None
    records = records_by_id(out / "records.jsonl")
    expected = {
        "cost_nan": "cost_invalid",
        "cost_inf": "cost_invalid",
        "cost_neg": "cost_invalid",
        "cost_true": "cost_invalid",
        "no_usage": "no_usage",
    }
    for i, mode in enumerate(modes):
        rec = records[f"s{i}"]
        assert expected[mode] in rec["issues"] and not rec["ok"], (mode, rec["issues"])
        # Booked at its worst case: a finite amount at least what the server billed for it.
        billed = [b.cost for b in srv.bills if b.marker.startswith(f"Question s{i}:")]
        assert math.isfinite(rec["cost"]) and rec["cost"] >= billed[0] > 0, mode
    assert records["s5"]["ok"]
    assert math.isfinite(summary["spend_usd"]) and summary["spend_usd"] >= srv.total_cost()
    text = (out / "records.jsonl").read_text() + (out / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text


def test_f5_an_answer_that_does_not_parse_is_booked_failed_and_never_bought_again(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    modes = ["finish_list", "tool_calls_str", "message_null"]
    script = {f"Question s{i}:": [m] * 10 for i, m in enumerate(modes)}
    srv = fake_openrouter(default=Behaviour(script=script))
    status, summary, out, ids = run_prompts(tmp_path, srv.url(), kimi_dir, n=4)
    assert status == 0 and summary is not None
    records = records_by_id(out / "records.jsonl")
    for i in range(3):
        rec = records[f"s{i}"]
        assert rec["error"]["class"] == "malformed_response" and rec["attempts"] == 1
    billed_bad = sum(b.cost for b in srv.bills if not b.marker.startswith("Question s3:"))
    assert summary["spend_usd"] >= srv.total_cost() and billed_bad > 0
    # Booked at the worst case: the failed attempts carry a cost.
    failed = read_jsonl(out / "attempt_errors.jsonl")
    assert len(failed) == 3 and all(f["cost"] > 0 for f in failed)
    n = len(srv.requests)
    status, _ = run_inprocess(base_overrides(tmp_path / "run.jsonl", srv.url(), out, kimi_dir), out)
    assert len(srv.requests) == n  # nothing bought again on resume


def test_f10_answers_from_another_model_or_without_a_known_finish_are_errors(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    modes = [
        "other_model",
        "finish_null",
        "finish_unknown",
        "content_filter",
        "no_model",
        "dated_model",
    ]
    srv = fake_openrouter(
        default=Behaviour(script={f"Question s{i}:": [m] for i, m in enumerate(modes)})
    )
    status, summary, out, ids = run_prompts(tmp_path, srv.url(), kimi_dir, n=7)
    assert status == 0 and summary is not None
    records = records_by_id(out / "records.jsonl")
    codes = [
        "other_model",
        "finish_reason_null",
        "finish_reason_unknown",
        "content_filter",
        "model_unnamed",  # no `model` at all: nothing says which model answered
    ]
    for i, code in enumerate(codes):
        assert code in records[f"s{i}"]["issues"] and not records[f"s{i}"]["ok"], code
    assert records["s5"]["ok"], records["s5"]["issues"]  # kimi-k2.5-0127 is the same model
    assert records["s6"]["ok"]


def test_f3_lone_surrogates_and_bad_bytes_are_replaced_flagged_and_written(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    srv = fake_openrouter(
        default=Behaviour(script={"Question s1:": ["surrogate"], "Question s2:": ["badutf8"]})
    )
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 4)
    lines = prompts.read_bytes().splitlines()
    # A BOM, a lone surrogate escape, a raw invalid byte, a line nested too deep to parse.
    lines[0] = b"\xef\xbb\xbf" + lines[0]
    lines[3] = lines[3].replace(b"what is", b"what \\ud800 is \xff\xfe")
    lines.append(b"[" * 200_000 + b"]" * 200_000)
    prompts.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "run"
    status, summary = run_inprocess(base_overrides(prompts, srv.url(), out, kimi_dir), out)
    assert status == 0 and summary is not None
    records = records_by_id(out / "records.jsonl")
    assert sorted(records) == ["s0", "s1", "s2", "s3"]
    assert records["s0"]["ok"]  # the BOM line is a prompt like any other
    assert "answer_text_replaced" in records["s1"]["issues"] and not records["s1"]["ok"]
    assert "\ufffd" in records["s1"]["response"]["choices"][0]["message"]["content"]
    assert records["s2"]["error"]["class"] == "malformed_response"  # not UTF-8: unreadable
    assert "prompt_text_replaced" in records["s3"]["issues"] and not records["s3"]["ok"]
    assert "\ufffd" in records["s3"]["messages"][1]["content"]
    assert summary["prompt_rows_skipped"] == {"too_deeply_nested": 1}
    assert summary["prompt_rows_skipped_examples"] == {"too_deeply_nested": ["line-5"]}
    (out / "records.jsonl").read_bytes().decode("utf-8")  # strict UTF-8 throughout


def test_f6_unusable_listed_prices_are_refused(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str, capsys
) -> None:
    for i, prices in enumerate(
        [
            ("0", "0"),
            ("-0.000001", "0.000002"),
            ("NaN", "NaN"),
            ("0.000000000001", "0.000000000001"),
            (None, "1"),
        ]
    ):
        srv = fake_openrouter(default=Behaviour(listed_prices=prices))
        status, summary, out, _ = run_prompts(tmp_path, srv.url(), kimi_dir, n=2, name=f"r{i}")
        assert status == 2 and summary is None, prices
        assert srv.requests == [], prices
        assert "price" in capsys.readouterr().err


def test_f8_a_provider_billing_3x_its_prices_cannot_push_spend_past_the_cap(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    srv = fake_openrouter(default=Behaviour(overbill=3.0, delay_s=0.05))
    cap = 0.01
    status, summary, out, ids = run_prompts(
        tmp_path,
        srv.url(),
        kimi_dir,
        n=120,
        usd=cap,
        extra=[
            "provider.params.max_tokens=40",
            "budget.reserve_factor=1.0",
            "provider.concurrency=8",
        ],
    )
    assert status == 0 and summary is not None
    assert srv.total_cost() <= cap
    assert summary["budget"]["overbill_ratio"] > 2.5
    assert summary["spend_usd"] >= srv.total_cost() - 1e-12
    flagged = [
        r for r in read_jsonl(out / "records.jsonl") if "billed_above_reservation" in r["issues"]
    ]
    assert flagged and not any(r["ok"] for r in flagged)


def test_f7_a_sample_too_big_for_the_budget_is_skipped_and_the_run_goes_on(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    srv = fake_openrouter()
    big = "word " * 20_000
    status, summary, out, ids = run_prompts(
        tmp_path,
        srv.url(),
        kimi_dir,
        n=5,
        usd=0.01,
        text=lambda i: big if i == 1 else f"Question s{i}: what is {i}+{i}?",
    )
    assert status == 0 and summary is not None
    records = records_by_id(out / "records.jsonl")
    assert sorted(records) == ["s0", "s2", "s3", "s4"]  # after the big one, the run went on
    assert summary["this_run"]["skipped_over_budget"] == 1
    assert "skipped" in summary["stop_message"]
    # A per-sample cap skips it the same way.
    srv2 = fake_openrouter()
    status, summary, out, _ = run_prompts(
        tmp_path,
        srv2.url(),
        kimi_dir,
        n=3,
        name="cap",
        extra=["budget.max_usd_per_sample=0.005"],
        text=lambda i: big if i == 0 else f"Question s{i}: what is {i}+{i}?",
    )
    assert sorted(records_by_id(out / "records.jsonl")) == ["s1", "s2"]
    assert summary is not None and summary["this_run"]["skipped_over_budget"] == 1


def test_f2_a_second_process_on_the_same_run_dir_exits_2_naming_the_holder(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str, capsys
) -> None:
    from kimi_pipe.store.run_lock import RunLock

    srv = fake_openrouter()
    out = tmp_path / "run"
    with RunLock(out):
        prompts = tmp_path / "p.jsonl"
        write_prompts(prompts, 2)
        status, summary = run_inprocess(base_overrides(prompts, srv.url(), out, kimi_dir), out)
    assert status == 2 and summary is None
    err = capsys.readouterr().err
    assert "in use by another process" in err and "pid" in err
    assert srv.requests == [] and not (out / "records.jsonl").exists()


def test_key_limit_below_the_budget_refuses_to_start_and_key_usage_is_counted(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str, capsys
) -> None:
    srv = fake_openrouter(default=Behaviour(key_limit=0.5))
    status, summary, out, _ = run_prompts(tmp_path, srv.url(), kimi_dir, n=2, usd=1.0)
    assert status == 2 and srv.requests == []
    assert "cannot cover" in capsys.readouterr().err
    # A provider that reports a tenth of what it bills: the key's own usage is counted.
    srv2 = fake_openrouter(
        default=Behaviour(
            key_endpoint=True, script={f"Question s{i}:": ["cost_under"] for i in range(4)}
        )
    )
    status, summary, out, _ = run_prompts(
        tmp_path, srv2.url(), kimi_dir, n=4, usd=1.0, name="under"
    )
    assert status == 0 and summary is not None
    assert summary["key"]["usage_delta_this_run"] == pytest.approx(srv2.total_cost())
    assert summary["spend_usd"] >= srv2.total_cost() - 1e-12
    # A resume starts from the key's count, kept in the journal, not from the lower reports.
    status, again = run_inprocess(
        base_overrides(tmp_path / "under.jsonl", srv2.url(), out, kimi_dir, usd=1.0), out
    )
    assert again is not None and again["spend_usd"] >= srv2.total_cost() - 1e-12


def test_an_echoed_key_is_redacted_and_flagged(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    srv = fake_openrouter(default=Behaviour(script={"Question s0:": ["echo_key"]}))
    status, summary, out, _ = run_prompts(tmp_path, srv.url(), kimi_dir, n=2)
    assert status == 0
    rec = records_by_id(out / "records.jsonl")["s0"]
    assert "api_key_echoed" in rec["issues"] and not rec["ok"]
    for path in out.rglob("*"):
        if path.is_file():
            assert FAKE_KEY.encode() not in path.read_bytes(), path


def test_a_run_where_every_request_failed_exits_4_with_the_cause(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str, capsys
) -> None:
    srv = fake_openrouter(default=Behaviour(error_rate=1.0, error_mode="503"))
    status, summary, out, _ = run_prompts(
        tmp_path, srv.url(), kimi_dir, n=3, extra=["provider.retry.max_attempts=2"]
    )
    assert status == 4 and summary is not None
    assert "every request of this run failed" in capsys.readouterr().err


def test_torn_attempt_errors_line_keeps_its_cost_and_attempts_count_over_runs(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    # s0's answers are empty but billed for the prompt (retried), s1 answers normally.
    srv = fake_openrouter(default=Behaviour(script={"Question s0:": ["empty"] * 50}))
    extra = ["provider.retry.max_attempts=3"]
    status, summary, out, _ = run_prompts(tmp_path, srv.url(), kimi_dir, n=2, extra=extra)
    errors = out / "attempt_errors.jsonl"
    assert len(read_jsonl(errors)) == 3
    # A kill while writing the last failed attempt: its line is torn.
    data = errors.read_bytes()
    errors.write_bytes(data[: len(data) - len(data.splitlines()[-1]) // 2 - 1])
    status, summary = run_inprocess(
        base_overrides(tmp_path / "run.jsonl", srv.url(), out, kimi_dir) + extra, out
    )
    assert summary is not None
    assert summary["spend_usd"] >= srv.total_cost() - 1e-12
    # s0 was bought 3 times (max_attempts) over the first run: never again.
    assert sum(1 for r in srv.requests if "Question s0:" in json.dumps(r.body)) == 3
    assert records_by_id(out / "records.jsonl")["s0"]["error"]["class"] == "attempts_exhausted"


def test_unsettled_intents_of_a_killed_process_are_booked_on_resume(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    from kimi_pipe.store.spend_journal import JOURNAL, SpendJournal

    srv = fake_openrouter()
    out = tmp_path / "run"
    out.mkdir()
    # A killed process left two intents open, one of them after its answer arrived
    # (generation id journalled): that one is looked up, the other booked at worst case.
    bill_status, _ = 0, None
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 2)
    status, _ = run_inprocess(base_overrides(prompts, srv.url(), out, kimi_dir), out)
    gen_id = srv.bills[0].generation_id
    with SpendJournal(out / JOURNAL) as journal:
        a = journal.intent("ghost-a", 1, 0.25)
        journal.generation(a, gen_id)
        journal.intent("ghost-b", 1, 0.5)
    status, summary = run_inprocess(base_overrides(prompts, srv.url(), out, kimi_dir), out)
    assert status == bill_status and summary is not None
    assert summary["journal"]["recovered_requests"] == 2
    assert summary["journal"]["recovered_usd"] == pytest.approx(0.5 + srv.bills[0].cost)
    lines = read_jsonl(out / JOURNAL)
    assert {line.get("how") for line in lines if line["k"] == "s"} >= {
        "recovered_worst_case",
        "recovered_lookup",
    }


def test_an_answer_above_max_response_mb_is_cut_off_booked_and_failed(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    srv = fake_openrouter(default=Behaviour(script={"Question s0:": ["huge"]}))
    status, summary, out, _ = run_prompts(
        tmp_path, srv.url(), kimi_dir, n=2, extra=["provider.max_response_mb=1"]
    )
    assert status == 0 and summary is not None
    records = records_by_id(out / "records.jsonl")
    assert records["s0"]["error"]["class"] == "response_too_large"
    assert records["s1"]["ok"]
    failed = read_jsonl(out / "attempt_errors.jsonl")
    assert failed[0]["cost"] > 0  # booked at its worst case: it may have been billed
    assert summary["spend_usd"] >= srv.total_cost() - 1e-12
    assert "max_response_mb" in records["s0"]["error"]["message"]


@pytest.mark.parametrize("guard", [1.0, 3.0])
def test_f8_the_first_wave_at_3x_overbilling_stays_under_the_cap(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str, guard: float
) -> None:
    """Before any answer returns, nothing shows the provider overbills: 64 requests go out at
    once. Only holding each one at `budget.overbill_guard` x its worst case keeps a provider
    that bills 3x its prices under the cap; without the guard the first wave alone crosses it."""
    srv = fake_openrouter(default=Behaviour(overbill=3.0, delay_s=0.3))
    cap = 0.004
    status, summary, out, ids = run_prompts(
        tmp_path,
        srv.url(),
        kimi_dir,
        n=64,
        usd=cap,
        name=f"g{guard:g}",
        extra=[
            "provider.params.max_tokens=8",
            "budget.reserve_factor=1.0",
            "provider.concurrency=64",
            f"budget.overbill_guard={guard}",
            "budget.slow_start=false",  # the guard alone (slow start: test_generate_money)
        ],
    )
    assert status == 0 and summary is not None
    if guard == 1.0:
        assert srv.total_cost() > cap  # what the guard is for
    else:
        assert 0 < srv.total_cost() <= cap  # it bought, and stayed under
        assert summary["spend_usd"] >= srv.total_cost() - 1e-12
