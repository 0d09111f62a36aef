"""Sending the prompts: `Dispatch` reserves each prompt's worst case, sends it through
LiteLLM within the concurrency window and the provider's pacing, books every attempt in the
spend journal and hands each purchase to `Outcomes`. A part of `Generator`
(generation/buying.py), made once the run's budget is known."""

from __future__ import annotations

import asyncio
import random
import warnings
from pathlib import Path
from typing import Any

from kimi_pipe.core.answer_checks import TextRepair
from kimi_pipe.core.issue_codes import Code
from kimi_pipe.generation.outcomes import Outcomes, TokenCore, _error_record, _repaired
from kimi_pipe.generation.spending import REMAINING, Spending
from kimi_pipe.progress import Progress, Snapshot
from kimi_pipe.providers.budget import BudgetGate, Reservation, SlowStart
from kimi_pipe.providers.calls import BILLED_UNSEEN, OVERBILLED, Attempt, call_with_retries
from kimi_pipe.providers.errors import ErrorInfo
from kimi_pipe.providers.pacing import Pacer, Sent
from kimi_pipe.providers.settings import ProviderSettings
from kimi_pipe.store.records import RecordWriter
from kimi_pipe.store.records_index import IndexedRecordWriter


class Dispatch:
    """The buying loop of one run: which prompt goes next, how many are in flight, the
    retries of each, and the progress line."""

    def __init__(
        self,
        settings: ProviderSettings,
        key: str,
        request: dict[str, Any],
        *,
        core: TokenCore,
        spending: Spending,
        outcomes: Outcomes,
        gate: BudgetGate,
        window: SlowStart,
        pacer: Pacer | None,
        rng: random.Random,
        stop_event: asyncio.Event,
        http_client: Any,
        progress: Progress,
        total: int,
    ) -> None:
        self.settings = settings
        self.key = key
        self.request = request
        self.core = core
        self.spending = spending
        self.outcomes = outcomes
        self.stats = spending.stats
        self.gate = gate
        self.window = window  # slow start: 1 request in flight at first where money is capped
        self.pacer = pacer  # within provider.rpm / tpm (None: unset)
        self.rng = rng
        self.stop_event = stop_event
        self.http_client = http_client  # made in the running event loop; closed by its maker
        self.progress = progress
        self.total = total

    async def buy(
        self,
        prompts: Any,
        done_ids: Any,
        attempts_before: Any,
        records_path: Path,
        errors_path: Path,
    ) -> None:
        """Buy every prompt not in `done_ids` (bought before), until the budget, the
        provider or an outcome stops the run."""
        spending, gate, sem = self.spending, self.gate, self.window
        budget, prices = spending.budget, spending.prices
        max_tokens = prices.max_tokens
        max_per_sample = spending.caps.max_usd_per_sample
        tasks: set[asyncio.Task] = set()
        poller = asyncio.create_task(spending.poll_key()) if spending.key_start else None
        max_attempts = self.settings.retry.max_attempts
        with IndexedRecordWriter(records_path) as writer, RecordWriter(errors_path) as err_writer:
            try:
                for prompt in prompts:
                    if prompt.id in done_ids:
                        self.stats.skipped_done += 1
                        continue
                    if self.stop_event.is_set():
                        break
                    prior = attempts_before[prompt.id]
                    if prior >= max_attempts:
                        # Bought max_attempts times over all runs (kills, unreadable answers):
                        # recorded as failed, never bought again.
                        err = ErrorInfo(
                            "attempts_exhausted",
                            None,
                            (
                                f"{prior} attempts billed over earlier runs "
                                f"(provider.retry.max_attempts={max_attempts})"
                            ),
                            "fail",
                        )
                        writer.append(_error_record(prompt, self.request, err, 0))
                        self.stats.failed[err.cls] += 1
                        self.stats.attempts_exhausted += 1
                        continue
                    await sem.acquire()
                    if self.stop_event.is_set():
                        sem.release()
                        break
                    repair = TextRepair()
                    try:
                        prompt = _repaired(prompt, repair)
                        n_prompt = self.core.prompt_len(prompt.messages, prompt.tools)
                    except Exception as exc:  # noqa: BLE001 - a bad row, not a bad run
                        sem.release()
                        err = ErrorInfo(Code.BAD_PROMPT, None, str(exc)[:500], "fail")
                        writer.append(_error_record(prompt, self.request, err, 0))
                        self.stats.failed[Code.BAD_PROMPT] += 1
                        continue
                    worst = prices.worst_case(n_prompt)
                    if max_per_sample is not None and worst > float(max_per_sample):
                        sem.release()
                        spending.skip_over_budget(
                            prompt.id, worst, "budget.max_usd_per_sample", float(max_per_sample)
                        )
                        continue
                    res = await gate.reserve(worst, max_tokens)
                    if res is None:
                        sem.release()
                        if self.stop_event.is_set():
                            break  # the provider stopped us
                        blocker = budget.blocker(worst, max_tokens, True)
                        if blocker == "budget_usd" and budget.exhausted() is None:
                            # This sample alone is too big for what is left; smaller ones
                            # after it may still fit.
                            # Nothing is in flight: the cap compares this one reservation,
                            # held at the budget's multiple, with what is left.
                            left = (budget.cap_usd or 0.0) - budget.counted_spent_usd
                            spending.skip_over_budget(
                                prompt.id, worst, REMAINING, left, budget.held(worst)
                            )
                            continue
                        spending.stop_for_budget(worst)
                        break
                    task = asyncio.create_task(
                        self._one(
                            prompt,
                            worst,
                            n_prompt,
                            res,
                            writer,
                            err_writer,
                            prior,
                            [Code.PROMPT_TEXT_REPLACED] if repair.surrogates else [],
                        )
                    )
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    self.show()
                if tasks:
                    await asyncio.gather(*list(tasks))
            except (asyncio.CancelledError, KeyboardInterrupt, OSError) as exc:
                # Interrupted, or the host failed a write (a full disk): requests in flight
                # are cancelled; their journal intents are booked on the next start.
                self.stats.stop_reason = self.stats.stop_reason or (
                    "host_error" if isinstance(exc, OSError) else "interrupted"
                )
                gate.close()
                # A request cancelled while LiteLLM was building it leaves its coroutine
                # unawaited: Python would warn of it at exit, after the one-line error.
                warnings.filterwarnings(
                    "ignore", "coroutine '.*' was never awaited", RuntimeWarning
                )
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*list(tasks), return_exceptions=True)
                raise
            finally:
                if poller is not None:
                    poller.cancel()
                self.progress.close()

    async def _one(
        self,
        prompt: Any,
        worst: float,
        n_prompt: int,
        first: Reservation,
        writer: RecordWriter,
        err_writer: RecordWriter,
        prior_attempts: int,
        flags: list[str],
    ) -> None:
        self.stats.in_flight += 1
        pending: list[Reservation] = [first]
        gate, sem, pacer = self.gate, self.window, self.pacer
        journal, budget, prices = self.spending.journal, self.spending.budget, self.spending.prices
        max_tokens = prices.max_tokens
        seqs: dict[int, int] = {}  # id(reservation) -> journal sequence number
        paced: dict[int, Sent] = {}  # id(reservation) -> its request in the pacer's ledger
        answered: list[int] = []  # the sequence number settled once the record is written

        async def reserve() -> Reservation | None:
            res = pending.pop() if pending else await gate.reserve(worst, max_tokens)
            if res is not None:
                if pacer is not None:  # within provider.rpm / tpm, counted as sent now
                    paced[id(res)] = await pacer.acquire(n_prompt + max_tokens)
                # Write-ahead: on disk before the request leaves, at the multiple of its worst
                # case the budget holds for it.
                seqs[id(res)] = journal.intent(
                    prompt.id, prior_attempts + len(seqs) + 1, res.usd * budget.overbill_ratio
                )
            return res

        def settle(res: Reservation, attempt: Attempt, done: bool) -> None:
            self.stats.attempts += 1
            self.stats.output_tokens += attempt.completion_tokens
            gate.settle(res, attempt.cost, attempt.completion_tokens, done)
            sem.settled(OVERBILLED in attempt.billing_flags)
            if pacer is not None:
                # What the tokens limit counts of it: its usage, where the answer says.
                used = attempt.prompt_tokens is not None or attempt.completion_tokens > 0
                sent = attempt.prompt_tokens if attempt.prompt_tokens is not None else n_prompt
                pacer.done(paced[id(res)], sent + attempt.completion_tokens if used else None)
            seq = seqs[id(res)]
            if done:
                journal.generation(seq, attempt.generation_id, attempt.cost)
                answered.append(seq)
            else:
                billed = attempt.cost > 0 or (
                    attempt.error is not None and attempt.error.cls in BILLED_UNSEEN
                )
                journal.settle(seq, attempt.cost, billed)

        def on_failed(err: ErrorInfo, attempt: int, cost: float, tokens: int) -> None:
            # Logged at once with what it cost: money billed for a failed attempt is kept
            # in the spend even if the process dies before the sample finishes.
            err_writer.append(
                {
                    "id": prompt.id,
                    "attempt": attempt,
                    "error": err.to_record(),
                    "action": err.action,
                    "cost": cost,
                    "usage": {"completion_tokens": tokens},
                }
            )
            if err.action == "retry" and attempt < self.settings.retry.max_attempts:
                self.stats.retries += 1

        try:
            result = await call_with_retries(
                self.settings,
                self.key,
                prompt.messages,
                prompt.tools,
                reserve,
                settle,
                self.rng,
                prices.fallback,
                on_failed,
                self.stop_event,
                max_attempts=max(1, self.settings.retry.max_attempts - prior_attempts),
                http_client=self.http_client,
                price_floor=prices.floor,
            )
        finally:
            if pending:  # never used: give the first reservation back
                gate.settle(first, 0.0, 0, False)
            self.stats.in_flight -= 1
            sem.release()
        self.outcomes.finish(prompt, result, self.core, writer, gate, flags)
        for seq in answered:  # booked only now that the answer is on disk
            journal.settle(seq, result.cost, True)
        self.show()

    def show(self) -> None:
        b = self.spending.budget
        done = self.stats.skipped_done + self.stats.answered + sum(self.stats.failed.values())
        self.progress.update(
            Snapshot(
                done=done,
                total=self.total,
                spent_usd=b.spent_usd,
                cap_usd=b.cap_usd,
                output_tokens=self.stats.output_tokens,
                retries=self.stats.retries,
                failures=sum(self.stats.failed.values()),
                in_flight=self.stats.in_flight,
            )
        )
