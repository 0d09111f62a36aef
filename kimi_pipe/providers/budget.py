"""Reservation-based hard caps for a generate run (USD, samples, output tokens).

Before a request goes out its worst case is reserved (prompt tokens x input price +
max_tokens x output price); when it returns, the reservation is settled to what it really
cost. `spent + reserved` never exceeds the cap, so the money spent cannot exceed it either,
however many requests are in flight. An answer billed above its reservation raises
`overbill_ratio`: every reservation still in flight, and every new one, then counts at that
multiple, so dispatch pauses instead of running past the cap at a provider that bills more
than its prices say; `overbill_guard` holds them at a multiple from the first request on,
before any answer has shown a ratio. `floor_spent_usd` lets an outside count (the key's usage at the
provider) raise the spend the caps see.
All methods are synchronous and hold a lock: safe from asyncio tasks and from threads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any

from kimi_pipe.config import node_settings
from kimi_pipe.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BudgetSettings:
    """The `budget` config node (conf/budget/default.yaml), checked: a cap of 0 or below,
    or a multiple below 1, is a mistake said before anything is bought, not a run that
    stops at once and exits 0."""

    usd: float | None = None
    max_samples: int | None = None
    max_output_tokens: int | None = None
    reserve_factor: float = 1.0
    overbill_guard: float = 1.0
    slow_start: bool = True
    max_usd_per_sample: float | None = None
    key_poll_s: float = 10.0

    def check(self) -> BudgetSettings:
        positive = {
            "usd": "give a positive USD cap, or null for none",
            "max_usd_per_sample": "give a positive USD cap per sample, or null for none",
            "key_poll_s": "give the seconds between reads of the key's usage",
        }
        for key, what in positive.items():
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ConfigError(f"budget.{key}={value:g}: {what}")
        for key in ("max_samples", "max_output_tokens"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"budget.{key}={value}: give a whole number >= 1, or null")
        for key in ("reserve_factor", "overbill_guard"):
            value = getattr(self, key)
            if not value >= 1.0:  # NaN too
                raise ConfigError(
                    f"budget.{key}={value:g}: give a multiple >= 1 of each request's worst "
                    "case (below 1 a request could cost more than the budget held for it)"
                )
        return self


def budget_settings(cfg: Any) -> BudgetSettings:
    """The composed config's checked `budget` node; a ConfigError names a wrong value."""

    return node_settings(cfg, "budget", BudgetSettings).check()


@dataclass(frozen=True)
class Pricing:
    input_per_token: float  # USD
    output_per_token: float  # USD

    def worst_case(self, prompt_tokens: int, max_tokens: int, factor: float = 1.0) -> float:
        return (prompt_tokens * self.input_per_token + max_tokens * self.output_per_token) * factor


@dataclass
class Reservation:
    usd: float
    output_tokens: int
    sample: bool  # whether this reservation holds one of `max_samples`
    settled: bool = False


