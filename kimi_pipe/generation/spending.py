"""What the job pays: prices, worst cases, the key's own account, and what the budget says
when a sample does not fit. Two parts of `Generator` (generation/buying.py): `Prices`, made
once the prices are known, and `Spending`, made once the budget is."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kimi_pipe.generation.errors import GenerateError
from kimi_pipe.generation.stats import RunStats
from kimi_pipe.providers.account import Account, KeyStatus
from kimi_pipe.providers.budget import Budget, BudgetSettings, Pricing
from kimi_pipe.providers.money import usd, usd_pair
from kimi_pipe.store.spend_journal import SpendJournal

log = logging.getLogger("kimi_pipe.generate")

REMAINING = "the remaining budget"


class Prices:
    """The run's prices and what they make of tokens: fallbacks, floors, worst cases."""

    def __init__(
        self,
        pricing: Pricing,
        source: str,
        account: Account,
        key: str,
        max_tokens: int,
        reserve_factor: float,
    ) -> None:
        self.pricing = pricing
        self.source = source  # "config", "listing" or the fallback prices
        self.account = account
        self.key = key
        self.max_tokens = max_tokens
        self.reserve_factor = reserve_factor

    def fallback(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (
            prompt_tokens * self.pricing.input_per_token
            + completion_tokens * self.pricing.output_per_token
        )

    @property
    def floor(self) -> Callable[[int, int], float] | None:
        """Tokens x listed prices, below which no stated cost is believed; None with the
        fallback prices (set above the real ones on purpose: no floor)."""
        return self.fallback if self.source in ("config", "listing") else None

    async def generation_cost(self, generation_id: str) -> float | None:
        """What the provider says one generation cost, never below its tokens at the listed
        prices (None: it cannot say)."""
        bill = await self.account.generation_bill(self.key, generation_id)
        if bill is None or bill.usd is None:
            return None
        floor = self.floor
        if (
            floor is not None
            and bill.prompt_tokens is not None
            and (bill.completion_tokens is not None)
        ):
            return max(bill.usd, floor(bill.prompt_tokens, bill.completion_tokens))
        return bill.usd

    def worst_case(self, prompt_tokens: int) -> float:
        return self.pricing.worst_case(prompt_tokens, self.max_tokens, self.reserve_factor)


# --- the key's own account (OpenRouter GET /key) --------------------------------------
async def check_key(
    account: Account, key: str, budget: Budget, spent_before: float
) -> KeyStatus | None:
    """Read the key's usage and limit; refuse to start when its limit cannot cover what
    is left of budget.usd (the provider would stop us half-way, or worse, another
    client shares it)."""
    status = await account.key_status(key)
    if status is None:
        return None
    left = None if budget.cap_usd is None else budget.cap_usd - spent_before
    if status.limit is None:
        log.warning(
            "the API key has no credit limit: give the run's key a limit on "
            "OpenRouter (the one cap that holds whatever a client does)"
        )
    elif (
        left is not None and status.limit_remaining is not None and (status.limit_remaining < left)
    ):
        raise GenerateError(
            f"the API key's remaining credit limit ${status.limit_remaining:.4f} cannot "
            f"cover the run's remaining budget ${max(left, 0.0):.4f} (budget.usd="
            f"{budget.cap_usd}); lower budget.usd or raise the key's limit"
        )
    log.info("API key: $%.4f used, limit %s", status.usage, status.limit)
    return status


class Spending:
    """The money side of a run once its budget is known: the budget, its journal, the key's
    own count, and what is said when a sample does not fit."""

    def __init__(
        self,
        prices: Prices,
        caps: BudgetSettings,
        budget: Budget,
        journal: SpendJournal,
        stats: RunStats,
        *,
        spent_before: float,
        recovered: tuple[int, float],
        key_start: KeyStatus | None,
    ) -> None:
        self.prices = prices
        self.caps = caps
        self.budget = budget
        self.journal = journal
        self.stats = stats  # shared with the run's other parts
        self.spent_before = spent_before  # USD booked by earlier runs of this directory
        self.recovered = recovered  # (requests, USD) a killed run sent and never booked
        self.key_start = key_start  # None: the provider has no key account to read
        self.key_delta = 0.0  # USD the key's usage grew by during this run

    async def read_key_usage(self) -> None:
        """Count what the key says this run spent, when that is more than we counted."""
        if self.key_start is None:
            return
        status = await self.prices.account.key_status(self.prices.key)
        if status is None:
            return
        self.key_delta = max(self.key_delta, status.usage - self.key_start.usage)
        self.budget.raise_floor(self.spent_before + self.key_delta)
        # Kept in the journal: a resumed run starts from it, not from our lower count.
        self.journal.raise_floor(self.spent_before + self.key_delta)

    async def poll_key(self) -> None:
        every = self.caps.key_poll_s
        while True:
            await asyncio.sleep(every)
            await self.read_key_usage()

    def skip_over_budget(
        self, rid: str, worst: float, limit_name: str, limit: float, held: float | None = None
    ) -> None:
        """Say why a sample is skipped: the amount printed is the one compared with `limit`
        (`held`: its worst case at the multiple the budget holds requests at)."""
        s = self.stats
        s.skipped_over_budget += 1
        compared = worst if held is None else held
        if limit_name == REMAINING:
            s.stop_reason = s.stop_reason or "budget_usd"
            s.over_budget_usd += worst
            if s.over_budget_held_usd is None or compared < s.over_budget_held_usd:
                s.over_budget_held_usd, s.over_budget_left_usd = compared, limit
        # The first few say why; the rest (a nearly spent budget skips every sample) are
        # counted in the summary.
        level = logging.WARNING if s.skipped_over_budget <= 3 else logging.DEBUG
        amount, left = usd_pair(compared, limit)
        note = self.budget.hold_note() if compared != worst else ""
        what = f"{usd(worst)} is {note}: {amount}" if note else amount
        log.log(
            level,
            "%s skipped: its worst case %s, more than %s (%s); the run goes on",
            rid,
            what,
            limit_name,
            left,
        )

    def stop_for_budget(self, worst: float) -> None:
        reason = self.budget.blocker(worst, self.prices.max_tokens, True) or "budget_usd"
        self.stats.stop_reason = self.stats.stop_reason or reason
        b = self.budget
        held = b.held(worst)
        if reason == "budget_usd" and b.counted_spent_usd == 0 and b.cap_usd and held > b.cap_usd:
            # Said only where it is what stopped the run: nothing spent, one request too big.
            note = f" ({b.hold_note()}: {usd_pair(held, b.cap_usd)[0]})" if held != worst else ""
            self.stats.stop_message = (
                f"budget.usd=${b.cap_usd:g} is below one request's worst case "
                f"{usd(worst)}{note}; raise budget.usd or lower provider.params.max_tokens"
            )
        log.info("dispatch stopped: %s", self.stats.stop_message or reason)
