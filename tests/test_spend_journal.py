"""Units of issue 10: the write-ahead spend journal, the run-dir lock, the budget under
overbilling, validated costs and prices, answer checks, text repair, key overrides."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_pipe.core.answer_checks import TextRepair, answer_issues, clean_text, same_model
from kimi_pipe.providers.budget import Budget
from kimi_pipe.providers.costs import _checked_prices, response_cost
from kimi_pipe.providers.credentials import key_in_overrides
from kimi_pipe.providers.errors import PriceError
from kimi_pipe.store.run_lock import RunDirLocked, RunLock
from kimi_pipe.store.spend_journal import SpendJournal

REPO = Path(__file__).resolve().parent.parent


def test_journal_books_open_intents_at_worst_case_or_looked_up_cost(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with SpendJournal(path) as j:
        a = j.intent("a", 1, 0.5)
        j.settle(a, 0.1, True)
        b = j.intent("b", 1, 0.4)  # open at the "kill", answer never arrived
        c = j.intent("c", 1, 0.3)
        j.generation(c, "gen-c")  # open at the "kill", answer arrived
        j.intent("d", 1, 0.2)
    with path.open("ab") as fh:
        fh.write(b'{"k":"s","n":')  # torn last line: ignored and cut
    j2 = SpendJournal(path)
    assert j2.spent() == pytest.approx(0.1 + 0.4 + 0.3 + 0.2)  # open ones at worst case

    async def lookup(gen: str) -> float | None:
        return {"gen-c": 0.05}.get(gen)

    count, booked = asyncio.run(j2.recover(lookup))
    assert count == 3 and booked == pytest.approx(0.4 + 0.05 + 0.2)
    assert j2.spent() == pytest.approx(0.1 + 0.4 + 0.05 + 0.2)
    attempts = j2.billed_attempts()
    # c's answer had arrived (its handling may have killed the process): held against it;
    # b and d were merely in flight.
    assert attempts["c"] == 1 and attempts["b"] == 0 and attempts["d"] == 0
    assert b > 0
    j2.close()
    j3 = SpendJournal(path)  # the recovery is on disk: nothing open, same spend
    assert j3.unsettled() == [] and j3.spent() == pytest.approx(0.1 + 0.4 + 0.05 + 0.2)
    j3.close()


def test_journal_never_lowers_a_booking_from_a_bad_settle_line(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    path.write_text(
        '{"k":"i","n":1,"id":"x","a":1,"usd":0.5}\n'
        '{"k":"s","n":1,"usd":NaN,"b":true}\n'
        '{"k":"i","n":2,"id":"y","a":1,"usd":0.25}\n'
        '{"k":"s","n":2,"usd":-3,"b":true}\n'
    )
    with SpendJournal(path) as j:
        assert j.spent() == pytest.approx(0.75)


def test_an_outside_count_above_the_bookings_is_kept_for_resumes(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with SpendJournal(path) as j:
        j.settle(j.intent("a", 1, 0.5), 0.1, True)
        j.raise_floor(0.4)  # the key's usage says 0.4 was spent, we booked 0.1
        j.raise_floor(0.2)  # never lowers it
        assert j.spent() == pytest.approx(0.4)
    with SpendJournal(path) as j:
        assert j.spent() == pytest.approx(0.4)
        j.settle(j.intent("b", 1, 0.5), 0.2, True)
        assert j.spent() == pytest.approx(0.6)  # later bookings add on top


def test_failed_billed_attempts_count_against_the_id_over_runs(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with SpendJournal(path) as j:
        for attempt in (1, 2):
            j.settle(j.intent("x", attempt, 0.1), 0.1, True)
        j.settle(j.intent("x", 3, 0.1), 0.0, False)  # refused before generating: free
    with SpendJournal(path) as j:
        assert j.billed_attempts()["x"] == 2


def test_run_lock_is_exclusive_and_names_the_holder(tmp_path: Path) -> None:
    code = (
        "import sys,time; sys.path.insert(0, sys.argv[2]);"
        "from kimi_pipe.store.run_lock import RunLock;"
        "l = RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(30)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path), str(REPO)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid} on host"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path):  # the kernel dropped the dead holder's lock
        pass


def test_overbilling_raises_every_reservation_so_the_cap_holds() -> None:
    budget = Budget(1.0)
    first = [budget.try_reserve(0.1, 0) for _ in range(4)]
    assert all(first)
    budget.settle(first[0], 0.3, 0, True)  # billed 3x its worst case
    assert budget.overbill_ratio == pytest.approx(3.0)
    # 0.3 spent + 3 in flight counted at 3x (0.9) = 1.2 > cap: nothing more fits.
    assert budget.try_reserve(0.01, 0) is None
    for res in first[1:]:
        budget.settle(res, 0.3, 0, True)
    assert budget.spent_usd == pytest.approx(1.2)  # the first wave could not be known
    budget2 = Budget(1.0)
    budget2.raise_floor(0.95)  # the key says more was spent than we counted
    assert budget2.try_reserve(0.1, 0) is None


@pytest.mark.parametrize("cost", [float("nan"), float("inf"), -1.0, True, "0.1", None])
def test_an_invalid_cost_is_never_trusted(cost: object) -> None:
    resp = {"usage": {"prompt_tokens": 3, "completion_tokens": 2, "cost": cost}}
    value, flags = response_cost(resp, {}, None)
    assert value is None and flags == ["cost_invalid"]


def test_missing_usage_is_flagged_and_a_valid_cost_kept() -> None:
    zeros = {"usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
    assert response_cost(zeros, {}, None) == (None, ["no_usage"])
    assert response_cost({"usage": {"cost": 0.25}}, {}, None) == (0.25, [])
    negative = {"usage": {"prompt_tokens": 3, "completion_tokens": -2, "cost": 0.25}}
    assert response_cost(negative, {}, None) == (None, ["usage_invalid"])


@pytest.mark.parametrize(
    "prices",
    [(0, 1e-6), (-1e-6, 1e-6), (math.nan, 1e-6), (1e-12, 1e-12), (math.inf, 1e-6), ("x", 1e-6)],
)
def test_unusable_listed_prices_are_refused(prices: tuple) -> None:
    with pytest.raises(PriceError):
        _checked_prices(prices, "listing", 0.001)


def test_answer_checks() -> None:
    asked = "openrouter/moonshotai/kimi-k2.5"
    assert same_model("moonshotai/kimi-k2.5", asked)
    assert same_model("moonshotai/kimi-k2.5-0127", asked)
    assert same_model("moonshotai/kimi-k2.5-2026-01-27", asked)
    assert not same_model("openai/gpt-4o-mini", asked)
    assert not same_model("moonshotai/kimi-k2.5-evil", asked)
    # A local server answers with the absolute path LiteLLM was given after `openai/`.
    local = "openai//root/.cache/kimi_pipe/models/SmolLM2"
    assert same_model("/root/.cache/kimi_pipe/models/SmolLM2", local)
    assert not same_model("/root/.cache/kimi_pipe/models/Other", local)

    def resp(finish: object, model: str = "moonshotai/kimi-k2.5") -> dict:
        return {
            "model": model,
            "choices": [
                {
                    "finish_reason": "stop",
                    "provider_specific_fields": {"native_finish_reason": finish},
                }
            ],
        }

    assert answer_issues(resp("stop"), asked) == []
    assert answer_issues(resp(None), asked) == ["finish_reason_null"]
    assert answer_issues(resp("banana"), asked) == ["finish_reason_unknown"]
    assert answer_issues(resp("content_filter"), asked) == ["content_filter"]
    assert answer_issues(resp("stop", "openai/gpt-4o-mini"), asked) == ["other_model"]


def test_clean_text_repairs_surrogates_non_finite_numbers_and_echoed_keys() -> None:
    repair = TextRepair()
    out = clean_text(
        {"a": ["x\ud800y", float("nan")], "b": ("key sk" + "-or-v1-SECRET")},
        ("sk" + "-or-v1-SECRET"),
        repair,
    )
    assert out == {"a": ["x\ufffdy", "nan"], "b": "key ***"}
    assert repair.surrogates and repair.non_finite and repair.key_echoed
    assert clean_text("plain", "k", TextRepair()) == "plain"


def test_keys_in_any_override_are_refused() -> None:
    env = {"OPENROUTER_API_KEY": ("sk" + "-or-v1-abcdefabcdef0123456789")}
    assert key_in_overrides(["provider.api_key_env=OPENROUTER_API_KEY"], env) is None
    assert key_in_overrides(["budget.usd=3", "provider.concurrency=8"], env) is None
    # A tokenizer path in KIMI_TOKENIZER_DIR is not a secret.
    env["KIMI_TOKENIZER_DIR"] = "/work/shared/tokenizers/kimi-k2.5"
    assert key_in_overrides(["model.tokenizer.path=/work/shared/tokenizers/kimi-k2.5"], env) is None
    for bad in [
        ("provider.api_key_env=sk" + "-or-v1-abcdefabcdef0123456789"),
        "+provider.headers.Authorization=Bearer abcdefghijkl",
        "provider.headers.X-Api-Key=whatever",
        "+provider.api_key=x",
        ("dataset.path=sk" + "-or-v1-abcdefabcdef0123456789"),
        "provider.api_key_env=not a variable name",
    ]:
        assert key_in_overrides([bad], env), bad