class Budget:
    def __init__(
        self,
        usd: float | None,
        max_samples: int | None = None,
        max_output_tokens: int | None = None,
        spent_usd: float = 0.0,
        done_samples: int = 0,
        used_output_tokens: int = 0,
        overbill_guard: float = 1.0,
    ) -> None:
        self.cap_usd = usd
        self.max_samples = max_samples
        self.max_output_tokens = max_output_tokens
        self.spent_usd = spent_usd  # settled money, earlier runs included
        self.reserved_usd = 0.0
        self.done_samples = done_samples
        self.reserved_samples = 0
        self.used_output_tokens = used_output_tokens
        self.reserved_output_tokens = 0
        self.overruns = 0  # answers that cost more than their reservation
        self.overbill_ratio = 1.0  # largest cost / reservation seen (>= 1)
        # In-flight reservations count at least this multiple from the first request on: a
        # provider that bills up to this much over its prices cannot push spend past the cap
        # before its first answer shows the ratio.
        self.overbill_guard = max(1.0, float(overbill_guard))
        self.floor_spent_usd = 0.0  # spend proven by an outside count (the key's usage)
        self._lock = threading.Lock()

    def blocker(self, usd: float, output_tokens: int, sample: bool) -> str | None:
        """Which cap a reservation of this size would cross right now (None: it fits)."""
        with self._lock:
            return self._blocker(usd, output_tokens, sample)

    @property
    def counted_spent_usd(self) -> float:
        """The spend the caps see: ours, or the outside count when that is higher."""
        return max(self.spent_usd, self.floor_spent_usd)

    @property
    def hold_ratio(self) -> float:
        """The multiple of its worst case each request in flight is held at."""
        return max(self.overbill_ratio, self.overbill_guard)

    def held(self, usd: float) -> float:
        """What a reservation of `usd` counts as against `cap_usd` (what the cap compares)."""
        return usd * self.hold_ratio

    def hold_note(self) -> str:
        """Why reservations count above their worst case ("" when they do not): what a
        message comparing `held(usd)` with the budget says next to it."""
        ratio = self.hold_ratio
        if ratio <= 1.0:
            return ""
        if self.overbill_ratio > self.overbill_guard:
            why = f"an answer was billed {self.overbill_ratio:.2f}x its reservation"
        else:
            why = "budget.overbill_guard"
        return f"held at {ratio:.2f}x ({why})"

    def _blocker(self, usd: float, output_tokens: int, sample: bool) -> str | None:
        held = (self.reserved_usd + usd) * self.hold_ratio
        if self.cap_usd is not None and self.counted_spent_usd + held > self.cap_usd:
            return "budget_usd"
        if (
            sample
            and self.max_samples is not None
            and self.done_samples + self.reserved_samples + 1 > self.max_samples
        ):
            return "max_samples"
        if self.max_output_tokens is not None and (
            self.used_output_tokens + self.reserved_output_tokens + output_tokens
            > self.max_output_tokens
        ):
            return "max_output_tokens"
        return None

    def try_reserve(
        self, usd: float, output_tokens: int, sample: bool = True
    ) -> Reservation | None:
        with self._lock:
            if self._blocker(usd, output_tokens, sample) is not None:
                return None
            self.reserved_usd += usd
            self.reserved_output_tokens += output_tokens
            self.reserved_samples += int(sample)
            return Reservation(usd, output_tokens, sample)

    def settle(
        self, res: Reservation, cost_usd: float, output_tokens: int, sample_done: bool
    ) -> None:
        """Replace a reservation by what the attempt really used. `sample_done`: the sample
        is answered (it then counts against `max_samples`)."""
        with self._lock:
            if res.settled:
                return
            res.settled = True
            self.reserved_usd -= res.usd
            self.reserved_output_tokens -= res.output_tokens
            self.reserved_samples -= int(res.sample)
            self.spent_usd += cost_usd
            self.used_output_tokens += output_tokens
            self.done_samples += int(sample_done)
            if cost_usd > res.usd + 1e-12:
                self.overruns += 1
                if res.usd > 0:
                    self.overbill_ratio = max(self.overbill_ratio, cost_usd / res.usd)
                log.warning(
                    "an answer cost $%.6f, more than its reserved worst case $%.6f; requests "
                    "now reserve %.2fx their worst case; check provider.pricing and "
                    "budget.reserve_factor",
                    cost_usd,
                    res.usd,
                    self.overbill_ratio,
                )

    def raise_floor(self, spent_usd: float) -> None:
        """An outside count proves at least this much was spent (never lowers it)."""
        with self._lock:
            self.floor_spent_usd = max(self.floor_spent_usd, spent_usd)

    def outstanding(self) -> int:
        """Reservations not settled yet (requests in flight)."""
        with self._lock:
            return self.reserved_samples

    def exhausted(self) -> str | None:
        """A cap already reached with nothing reserved: no further request can fit."""
        with self._lock:
            if self.cap_usd is not None and self.counted_spent_usd >= self.cap_usd:
                return "budget_usd"
            if self.max_samples is not None and self.done_samples >= self.max_samples:
                return "max_samples"
            if self.max_output_tokens is not None and (
                self.used_output_tokens >= self.max_output_tokens
            ):
                return "max_output_tokens"
            return None


class BudgetGate:
    """Asyncio front of a `Budget`: `reserve` waits while requests in flight may still give
    money back, and returns None once the reservation can never fit."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self._changed: asyncio.Event | None = None
        self.closed = False

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    async def reserve(self, usd: float, output_tokens: int) -> Reservation | None:
        while not self.closed:
            res = self.budget.try_reserve(usd, output_tokens)
            if res is not None:
                return res
            if self.budget.outstanding() == 0:
                return None  # nothing in flight can free room: it will never fit
            event = self._event()
            await event.wait()
        return None

    def settle(self, res: Reservation, cost_usd: float, output_tokens: int, done: bool) -> None:
        self.budget.settle(res, cost_usd, output_tokens, done)
        self._wake()

    def close(self) -> None:
        """Stop handing out reservations (the run is stopping); wake every waiter."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        event, self._changed = self._changed, None
        if event is not None:
            event.set()


class SlowStart:
    """How many requests may be in flight: 1 at first, one more per attempt settled (so
    doubled each time a whole window has settled) while the largest bill/reservation ratio
    seen stays within the overbill guard, back to 1 on an answer billed above its
    reservation. A provider that
    bills far above its listed prices (20x, 100x) then shows it on one request, not on a
    wave of `maximum` requests already in flight: the cap is crossed by at most one
    request's true cost. `enabled=False`: `maximum` from the start."""

    def __init__(self, maximum: int, budget: Budget, enabled: bool = True) -> None:
        self.maximum = max(1, int(maximum))
        self.budget = budget
        self.limit = 1 if enabled else self.maximum
        self.peak = self.limit
        self.in_flight = 0
        self._changed: asyncio.Event | None = None

    async def acquire(self) -> None:
        while self.in_flight >= self.limit:
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        self._wake()

    def settled(self, overbilled: bool) -> None:
        """One attempt settled (`overbilled`: it cost more than its reservation)."""
        if overbilled:
            if self.limit > 1:
                log.warning(
                    "an answer was billed above its reservation: concurrency back to 1 (was %d)",
                    self.limit,
                )
            self.limit = 1
            return
        # One more slot per attempt settled within the guard (TCP's slow start): the window
        # doubles each time a whole window has settled, and a freed slot is refilled at
        # once instead of waiting for the slowest answer of the window.
        if self.limit < self.maximum and self.budget.overbill_ratio <= self.budget.overbill_guard:
            self.limit += 1
            self.peak = max(self.peak, self.limit)
            self._wake()

    def _wake(self) -> None:
        event, self._changed = self._changed, None
        if event is not None:
            event.set()
