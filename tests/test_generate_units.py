"""Pure pieces of the generate stage: records, budget, retry policy, settings, progress."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import random
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from kimi_pipe.progress import Progress, Snapshot
from kimi_pipe.providers.budget import Budget, BudgetGate, Pricing
from kimi_pipe.providers.calls import answer_problem, parse_retry_after
from kimi_pipe.providers.errors import ProviderConfigError
from kimi_pipe.providers.settings import ProviderSettings, RetryPolicy
from kimi_pipe.store.records import (
    ReadStats,
    RecordWriter,
    cut_torn_tail,
    iter_records,
)
from kimi_pipe.store.records_index import load_resume_index

REPO = Path(__file__).resolve().parent.parent

# --- records ---------------------------------------------------------------------------


def test_torn_last_line_is_ignored_and_cut_before_appending(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_bytes(b'{"id": "a", "cost": 0.5}\n{"id": "b", "cost": 0.25}\n{"id": "c", "co')
    stats = ReadStats()
    assert [r["id"] for r in iter_records(path, stats)] == ["a", "b"]
    assert stats.torn_tail and stats.records == 2
    with RecordWriter(path) as writer:
        writer.append({"id": "c", "cost": 0.125})
    assert [r["id"] for r in iter_records(path)] == ["a", "b", "c"]
    assert (tmp_path / "records.jsonl.torn").read_bytes() == b'{"id": "c", "co\n'
    assert path.read_bytes().endswith(b'"cost":0.125}\n')


def test_bad_middle_line_is_reported_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": "a"}\nnot json\n[1, 2]\n{"id": "b"}\n')
    stats = ReadStats()
    with caplog.at_level(logging.WARNING):
        assert [r["id"] for r in iter_records(path, stats)] == ["a", "b"]
    assert stats.bad_lines == [2, 3] and not stats.torn_tail
    assert "line 2 is not a JSON object" in caplog.text


def test_cut_torn_tail_keeps_whole_files_untouched(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": "a"}\n')
    assert cut_torn_tail(path) == 0 and path.read_text() == '{"id": "a"}\n'
    only_torn = tmp_path / "t.jsonl"
    only_torn.write_bytes(b'{"id"')
    assert cut_torn_tail(only_torn) == 5 and only_torn.read_bytes() == b""


def test_resume_index_counts_ids_spend_and_tokens(tmp_path: Path) -> None:
    records = tmp_path / "records.jsonl"
    errors = tmp_path / "attempt_errors.jsonl"
    with RecordWriter(records) as w:
        w.append({"id": "a", "cost": 0.5, "usage": {"completion_tokens": 10}})
        w.append({"id": "b", "cost": 0.0, "usage": None, "error": {"class": "bad_request"}})
    with RecordWriter(errors) as w:
        w.append({"id": "c", "cost": 0.25, "usage": {"completion_tokens": 0}})
    index = load_resume_index(records, errors)
    assert index.ids == {"a", "b"}
    assert index.cost == pytest.approx(0.75)
    assert index.output_tokens == 10
    assert load_resume_index(tmp_path / "missing.jsonl").ids == set()


def test_unicode_survives_a_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    with RecordWriter(path) as w:
        w.append({"id": "日本", "text": "line\nbreak \u2028 <|im_end|>"})
    (rec,) = list(iter_records(path))
    assert rec == {"id": "日本", "text": "line\nbreak \u2028 <|im_end|>"}
    assert path.read_bytes().count(b"\n") == 1


# --- budget ----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    cap=st.floats(0.01, 5.0),
    jobs=st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)), min_size=1, max_size=60),
    seed=st.integers(0, 1000),
)
def test_spend_never_exceeds_the_cap_in_any_interleaving(
    cap: float, jobs: list[tuple[float, float]], seed: int
) -> None:
    budget = Budget(cap)
    rng = random.Random(seed)
    held = []
    queue = list(jobs)
    while queue or held:
        if queue and (not held or rng.random() < 0.6):
            worst, frac = queue[0]
            res = budget.try_reserve(worst, 0)
            if res is not None:
                queue.pop(0)
                held.append((res, worst * frac))
                continue
            if not held:
                queue.pop(0)  # can never fit
                continue
        res, actual = held.pop(rng.randrange(len(held)))
        budget.settle(res, actual, 0, True)
        assert budget.spent_usd <= cap + 1e-12
        assert budget.spent_usd + budget.reserved_usd <= cap + 1e-9
    assert budget.reserved_usd == pytest.approx(0.0, abs=1e-9)


def test_reservations_from_many_threads_never_cross_the_cap() -> None:
    budget = Budget(1.0)
    spent_by_thread: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        total = 0.0
        for _ in range(200):
            res = budget.try_reserve(0.013, 0)
            if res is None:
                continue
            total += 0.011
            budget.settle(res, 0.011, 0, True)
        with lock:
            spent_by_thread.append(total)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(spent_by_thread) <= 1.0
    assert budget.spent_usd == pytest.approx(sum(spent_by_thread))


def test_sample_and_token_caps() -> None:
    budget = Budget(None, max_samples=2, max_output_tokens=100, done_samples=1)
    first = budget.try_reserve(0.0, 40)
    assert first is not None
    assert budget.try_reserve(0.0, 40) is None  # the second sample would exceed max_samples
    assert budget.blocker(0.0, 40, True) == "max_samples"
    budget.settle(first, 0.0, 30, False)  # a failed attempt: no sample used, tokens used
    assert budget.try_reserve(0.0, 71) is None
    assert budget.blocker(0.0, 71, True) == "max_output_tokens"
    assert budget.try_reserve(0.0, 70) is not None


def test_gate_waits_for_money_in_flight_and_gives_up_when_none_can_come_back() -> None:
    async def scenario() -> list[str]:
        gate = BudgetGate(Budget(1.0))
        events: list[str] = []
        held = await gate.reserve(0.8, 0)
        assert held is not None
        got = []

        async def second() -> None:
            res = await gate.reserve(0.5, 0)  # 0.8 + 0.5 > 1: waits for the first to settle
            events.append("got" if res else "none")
            got.append(res)

        task = asyncio.create_task(second())
        await asyncio.sleep(0.01)
        events.append("settling")
        gate.settle(held, 0.2, 0, True)  # 0.8 reserved -> 0.2 spent: 0.5 now fits
        await task
        gate.settle(got[0], 0.3, 0, True)  # spent 0.5, nothing in flight
        # 0.5 + 0.6 > 1 and nothing in flight can give money back: no wait, None.
        assert await asyncio.wait_for(gate.reserve(0.6, 0), 1.0) is None
        assert await gate.reserve(0.5, 0) is not None
        return events

    assert asyncio.run(scenario()) == ["settling", "got"]


def test_worst_case_cost() -> None:
    assert Pricing(1e-6, 2e-6).worst_case(1000, 500, 1.5) == pytest.approx(0.003)


# --- providers -------------------------------------------------------------------------


def test_retry_after_parsing() -> None:
    assert parse_retry_after({"retry-after": "7"}) == 7.0
    assert parse_retry_after({"Retry-After": "0.5"}) == 0.5
    assert parse_retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after(None) is None


def test_backoff_grows_exponentially_within_jitter_and_cap() -> None:
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=10.0, jitter=0.5)
    rng = random.Random(0)
    for attempt, full in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (9, 10.0)]:
        for _ in range(50):
            assert full * 0.5 <= policy.backoff(attempt, rng) <= full


def test_answer_problems() -> None:
    ok = {"choices": [{"finish_reason": "stop", "message": {"content": "hi"}}]}
    assert answer_problem(ok) is None
    reasoning_only = {
        "choices": [
            {"message": {"content": "", "provider_specific_fields": {"reasoning": "thinking"}}}
        ]
    }
    assert answer_problem(reasoning_only) is None
    empty = {"choices": [{"finish_reason": "stop", "message": {"content": ""}}]}
    assert answer_problem(empty).cls == "empty_response"
    assert answer_problem({"error": {"message": "x"}}).cls == "provider_error"
    assert answer_problem({"choices": []}).cls == "malformed_response"
    err = {
        "choices": [
            {
                "finish_reason": "stop",
                "message": {"content": "x"},
                "provider_specific_fields": {"native_finish_reason": "error"},
            }
        ]
    }
    assert answer_problem(err).cls == "provider_error"


def test_openrouter_config_builds_the_request_body_extras() -> None:
    cfg = OmegaConf.load(REPO / "conf" / "provider" / "openrouter.yaml")
    s = ProviderSettings.from_config(cfg)
    assert s.model == "openrouter/moonshotai/kimi-k2.5"
    assert s.api_key_env == "OPENROUTER_API_KEY"
    routing = s.extra_body["provider"]
    assert "order" not in routing  # null options are not sent
    assert routing["data_collection"] == "deny"
    assert not {"fp4", "fp6"} & set(routing["quantizations"])
    assert s.extra_body["reasoning"] == {"enabled": True, "exclude": False}
    assert s.params["max_tokens"] > 0
    record = json.dumps(s.request_record())
    assert "api_key" not in record and "OPENROUTER_API_KEY" not in record


def test_a_key_inside_the_provider_config_is_refused() -> None:
    cfg = OmegaConf.load(REPO / "conf" / "provider" / "openrouter.yaml")
    cfg.api_key = "sk" + "-or-v1-x"
    with pytest.raises(ProviderConfigError, match="OPENROUTER_API_KEY"):
        ProviderSettings.from_config(cfg)


# --- progress --------------------------------------------------------------------------


def _snap(done: int) -> Snapshot:
    return Snapshot(
        done=done,
        total=10,
        spent_usd=0.5,
        cap_usd=2.0,
        output_tokens=1000,
        retries=3,
        failures=1,
        in_flight=4,
    )


def test_progress_redraws_one_line_on_a_terminal() -> None:
    out = io.StringIO()
    p = Progress(out, tty_every_s=0.0, force_tty=True)
    p.update(_snap(3))
    p.update(_snap(4))
    p.close()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n")
    assert "4/10" in text and "$0.5000 of $2.00" in text and "retries 3" in text


def test_progress_logs_plain_lines_elsewhere(caplog: pytest.LogCaptureFixture) -> None:
    out = io.StringIO()
    p = Progress(out, log_every_s=3600, force_tty=False)
    with caplog.at_level(logging.INFO, logger="kimi_pipe.progress"):
        p.update(_snap(1))
        p.update(_snap(2))  # within the interval: not logged
        p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "1/10" in lines[0] and "2/10" in lines[1]
    assert out.getvalue() == ""


def test_whole_last_record_without_newline_is_kept(tmp_path: Path) -> None:
    from kimi_pipe.store.records import cut_torn_tail, iter_records

    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"id": "a"}\n{"id": "b"}')  # e.g. a hand edit that dropped the newline
    assert [r["id"] for r in iter_records(path)] == ["a", "b"]
    assert cut_torn_tail(path) == 0
    assert path.read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'
    path.write_bytes(b'{"id": "a"}\n{"id": "b", "x": ')  # a real torn write
    assert [r["id"] for r in iter_records(path)] == ["a"]
    assert cut_torn_tail(path) > 0 and path.read_bytes() == b'{"id": "a"}\n'
