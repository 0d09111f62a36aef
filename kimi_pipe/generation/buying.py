"""The buying loop: `Generator` sends every prompt through LiteLLM under the budget,
books what each request cost in the spend journal and appends one record per prompt.

It is made of parts, each made once what it needs is known: `Prices` and `Spending`
(generation/spending.py: what the run pays, its budget and journal), `Outcomes`
(generation/outcomes.py: what each purchase becomes), `Dispatch` (generation/dispatch.py:
the loop that sends the prompts) and `run_summary` (generation/summary.py)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kimi_pipe.generation.dispatch import Dispatch
from kimi_pipe.generation.errors import GenerateError
from kimi_pipe.generation.outcomes import Outcomes, TokenCore
from kimi_pipe.generation.purchase import refuse_other_purchase
from kimi_pipe.generation.spending import Prices, Spending, check_key
from kimi_pipe.generation.stats import RunStats
from kimi_pipe.generation.summary import run_summary
from kimi_pipe.progress import Progress
from kimi_pipe.providers.account import account_for
from kimi_pipe.providers.budget import Budget, BudgetGate, Pricing, SlowStart
from kimi_pipe.providers.calls import get_litellm, http_client_for
from kimi_pipe.providers.costs import fetch_pricing
from kimi_pipe.providers.credentials import api_key
from kimi_pipe.providers.pacing import shared_pacer
from kimi_pipe.store import atomic
from kimi_pipe.store.layout import ATTEMPT_ERRORS, RECORDS, SUMMARY
from kimi_pipe.store.prompt_datasets import load_prompts
from kimi_pipe.store.records_index import load_resume_index
from kimi_pipe.store.spend_journal import JOURNAL, SpendJournal

if TYPE_CHECKING:
    from kimi_pipe.generation.job import GenerateJob

log = logging.getLogger("kimi_pipe.generate")


class Generator:
    """One generate run into `run_dir`: its settings are read here; its parts (prices,
    spending, outcomes, dispatch) are made in `run`, once what they need is known."""

    def __init__(
        self, job: GenerateJob, run_dir: Path, progress: Progress | None = None, route: Any = None
    ) -> None:
        self.job = job
        self.run_dir = run_dir
        self.route = route  # serving_auto.Route: the providers probed and their profiles
        self.settings = job.settings
        self.key = api_key(self.settings.api_key_env)  # first: a missing key stops before any work
        self.account = account_for(self.settings)
        self.request = self.settings.request_record()
        self.max_tokens = int(self.settings.params.get("max_tokens") or 0)
        self.caps = job.budget
        capped = [k for k in ("usd", "max_output_tokens") if getattr(self.caps, k) is not None]
        if capped and self.max_tokens <= 0:
            raise GenerateError(
                f"budget.{capped[0]} needs provider.params.max_tokens (the worst "
                "case of every request); set provider.params.max_tokens=N"
            )
        rates = self.settings
        if rates.tpm is not None and self.max_tokens <= 0:
            raise GenerateError(
                "provider.tpm needs provider.params.max_tokens (the worst case a request "
                "counts when sent); set provider.params.max_tokens=N"
            )
        # Requests paced ahead of the provider's limits (None: provider.rpm/tpm unset).
        key = rates.api_base or rates.name
        pacer = shared_pacer(key, rates.rpm, rates.tpm, rates.rate_window_s)
        self.pacer = pacer if pacer.enabled else None
        self.stats = RunStats()
        self.progress = progress or Progress()
        self.rng = random.Random(int(job.dataset.get("seed") or 0))
        self.stop_event = asyncio.Event()

    # --- main loop ----------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        records_path = self.run_dir / RECORDS
        errors_path = self.run_dir / ATTEMPT_ERRORS
        pinned_by_probes = bool(self.route and self.route.fits and not self.route.declared)
        refuse_other_purchase(records_path, self.request, ignore_pinning=pinned_by_probes)
        index = load_resume_index(records_path, errors_path)
        t0 = time.monotonic()
        try:
            core = TokenCore.load(self.job, self.settings.model, self.route)
            t1 = time.monotonic()
            prompts = load_prompts(self.job.dataset)
        except (ValueError, RuntimeError) as exc:  # bad model/dataset settings, dataset not
            raise GenerateError(str(exc)) from None  # reachable: the message says what to do
        t2 = time.monotonic()
        get_litellm()  # seconds of imports: pay them before the clock of the first request
        log.info(
            "start-up: model %.1fs, prompts %.1fs, litellm %.1fs",
            t1 - t0,
            t2 - t1,
            time.monotonic() - t2,
        )
        in_price, out_price, price_source = await fetch_pricing(self.settings, self.key)
        prices = Prices(
            Pricing(in_price, out_price),
            price_source,
            self.account,
            self.key,
            self.max_tokens,
            self.caps.reserve_factor,
        )
        with SpendJournal(self.run_dir / JOURNAL) as journal:
            # Requests a killed process sent and never booked: their true cost where the
            # provider can say, else their worst case.
            recovered = await journal.recover(prices.generation_cost)
            spent_before = max(index.cost, journal.spent())
            if index.records or spent_before:
                log.info(
                    "resuming %s: %d ids done, $%.4f already spent%s",
                    self.run_dir,
                    len(index.ids),
                    spent_before,
                    " (torn last line ignored)" if index.torn_tail else "",
                )
            b = self.caps
            budget = Budget(
                b.usd,
                b.max_samples,
                b.max_output_tokens,
                spent_usd=spent_before,
                done_samples=index.answered,
                used_output_tokens=index.output_tokens,
                overbill_guard=b.overbill_guard,
            )
            key_start = await check_key(self.account, self.key, budget, spent_before)
            spending = Spending(
                prices,
                b,
                budget,
                journal,
                self.stats,
                spent_before=spent_before,
                recovered=recovered,
                key_start=key_start,
            )
            http_client = http_client_for(self.settings)
            try:
                return await self._run(spending, core, prompts, index, http_client)
            finally:
                # Closed whatever ended the run (a full disk too): else its connections are
                # reported as "Unclosed client session" tracebacks after the one-line error.
                if http_client is not None:
                    await http_client.close()

    async def _run(
        self, spending: Spending, core: TokenCore, prompts: Any, index: Any, http_client: Any
    ) -> dict[str, Any]:
        records_path = self.run_dir / RECORDS
        errors_path = self.run_dir / ATTEMPT_ERRORS
        budget, prices = spending.budget, spending.prices
        log.info(
            "generate: %d prompts, %d already done; provider %s (%s), concurrency %d, "
            "budget $%s (spent $%.4f), prices $%.3f/$%.3f per Mtok (%s)",
            len(prompts),
            len(index.ids),
            self.settings.name,
            self.settings.api_base,
            self.settings.concurrency,
            self.caps.usd,
            spending.spent_before,
            prices.pricing.input_per_token * 1e6,
            prices.pricing.output_per_token * 1e6,
            prices.source,
        )

        startup_s = time.monotonic() - self.stats.started
        self.stats.started = time.monotonic()  # throughput counts from the first dispatch
        # Slow start: where money is capped, 1 request in flight at first (budget.slow_start).
        window = SlowStart(
            self.settings.concurrency,
            budget,
            enabled=self.caps.slow_start and budget.cap_usd is not None,
        )
        outcomes = Outcomes(
            self.settings, self.key, self.request, self.route, self.stop_event, self.stats, spending
        )
        dispatch = Dispatch(
            self.settings,
            self.key,
            self.request,
            core=core,
            spending=spending,
            outcomes=outcomes,
            gate=BudgetGate(budget),
            window=window,
            pacer=self.pacer,
            rng=self.rng,
            stop_event=self.stop_event,
            http_client=http_client,
            progress=self.progress,
            total=len(prompts),
        )
        attempts_before = spending.journal.billed_attempts()
        await dispatch.buy(prompts, index.ids, attempts_before, records_path, errors_path)
        await spending.read_key_usage()
        self.stats.stop_reason = self.stats.stop_reason or "done"
        if self.stats.skipped_over_budget and not self.stats.stop_message:
            held = f", {note}," if (note := budget.hold_note()) else ""
            overbilled = budget.overbill_ratio > budget.overbill_guard
            check = "check provider.pricing (answers cost more than listed), " if overbilled else ""
            self.stats.stop_message = (
                f"{self.stats.skipped_over_budget} samples skipped: their worst case alone "
                f"exceeds budget.max_usd_per_sample or{held} the remaining budget (they are "
                f"tried again on the next run); {check}raise budget.usd or lower "
                "provider.params.max_tokens"
            )
        if prompts.skipped:
            log.warning(
                "dataset rows that could not become prompts (skipped): %s; first rows: %s",
                dict(prompts.skipped),
                dict(prompts.skipped_examples),
            )
        summary = run_summary(
            self.job,
            self.run_dir,
            spending,
            records_path=records_path,
            errors_path=errors_path,
            prompts=len(prompts),
            skipped_rows=prompts.skipped,
            # Which rows (line-N of dataset.path) were skipped, so they can be found and fixed.
            skipped_examples={k: list(v) for k, v in prompts.skipped_examples.items()},
            startup_s=startup_s,
            concurrency=self.settings.concurrency,
            window=window,
            pacer=self.pacer,
        )
        atomic.write_json(self.run_dir / SUMMARY, summary, suffix=".partial", indent=2)
        return summary
