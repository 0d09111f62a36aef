"""The buying loop: `Generator` sends every prompt through LiteLLM under the budget,
books what each request cost in the spend journal and appends one record per prompt."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kimi_pipe.core.answer_checks import TextRepair
from kimi_pipe.generation.errors import GenerateError
from kimi_pipe.generation.outcomes import (
    Outcomes,
    TokenCore,
    _error_record,
    _repaired,
)
from kimi_pipe.generation.purchase import refuse_other_purchase
from kimi_pipe.generation.spending import REMAINING
from kimi_pipe.generation.summary import RunStats, RunSummary
from kimi_pipe.progress import Progress, Snapshot
from kimi_pipe.providers.account import KeyStatus, account_for
from kimi_pipe.providers.budget import (
    Budget,
    BudgetGate,
    Pricing,
    Reservation,
    SlowStart,
)
from kimi_pipe.providers.calls import (
    BILLED_UNSEEN,
    OVERBILLED,
    Attempt,
    call_with_retries,
    get_litellm,
    http_client_for,
)
from kimi_pipe.providers.costs import fetch_pricing
from kimi_pipe.providers.credentials import api_key
from kimi_pipe.providers.errors import (
    ErrorInfo,
)
from kimi_pipe.providers.pacing import Sent, shared_pacer
from kimi_pipe.store import atomic
from kimi_pipe.store.layout import ATTEMPT_ERRORS, RECORDS, SUMMARY
from kimi_pipe.store.prompt_datasets import load_prompts
from kimi_pipe.store.records import RecordWriter
from kimi_pipe.store.records_index import IndexedRecordWriter, load_resume_index
from kimi_pipe.store.spend_journal import JOURNAL, SpendJournal

if TYPE_CHECKING:
    from kimi_pipe.generation.job import GenerateJob

log = logging.getLogger("kimi_pipe.generate")


class Generator(Outcomes, RunSummary):
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
        self.reserve_factor = self.caps.reserve_factor
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
        self.total = 0
        self.key_start: KeyStatus | None = None
        self.key_delta = 0.0  # USD the key's usage grew by during this run
        self.recovered: tuple[int, float] = (0, 0.0)
        self.spent_before = 0.0
        self.skipped_examples: dict[str, list[str]] = {}
        self.http_client: Any = None  # made in the running event loop (_run), closed by run()

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
            self.total = len(prompts)
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
        in_price, out_price, self.price_source = await fetch_pricing(self.settings, self.key)
        self.pricing = Pricing(in_price, out_price)
        with SpendJournal(self.run_dir / JOURNAL) as journal:
            self.journal = journal
            # Requests a killed process sent and never booked: their true cost where the
            # provider can say, else their worst case.
            self.recovered = await journal.recover(self._generation_cost)
            self.spent_before = max(index.cost, journal.spent())
            if index.records or self.spent_before:
                log.info(
                    "resuming %s: %d ids done, $%.4f already spent%s",
                    self.run_dir,
                    len(index.ids),
                    self.spent_before,
                    " (torn last line ignored)" if index.torn_tail else "",
                )
            self.attempts_before = journal.billed_attempts()
            try:
                return await self._run(core, prompts, index, records_path, errors_path)
            finally:
                # Closed whatever ended the run (a full disk too): else its connections are
                # reported as "Unclosed client session" tracebacks after the one-line error.
                if self.http_client is not None:
                    await self.http_client.close()

    async def _run(
        self, core: TokenCore, prompts: Any, index: Any, records_path: Path, errors_path: Path
    ) -> dict[str, Any]:
        b = self.caps
        budget = Budget(
            b.usd,
            b.max_samples,
            b.max_output_tokens,
            spent_usd=self.spent_before,
            done_samples=index.answered,
            used_output_tokens=index.output_tokens,
            overbill_guard=b.overbill_guard,
        )
        self.budget = budget
        self.key_start = await self._check_key()
        self.http_client = http_client_for(self.settings)
        gate = BudgetGate(budget)
        max_per_sample = b.max_usd_per_sample
        log.info(
            "generate: %d prompts, %d already done; provider %s (%s), concurrency %d, "
            "budget $%s (spent $%.4f), prices $%.3f/$%.3f per Mtok (%s)",
            self.total,
            len(index.ids),
            self.settings.name,
            self.settings.api_base,
            self.settings.concurrency,
            b.usd,
            self.spent_before,
            self.pricing.input_per_token * 1e6,
            self.pricing.output_per_token * 1e6,
            self.price_source,
        )

        self.startup_s = time.monotonic() - self.stats.started
        self.stats.started = time.monotonic()  # throughput counts from the first dispatch
        # Slow start: where money is capped, 1 request in flight at first (budget.slow_start).
        sem = self.window = SlowStart(
            self.settings.concurrency,
            budget,
            enabled=b.slow_start and budget.cap_usd is not None,
        )
        tasks: set[asyncio.Task] = set()
        poller = asyncio.create_task(self._poll_key()) if self.key_start else None
        max_attempts = self.settings.retry.max_attempts
        with IndexedRecordWriter(records_path) as writer, RecordWriter(errors_path) as err_writer:
            try:
                for prompt in prompts:
                    if prompt.id in index.ids:
                        self.stats.skipped_done += 1
                        continue
                    if self.stop_event.is_set():
                        break
                    prior = self.attempts_before[prompt.id]
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
                        n_prompt = core.prompt_len(prompt.messages, prompt.tools)
                    except Exception as exc:  # noqa: BLE001 - a bad row, not a bad run
                        sem.release()
                        err = ErrorInfo("bad_prompt", None, str(exc)[:500], "fail")
                        writer.append(_error_record(prompt, self.request, err, 0))
                        self.stats.failed["bad_prompt"] += 1
                        continue
                    worst = self._worst_case(n_prompt)
                    if max_per_sample is not None and worst > float(max_per_sample):
                        sem.release()
                        self._skip_over_budget(
                            prompt.id, worst, "budget.max_usd_per_sample", float(max_per_sample)
                        )
                        continue
                    res = await gate.reserve(worst, self.max_tokens)
                    if res is None:
                        sem.release()
                        if self.stop_event.is_set():
                            break  # the provider stopped us
                        blocker = budget.blocker(worst, self.max_tokens, True)
                        if blocker == "budget_usd" and budget.exhausted() is None:
                            # This sample alone is too big for what is left; smaller ones
                            # after it may still fit.
                            # Nothing is in flight: the cap compares this one reservation,
                            # held at the budget's multiple, with what is left.
                            left = (budget.cap_usd or 0.0) - budget.counted_spent_usd
                            self._skip_over_budget(
                                prompt.id, worst, REMAINING, left, budget.held(worst)
                            )
                            continue
                        self._stop_for_budget(worst)
                        break
                    task = asyncio.create_task(
                        self._one(
                            prompt,
                            worst,
                            n_prompt,
                            res,
                            gate,
                            core,
                            writer,
                            err_writer,
                            sem,
                            prior,
                            ["prompt_text_replaced"] if repair.surrogates else [],
                        )
                    )
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    self._show()
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
        await self._read_key_usage()
        self.stats.stop_reason = self.stats.stop_reason or "done"
        if self.stats.skipped_over_budget and not self.stats.stop_message:
            held = f", {note}," if (note := self.budget.hold_note()) else ""
            overbilled = self.budget.overbill_ratio > self.budget.overbill_guard
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
        # Which rows (line-N of dataset.path) were skipped, so they can be found and fixed.
        self.skipped_examples = {k: list(v) for k, v in prompts.skipped_examples.items()}
        summary = self.summary(records_path, errors_path, prompts.skipped)
        atomic.write_json(self.run_dir / SUMMARY, summary, suffix=".partial", indent=2)
        return summary

    async def _one(
        self,
        prompt: Any,
        worst: float,
        n_prompt: int,
        first: Reservation,
        gate: BudgetGate,
        core: TokenCore,
        writer: RecordWriter,
        err_writer: RecordWriter,
        sem: SlowStart,
        prior_attempts: int,
        flags: list[str],
    ) -> None:
        self.stats.in_flight += 1
        pending: list[Reservation] = [first]
        journal = self.journal
        seqs: dict[int, int] = {}  # id(reservation) -> journal sequence number
        paced: dict[int, Sent] = {}  # id(reservation) -> its request in the pacer's ledger
        answered: list[int] = []  # the sequence number settled once the record is written

        async def reserve() -> Reservation | None:
            res = pending.pop() if pending else await gate.reserve(worst, self.max_tokens)
            if res is not None:
                if self.pacer is not None:  # within provider.rpm / tpm, counted as sent now
                    paced[id(res)] = await self.pacer.acquire(n_prompt + self.max_tokens)
                # Write-ahead: on disk before the request leaves, at the multiple of its worst
                # case the budget holds for it.
                seqs[id(res)] = journal.intent(
                    prompt.id, prior_attempts + len(seqs) + 1, res.usd * self.budget.overbill_ratio
                )
            return res

        def settle(res: Reservation, attempt: Attempt, done: bool) -> None:
            self.stats.attempts += 1
            self.stats.output_tokens += attempt.completion_tokens
            gate.settle(res, attempt.cost, attempt.completion_tokens, done)
            self.window.settled(OVERBILLED in attempt.billing_flags)
            if self.pacer is not None:
                # What the tokens limit counts of it: its usage, where the answer says.
                used = attempt.prompt_tokens is not None or attempt.completion_tokens > 0
                sent = attempt.prompt_tokens if attempt.prompt_tokens is not None else n_prompt
                self.pacer.done(paced[id(res)], sent + attempt.completion_tokens if used else None)
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
                self._price_fallback,
                on_failed,
                self.stop_event,
                max_attempts=max(1, self.settings.retry.max_attempts - prior_attempts),
                http_client=self.http_client,
                price_floor=self.price_floor,
            )
        finally:
            if pending:  # never used: give the first reservation back
                gate.settle(first, 0.0, 0, False)
            self.stats.in_flight -= 1
            sem.release()
        self._finish(prompt, result, core, writer, gate, flags)
        for seq in answered:  # booked only now that the answer is on disk
            journal.settle(seq, result.cost, True)
        self._show()

    def _show(self) -> None:
        b = self.budget
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
