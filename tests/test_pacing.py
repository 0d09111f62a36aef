"""Requests paced ahead of the provider's limits (providers/pacing.py, provider.rpm/tpm).

The pacing logic on a fake clock: a simulation of many requests with random latencies,
where the provider stamps each request at some moment between its sending and its answer,
never sees more than the limits in any window; tokens count the worst case when sent and
the usage once answered. Then over real HTTP: the fake OpenRouter enforcing the same limits
answers no 429 to a paced run, and does to the same run unpaced.
"""

from __future__ import annotations

import asyncio
import heapq
import random
from pathlib import Path

import pytest

from kimi_pipe.errors import ConfigError
from kimi_pipe.providers.pacing import Pacer, shared_pacer
from kimi_pipe.providers.settings import ProviderSettings
from tests.support.conftest_generate import read_jsonl, run_prompts
from tests.support.fake_openrouter import Behaviour


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.now += s


def test_requests_wait_for_the_window_and_usage_corrects_the_tokens() -> None:
    clock = Clock()
    p = Pacer(rpm=2, tpm=None, window_s=10.0, clock=clock, sleep=clock.sleep)
    a, b = p.take(1), p.take(1)
    assert p.delay(1) == float("inf")  # both in flight: only an answer frees the window
    clock.now = 3.0
    p.done(a, None)
    assert p.delay(1) == pytest.approx(10.0)  # a expires a window after its answer
    p.done(b, None)
    third = asyncio.run(p.acquire(1))
    assert clock.now == pytest.approx(13.0) and p.paced == 1 and p.waited_s == pytest.approx(10.0)
    assert third in p.ledger and a not in p.ledger

    clock = Clock()
    t = Pacer(rpm=None, tpm=1000, window_s=60.0, clock=clock, sleep=clock.sleep)
    first = t.take(600)  # worst case when sent
    assert t.delay(600) == float("inf")
    t.done(first, 200)  # its usage: 200 tokens
    assert t.delay(600) == 0.0  # 200 + 600 fit
    t.take(600)
    assert t.delay(300) == pytest.approx(60.0)  # 200 + 600 + 300: wait for `first` to expire
    # A request larger than the limit alone goes when the window is empty, never stalls.
    clock.now = 1000.0
    lone = Pacer(rpm=None, tpm=100, window_s=60.0, clock=clock, sleep=clock.sleep)
    assert lone.delay(500) == 0.0
    lone.done(lone.take(500), None)
    assert lone.delay(500) == pytest.approx(60.0)


@pytest.mark.parametrize("seed", range(4))
def test_no_window_the_provider_counts_ever_holds_more_than_the_limits(seed: int) -> None:
    """Discrete-event simulation: 12 workers, random latencies; the provider stamps each
    request at a random moment between sending and answer, and counts (like the fake
    OpenRouter) requests, and prompt tokens of those not yet answered plus prompt +
    completion of those answered, over the window before each arrival."""
    rng = random.Random(seed)
    clock = Clock()
    rpm, tpm, window, max_tokens = 7, 3000, 5.0, 400
    pacer = Pacer(rpm, tpm, window, clock=clock, sleep=clock.sleep)
    events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, worker)
    arrivals: list[tuple[float, int, int, float]] = []  # (arrival, prompt, used, answered at)
    inflight: dict[int, tuple] = {}
    seq = 0
    for w in range(12):
        heapq.heappush(events, (0.0, seq := seq + 1, "try", w))
    sent = 0
    while events and sent < 300:
        t, _, kind, w = heapq.heappop(events)
        clock.now = max(clock.now, t)
        if kind == "done":
            slot, prompt, used, arrival = inflight.pop(w)
            pacer.done(slot, prompt + used)
            arrivals.append((arrival, prompt, prompt + used, clock.now))
            heapq.heappush(events, (clock.now, seq := seq + 1, "try", w))
            continue
        prompt = rng.randint(50, 600)
        wait = pacer.delay(prompt + max_tokens)
        if wait > 0:
            if wait != float("inf"):
                heapq.heappush(events, (clock.now + wait, seq := seq + 1, "try", w))
            else:  # retried at the next answer: requeue behind the earliest done event
                heapq.heappush(events, (clock.now + 0.01, seq := seq + 1, "try", w))
            continue
        slot = pacer.take(prompt + max_tokens)
        sent += 1
        latency = rng.uniform(0.05, 3.0)
        arrival = clock.now + rng.uniform(0.0, latency)
        inflight[w] = (slot, prompt, rng.randint(0, max_tokens), arrival)
        heapq.heappush(events, (clock.now + latency, seq := seq + 1, "done", w))
    assert sent == 300
    for a, prompt, _, _ in arrivals:
        before = [x for x in arrivals if a - window < x[0] <= a]
        assert len(before) <= rpm
        # Tokens: each earlier arrival by what the provider knows at `a`.
        tokens = sum(used if done <= a else p for (x, p, used, done) in before if x != a)
        assert tokens + prompt <= tpm


def test_runs_one_after_another_in_a_process_share_the_ledger() -> None:
    """The datasets of a job are runs one after another: the second must count what the
    first sent in the window, not start from an empty ledger."""
    first = shared_pacer("http://p/v1", 3, None, 60.0)
    assert shared_pacer("http://p/v1", 3, None, 60.0) is first
    assert shared_pacer("http://q/v1", 3, None, 60.0) is not first
    assert shared_pacer("http://p/v1", 4, None, 60.0) is not first


def test_provider_rate_settings_are_checked() -> None:
    base = {"name": "p", "model": "m", "api_key_env": None}
    s = ProviderSettings.from_config({**base, "rpm": 60, "tpm": 100000})
    assert (s.rpm, s.tpm, s.rate_window_s) == (60, 100000, 60.0)
    assert ProviderSettings.from_config(base).rpm is None
    for bad in ({"rpm": 0}, {"tpm": 1.5}, {"rate_window_s": 0}, {"rpm": True}):
        with pytest.raises(ConfigError):
            ProviderSettings.from_config({**base, **bad})


@pytest.mark.usefixtures("api_key_env")
def test_a_paced_run_gets_no_429_from_a_provider_with_the_same_limits(
    tmp_path: Path, fake_openrouter, kimi_dir: Path
) -> None:
    limits = {"rpm_limit": 4, "tpm_limit": 900, "rate_window_s": 1.0}
    srv = fake_openrouter(default=Behaviour(**limits))
    paced = ["provider.rpm=4", "provider.tpm=900", "provider.rate_window_s=1.0"]
    common = ["provider.params.max_tokens=128", "budget.slow_start=false"]
    status, summary, out, ids = run_prompts(
        tmp_path, srv.url(), kimi_dir, n=16, extra=[*common, *paced], name="paced"
    )
    assert status == 0 and summary is not None
    assert srv.rate_refused == 0 and all(r.mode == "ok" for r in srv.requests)
    assert len(srv.requests) == 16 and len(read_jsonl(out / "records.jsonl")) == 16
    assert summary["this_run"]["paced"]["requests_waited"] > 0
    assert summary["this_run"]["retries"] == 0

    # The same run without pacing (concurrency 8) runs into the limits: 429s, retried.
    srv2 = fake_openrouter(default=Behaviour(**limits))
    status, summary, out, _ = run_prompts(
        tmp_path, srv2.url(), kimi_dir, n=16, extra=common, name="unpaced"
    )
    assert srv2.rate_refused > 0 and summary is not None
    assert summary["this_run"]["paced"] is None and summary["this_run"]["retries"] > 0
