"""Requests paced ahead of a provider's rate limits (`provider.rpm`, `provider.tpm`).

A provider states its limits per minute (requests, tokens) and answers 429 past them; a run
that only retries after the 429 wastes attempts and, with many requests in flight, keeps
hitting the wall. `Pacer` sends a request only when it fits both limits over the window
(`provider.rate_window_s`, 60 s by default).

It keeps a ledger of what was sent in the window, not a token bucket: a bucket that holds
a minute's worth and refills at the limit's rate lets up to twice the limit through in
some 60-second window (a full bucket spent at once, then a minute of refill), which a
provider counting a sliding window refuses. Here no window ever holds more than the limit:

* A request counts from when it is sent until `window_s` after its answer came back (while
  in flight it never expires). A provider stamps a request when it arrives, which is after
  it was sent and before the answer returns, so every request the provider still counts
  is one the ledger still counts.
* Tokens: a request counts its worst case when sent (prompt tokens + max_tokens), corrected
  to what its usage says once it returns (prompt + completion tokens); without usage (an
  error) it keeps its worst case.
* A request whose worst case alone exceeds the token limit is sent when nothing else is in
  the window (it could never fit; the provider decides), and said once.

The clock and the sleep are parameters, so the logic is tested with a fake clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class Sent:
    """One request in the ledger: its tokens, and when its answer came back (None: in
    flight, counted whatever the time)."""

    tokens: int
    done_at: float | None = None


class Pacer:
    def __init__(
        self,
        rpm: float | None,
        tpm: float | None,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.rpm, self.tpm, self.window_s = rpm, tpm, window_s
        self.clock, self.sleep = clock, sleep
        self.ledger: deque[Sent] = deque()
        self.waited_s = 0.0  # time requests spent waiting for the limits (summary)
        self.paced = 0  # requests that waited
        self._too_big_said = False

    @property
    def enabled(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    def _expire(self, now: float) -> None:
        """Drop requests answered more than a window ago (in flight: kept)."""
        keep = deque(s for s in self.ledger if s.done_at is None or s.done_at > now - self.window_s)
        self.ledger = keep

    def delay(self, tokens: int) -> float:
        """Seconds until a request of `tokens` (worst case) fits both limits; 0: now. Inf
        when it waits for requests in flight (their answers free the window)."""
        now = self.clock()
        self._expire(now)
        if not self.ledger:
            return 0.0  # an empty window: anything goes (a request over the tpm alone too)
        waits = [0.0]
        if self.rpm is not None and len(self.ledger) + 1 > self.rpm:
            waits.append(self._free_after(now, len(self.ledger) + 1 - int(self.rpm), None))
        if self.tpm is not None:
            used = sum(s.tokens for s in self.ledger)
            if used + tokens > self.tpm:
                waits.append(self._free_after(now, None, used + tokens - self.tpm))
        return max(waits)

    def _free_after(self, now: float, count: int | None, tokens: float | None) -> float:
        """Seconds until `count` requests, or `tokens` tokens, of the answered ones expire
        (earliest first); inf when that waits for requests in flight."""
        answered = sorted((s for s in self.ledger if s.done_at is not None), key=_done)
        freed_t = 0
        for freed_n, s in enumerate(answered, 1):
            freed_t += s.tokens
            if (count is not None and freed_n >= count) or (
                tokens is not None and freed_t >= tokens
            ):
                return max(0.0, _done(s) + self.window_s - now)
        if answered and len(answered) == len(self.ledger):
            # Nothing in flight: once every answered one expires the window is empty, and an
            # empty window takes any request.
            return max(0.0, _done(answered[-1]) + self.window_s - now)
        return float("inf")

    def take(self, tokens: int) -> Sent:
        """Book a request sent now (call when `delay` is 0)."""
        if self.tpm is not None and tokens > self.tpm and not self._too_big_said:
            self._too_big_said = True
            log.warning(
                "a request's worst case (%d tokens) exceeds provider.tpm=%g: sent alone",
                tokens,
                self.tpm,
            )
        sent = Sent(tokens)
        self.ledger.append(sent)
        return sent

    async def acquire(self, tokens: int, poll_s: float = 0.05) -> Sent:
        """Wait until a request of `tokens` fits both limits, then book it as sent. While it
        waits for answers in flight, it looks again every `poll_s`."""
        waited = 0.0
        while (wait := self.delay(tokens)) > 0:
            step = wait if wait != float("inf") else poll_s
            await self.sleep(step)
            waited += step
        if waited:
            self.waited_s += waited
            self.paced += 1
        return self.take(tokens)

    def done(self, sent: Sent, tokens: int | None) -> None:
        """The request's answer (or failure) came back: it expires a window from now; its
        tokens are what its usage said (None: unknown, its worst case stays)."""
        sent.done_at = self.clock()
        if tokens is not None:
            sent.tokens = tokens


def _done(s: Sent) -> float:
    assert s.done_at is not None
    return s.done_at


_SHARED: dict[tuple[str, int | None, int | None, float], Pacer] = {}


def shared_pacer(provider: str, rpm: int | None, tpm: int | None, window_s: float) -> Pacer:
    """The process's one ledger for a provider and its limits: runs one after the other in a
    process (the datasets of a job, a run resumed after serving=auto's route changed) count
    what the previous ones sent in the window. A new process starts with an empty ledger."""
    key = (provider, rpm, tpm, window_s)
    if key not in _SHARED:
        _SHARED[key] = Pacer(rpm, tpm, window_s)
    return _SHARED[key]
