"""The generate job: buy model answers through LiteLLM under a hard USD cap and store them
with exact token ids, resumable (a killed run is finished by running it again). Its command
line, settings and what a run directory holds: kimi_pipe/stages/generate.py, docs/generate.md."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import random
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from kimi_pipe.config import CONF_DIR
from kimi_pipe.conformance import auto as serving_auto
from kimi_pipe.core.answer_checks import TextRepair, answer_issues, clean_text
from kimi_pipe.core.evidence import LADDER, evidence_of
from kimi_pipe.core.token_record import TokenRecord
from kimi_pipe.errors import (
    EXIT_ALL_FAILED,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    KimiPipeError,
    host_error,
    one_line,
)
from kimi_pipe.progress import Progress, Snapshot
from kimi_pipe.providers.account import KeyStatus, account_for
from kimi_pipe.providers.budget import (
    Budget,
    BudgetGate,
    Pricing,
    Reservation,
    SlowStart,
    budget_settings,
)
from kimi_pipe.providers.calls import (
    BILLED_UNSEEN,
    OVERBILLED,
    Attempt,
    CallResult,
    call_with_retries,
    get_litellm,
    http_client_for,
)
from kimi_pipe.providers.costs import fetch_pricing
from kimi_pipe.providers.credentials import api_key, key_in_overrides, refuse_secrets, scrub
from kimi_pipe.providers.errors import (
    NO_BUDGET,
    STOPPED,
    ErrorInfo,
)
from kimi_pipe.providers.money import usd, usd_pair
from kimi_pipe.providers.settings import ProviderSettings
from kimi_pipe.store import atomic
from kimi_pipe.store.layout import ATTEMPT_ERRORS, RECORDS, SUMMARY
from kimi_pipe.store.records import RecordWriter, iter_records, record_cost
from kimi_pipe.store.records_index import IndexedRecordWriter, load_resume_index
from kimi_pipe.store.run_dir import check_run_dir, same_dir
from kimi_pipe.store.run_lock import LOCK, RunLock
from kimi_pipe.store.spend_journal import JOURNAL, SpendJournal

# Buys serving=auto's probe battery: conformance/auto.py's `BuyBattery`.
BuyProbes = serving_auto.BuyBattery

log = logging.getLogger("kimi_pipe.generate")

# Every file a run writes in its directory: none may be a symlink.
RUN_FILES = (
    RECORDS,
    ATTEMPT_ERRORS,
    JOURNAL,
    SUMMARY,
    LOCK,
    RECORDS + ".torn",
    ATTEMPT_ERRORS + ".torn",
    JOURNAL + ".torn",
    SUMMARY + ".partial",
)
REMAINING = "the remaining budget"


class GenerateError(KimiPipeError, RuntimeError):
    """A start-up problem with a message for the user (exit status 2)."""


# ---------------------------------------------------------------------------------------
# The token core (models + render + reconstruction), wired in one place.


@dataclass
class TokenCore:
    prompt_len: Callable[[list[dict], list[dict] | None], int]
    reconstruct: Callable[..., TokenRecord]

    @classmethod
    def load(cls, cfg: DictConfig, asked_model: str = "", route: Any = None) -> TokenCore:
        from kimi_pipe.core.models import load_model
        from kimi_pipe.core.prompt_render import prompt_ids
        from kimi_pipe.core.record_builder import RecordBuilder

        model = load_model(cfg.model)
        builder = RecordBuilder.from_config(cfg, model)
        # Which serving profile each answer is undone with: the one fitted (serving=auto)
        # or declared for the provider that answered (conformance/auto.py).
        route = route or serving_auto.named(cfg)

        def prompt_len(messages: list[dict], tools: list[dict] | None) -> int:
            return len(prompt_ids(model, messages, tools))

        def rebuild(
            messages: list[dict], tools: list[dict] | None, resp: dict, request: dict | None = None
        ) -> TokenRecord:
            serving, spec, probe = route.profile_for(resp.get("provider"))
            record = replace(builder, serving=serving).build(messages, tools, resp, request)
            record |= {"serving_profile": spec, "serving_probe": probe}
            return _with_issues(record, answer_issues(resp, asked_model))

        return cls(prompt_len, rebuild)


# Codes about what an answer cost, not about its ids: the record stays as proven as it is.
MONEY_NOTES = frozenset({"cost_below_listed_price"})


def _with_issues(record: TokenRecord, issues: list[str]) -> TokenRecord:
    """Add error codes to a reconstructed record: it is no longer `ok` (rung unresolved)."""
    from kimi_pipe.core.record_builder import mark_flagged

    return mark_flagged(record, issues)


# ---------------------------------------------------------------------------------------
# Run state


@dataclass
class RunStats:
    started: float = field(default_factory=time.monotonic)
    answered: int = 0
    failed: Counter[str] = field(default_factory=Counter)  # this session, by error class
    given_up: int = 0  # retryable failures that ran out of attempts (tried again next run)
    attempts: int = 0
    retries: int = 0
    output_tokens: int = 0
    in_flight: int = 0
    skipped_done: int = 0
    stop_reason: str | None = None
    stop_message: str | None = None
    consecutive_failures: int = 0  # samples in a row that failed without retry
    skipped_over_budget: int = 0  # samples whose worst case alone cannot fit (tried next run)
    # Of those skipped for the remaining budget: their worst cases together, the smallest as
    # the budget held it, and what was left (what serving=auto says of probes that did not
    # fit; summary "this_run.over_budget").
    over_budget_usd: float = 0.0
    over_budget_held_usd: float | None = None
    over_budget_left_usd: float | None = None
    attempts_exhausted: int = 0  # ids bought retry.max_attempts times over all runs


def _repaired(prompt: Any, repair: TextRepair) -> Any:
    """The prompt with lone surrogates (a `\\ud800` escape, invalid UTF-8) replaced: what
    is sent, rendered and written is valid text; the record is flagged."""
    messages = clean_text(prompt.messages, None, repair)
    tools = clean_text(prompt.tools, None, repair)
    return replace(prompt, messages=messages, tools=tools) if repair.surrogates else prompt


def _error_record(prompt: Any, request: dict, err: ErrorInfo, attempts: int) -> TokenRecord:
    return {
        "id": prompt.id,
        "ok": False,
        "issues": [],
        "prompt_ids": [],
        "output_ids": [],
        "loss_mask": [],
        "completion_tokens_reported": None,
        "completion_tokens_reconstructed": 0,
        "messages": prompt.messages,
        "tools": prompt.tools,
        "request": request,
        "response": None,
        "usage": None,
        "cost": 0.0,
        "provider": None,
        "latency_s": None,
        "attempts": attempts,
        "error": err.to_record(),
    }


class Generator:
    def __init__(
        self, cfg: DictConfig, run_dir: Path, progress: Progress | None = None, route: Any = None
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.route = route  # serving_auto.Route: the providers probed and their profiles
        self.settings = ProviderSettings.from_config(cfg.provider)
        self.key = api_key(self.settings.api_key_env)  # first: a missing key stops before any work
        self.account = account_for(self.settings)
        self.request = self.settings.request_record()
        self.max_tokens = int(self.settings.params.get("max_tokens") or 0)
        self.caps = budget_settings(cfg)
        self.reserve_factor = self.caps.reserve_factor
        capped = [k for k in ("usd", "max_output_tokens") if getattr(self.caps, k) is not None]
        if capped and self.max_tokens <= 0:
            raise GenerateError(
                f"budget.{capped[0]} needs provider.params.max_tokens (the worst "
                "case of every request); set provider.params.max_tokens=N"
            )
        self.stats = RunStats()
        self.progress = progress or Progress()
        self.rng = random.Random(int(OmegaConf.select(cfg, "dataset.seed", default=0) or 0))
        self.stop_event = asyncio.Event()
        self.total = 0
        self.key_start: KeyStatus | None = None
        self.key_delta = 0.0  # USD the key's usage grew by during this run
        self.recovered: tuple[int, float] = (0, 0.0)
        self.spent_before = 0.0
        self.skipped_examples: dict[str, list[str]] = {}

    # --- budget -------------------------------------------------------------------------
    def _price_fallback(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (
            prompt_tokens * self.pricing.input_per_token
            + completion_tokens * self.pricing.output_per_token
        )

    @property
    def price_floor(self) -> Callable[[int, int], float] | None:
        """Tokens x listed prices, below which no stated cost is believed; None with the
        fallback prices (set above the real ones on purpose: no floor)."""
        return self._price_fallback if self.price_source in ("config", "listing") else None

    async def _generation_cost(self, generation_id: str) -> float | None:
        """What the provider says one generation cost, never below its tokens at the listed
        prices (None: it cannot say)."""
        bill = await self.account.generation_bill(self.key, generation_id)
        if bill is None or bill.usd is None:
            return None
        floor = self.price_floor
        if (
            floor is not None
            and bill.prompt_tokens is not None
            and (bill.completion_tokens is not None)
        ):
            return max(bill.usd, floor(bill.prompt_tokens, bill.completion_tokens))
        return bill.usd

    def _worst_case(self, prompt_tokens: int) -> float:
        return self.pricing.worst_case(prompt_tokens, self.max_tokens, self.reserve_factor)

    # --- main loop ----------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        from kimi_pipe.store.prompt_datasets import load_prompts

        self.run_dir.mkdir(parents=True, exist_ok=True)
        records_path = self.run_dir / RECORDS
        errors_path = self.run_dir / ATTEMPT_ERRORS
        pinned_by_probes = bool(self.route and self.route.fits and not self.route.declared)
        refuse_other_purchase(records_path, self.request, ignore_pinning=pinned_by_probes)
        index = load_resume_index(records_path, errors_path)
        t0 = time.monotonic()
        try:
            core = TokenCore.load(self.cfg, self.settings.model, self.route)
            t1 = time.monotonic()
            prompts = load_prompts(self.cfg.dataset)
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
            return await self._run(core, prompts, index, records_path, errors_path)

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
        if self.http_client is not None:
            await self.http_client.close()
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

    # --- the key's own account (OpenRouter GET /key) ----------------------------------
    async def _check_key(self) -> KeyStatus | None:
        """Read the key's usage and limit; refuse to start when its limit cannot cover what
        is left of budget.usd (the provider would stop us half-way, or worse, another
        client shares it)."""
        status = await self.account.key_status(self.key)
        if status is None:
            return None
        left = None if self.budget.cap_usd is None else self.budget.cap_usd - self.spent_before
        if status.limit is None:
            log.warning(
                "the API key has no credit limit: give the run's key a limit on "
                "OpenRouter (the one cap that holds whatever a client does)"
            )
        elif (
            left is not None
            and status.limit_remaining is not None
            and (status.limit_remaining < left)
        ):
            raise GenerateError(
                f"the API key's remaining credit limit ${status.limit_remaining:.4f} cannot "
                f"cover the run's remaining budget ${max(left, 0.0):.4f} (budget.usd="
                f"{self.budget.cap_usd}); lower budget.usd or raise the key's limit"
            )
        log.info("API key: $%.4f used, limit %s", status.usage, status.limit)
        return status

    async def _read_key_usage(self) -> None:
        """Count what the key says this run spent, when that is more than we counted."""
        if self.key_start is None:
            return
        status = await self.account.key_status(self.key)
        if status is None:
            return
        self.key_delta = max(self.key_delta, status.usage - self.key_start.usage)
        self.budget.raise_floor(self.spent_before + self.key_delta)
        # Kept in the journal: a resumed run starts from it, not from our lower count.
        self.journal.raise_floor(self.spent_before + self.key_delta)

    async def _poll_key(self) -> None:
        every = self.caps.key_poll_s
        while True:
            await asyncio.sleep(every)
            await self._read_key_usage()

    def _skip_over_budget(
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

    def _stop_for_budget(self, worst: float) -> None:
        reason = self.budget.blocker(worst, self.max_tokens, True) or "budget_usd"
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

    async def _one(
        self,
        prompt: Any,
        worst: float,
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
        answered: list[int] = []  # the sequence number settled once the record is written

        async def reserve() -> Reservation | None:
            res = pending.pop() if pending else await gate.reserve(worst, self.max_tokens)
            if res is not None:
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

    def _finish(
        self,
        prompt: Any,
        result: CallResult,
        core: TokenCore,
        writer: RecordWriter,
        gate: BudgetGate,
        flags: list[str],
    ) -> None:
        err = result.error
        if err is None:
            repair = TextRepair()
            try:
                resp = clean_text(result.response, self.key, repair)
            except RecursionError:  # nested too deeply to walk: unusable, cost already booked
                err = ErrorInfo(
                    "malformed_response", 200, "the answer is nested too deeply", "fail"
                )
                writer.append(_error_record(prompt, self.request, err, result.attempts))
                self.stats.failed[err.cls] += 1
                return
            assert resp is not None
            if (
                self.route is not None
                and not self.route.covers(resp.get("provider"))
                and not self.stop_event.is_set()
            ):
                # The route changed: stop buying until the new provider is probed (generate()
                # probes it and resumes); this answer is kept, reconstructed as unknown.
                self._stop(
                    gate,
                    "route_changed",
                    f"{resp.get('provider')} answered but was "
                    "not probed (serving=auto): probing it, then resuming",
                )
            try:
                rec = core.reconstruct(prompt.messages, prompt.tools, resp, self.request)
            except Exception as exc:  # noqa: BLE001 - keep the paid answer whatever happens
                log.exception("reconstruction of %s failed", prompt.id)
                rec = {
                    "ok": False,
                    "issues": ["reconstruction_crashed"],
                    "prompt_ids": [],
                    "output_ids": [],
                    "loss_mask": [],
                    "completion_tokens_reported": None,
                    "completion_tokens_reconstructed": 0,
                    "reconstruction_error": str(exc),
                    "evidence": "unresolved",
                    "sampling": None,
                }
            extra = [*flags, *result.billing_flags, *result.wire_flags]
            extra += ["answer_text_replaced"] if repair.surrogates else []
            extra += ["api_key_echoed"] if repair.key_echoed else []
            # A cost below the listed price is about money, not ids: a note, the floor booked.
            notes = [c for c in extra if c in MONEY_NOTES]
            flagged = _with_issues(rec, [c for c in extra if c not in MONEY_NOTES])
            flagged["issues"] = list(dict.fromkeys([*flagged.get("issues", []), *notes]))
            record = {
                "id": prompt.id,
                **flagged,
                "messages": prompt.messages,
                "tools": prompt.tools,
                "request": self.request,
                "response": resp,
                "usage": resp.get("usage"),
                "cost": result.cost,
                "provider": resp.get("provider"),
                "latency_s": round(result.latency_s, 4),
                "attempts": result.attempts,
                "error": None,
            }
            writer.append(record)
            self.stats.answered += 1
            self.stats.consecutive_failures = 0
        elif err.action == "fail":
            writer.append(_error_record(prompt, self.request, err, result.attempts))
            self.stats.failed[err.cls] += 1
            self.stats.consecutive_failures += 1
            limit = self.settings.retry.max_consecutive_failures
            if self.stats.consecutive_failures >= limit and not self.stop_event.is_set():
                self._stop(
                    gate,
                    "too_many_failures",
                    (
                        f"{limit} samples in a row failed without retry (last: {err.message}); "
                        "check provider.model and provider.params. Their records are in "
                        f"{RECORDS} (error set); delete those lines, or use a fresh output_dir, "
                        "to try them again"
                    ),
                )
        elif err is NO_BUDGET:
            if not self.stop_event.is_set():
                self._stop_for_budget(0.0)
        elif err is STOPPED:
            pass  # not answered: tried again on the next run
        elif err.action == "stop":
            self.stats.failed[err.cls] += 1
            if not self.stop_event.is_set():
                self._stop(
                    gate,
                    err.cls,
                    _STOP_MESSAGES.get(err.cls, "the provider refused: ") + err.message,
                )
        else:
            self.stats.failed[err.cls] += 1
            self.stats.given_up += 1
            log.warning(
                "%s: gave up after %d attempts (%s); it will be tried again on the next run",
                prompt.id,
                result.attempts,
                err.cls,
            )

    def _stop(self, gate: BudgetGate, reason: str, message: str) -> None:
        """Stop dispatching: requests in flight finish, nothing new is sent."""
        self.stop_event.set()
        gate.close()
        self.stats.stop_reason = reason
        self.stats.stop_message = scrub(message, self.key)
        log.error("stopping: %s", self.stats.stop_message)

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

    # --- summary ------------------------------------------------------------------------
    def summary(
        self, records_path: Path, errors_path: Path, skipped_rows: Counter[str]
    ) -> dict[str, Any]:
        counts: Counter[str] = Counter()
        flagged: Counter[str] = Counter()
        failed: Counter[str] = Counter()
        providers: Counter[str] = Counter()
        spend = 0.0
        prompt_tokens = reported = rebuilt = 0
        for rec in iter_records(records_path):
            counts["records"] += 1
            spend += record_cost(rec)
            if rec.get("error"):
                failed[rec["error"].get("class", "unknown")] += 1
                continue
            counts["answered"] += 1
            counts["ok" if rec.get("ok") else "flagged"] += 1
            counts[f"evidence:{evidence_of(rec)}"] += 1
            flagged.update(rec.get("issues") or [])
            providers[str(rec.get("provider"))] += 1
            usage = rec.get("usage") or {}
            prompt_tokens += int(usage.get("prompt_tokens") or 0)
            if isinstance(rec.get("completion_tokens_reported"), int):
                reported += rec["completion_tokens_reported"]
                rebuilt += int(rec.get("completion_tokens_reconstructed") or 0)
        failed_attempts_cost = sum(record_cost(r) for r in iter_records(errors_path))
        journal_spend = self.journal.spent()
        # Every count is a lower bound of what was billed: the spend is the largest.
        total_spend = max(
            spend + failed_attempts_cost, journal_spend, self.spent_before + self.key_delta
        )
        wall = time.monotonic() - self.stats.started
        s = self.stats
        return {
            "run_dir": str(self.run_dir),
            "stop_reason": s.stop_reason,
            "stop_message": s.stop_message,
            "prompts": self.total,
            "prompt_rows_skipped": dict(skipped_rows),
            "prompt_rows_skipped_examples": self.skipped_examples,
            "counts": {
                "records": counts["records"],
                "answered": counts["answered"],
                "ok": counts["ok"],
                "flagged": counts["flagged"],
                "failed": sum(failed.values()),
            },
            "flagged_by_issue": dict(flagged),
            "evidence": {rung: counts[f"evidence:{rung}"] for rung in LADDER},
            "failed_by_class": dict(failed),
            "providers": dict(providers),
            "spend_usd": total_spend,
            "spend_usd_records": spend,
            "spend_usd_failed_attempts": failed_attempts_cost,
            "spend_usd_journal": journal_spend,
            "key": None
            if self.key_start is None
            else {
                "usage_at_start": self.key_start.usage,
                "limit": self.key_start.limit,
                "usage_delta_this_run": self.key_delta,
            },
            "journal": {
                "recovered_requests": self.recovered[0],
                "recovered_usd": self.recovered[1],
            },
            "budget": {
                "usd": self.budget.cap_usd,
                "max_samples": self.budget.max_samples,
                "max_output_tokens": self.budget.max_output_tokens,
                "reserve_factor": self.reserve_factor,
                "price_in_usd_per_mtok": self.pricing.input_per_token * 1e6,
                "price_out_usd_per_mtok": self.pricing.output_per_token * 1e6,
                "price_source": self.price_source,
                "overruns": self.budget.overruns,
                "overbill_ratio": self.budget.overbill_ratio,
                "max_usd_per_sample": self.caps.max_usd_per_sample,
            },
            "tokens": {
                "prompt": prompt_tokens,
                "completion_reported": reported,
                "completion_reconstructed": rebuilt,
            },
            "billing_drift": {
                "reconstructed_minus_reported": rebuilt - reported,
                "ratio": (rebuilt / reported) if reported else None,
            },
            # Of the completion tokens bought, how many reach training exact (issue 33).
            "yield": _token_yield(self.cfg, records_path, self.pricing, total_spend),
            "this_run": {
                "startup_s": round(self.startup_s, 3),
                "wall_s": round(wall, 3),
                "answered": s.answered,
                "failed": dict(s.failed),
                "given_up_retry_next_run": s.given_up,
                "skipped_already_done": s.skipped_done,
                "skipped_over_budget": s.skipped_over_budget,
                "over_budget": None
                if s.over_budget_held_usd is None
                else {
                    "worst_usd": s.over_budget_usd,
                    "held_usd": s.over_budget_held_usd,
                    "left_usd": s.over_budget_left_usd,
                    "hold": self.budget.hold_note(),
                },
                "attempts_exhausted": s.attempts_exhausted,
                "attempts": s.attempts,
                "retries": s.retries,
                "output_tokens_billed": s.output_tokens,
                "samples_per_s": s.answered / wall if wall > 0 else None,
                "output_tokens_per_s": s.output_tokens / wall if wall > 0 else None,
                "concurrency": self.settings.concurrency,
                "concurrency_reached": self.window.peak,
            },
        }


def _token_yield(cfg: Any, records_path: Path, pricing: Any, spend: float) -> dict[str, Any]:
    """The yield block (core/token_yield.py) under the run's `export.accept`."""
    from kimi_pipe.core.evidence import parse_accept
    from kimi_pipe.core.token_yield import token_yield

    accept = parse_accept(OmegaConf.select(cfg, "export.accept", default=None))
    return token_yield(
        iter_records(records_path),
        accept,
        price_out_per_token=pricing.output_per_token,
        spend_usd=spend,
    )


_STOP_MESSAGES = {
    "payment_required": "the provider answered 402 (out of credits or the key's limit); "
    "add credits or raise the key limit, then run the same command again "
    "to resume: ",
    "auth": "the provider answered 401 (bad API key); check the key in the environment: ",
}


# ---------------------------------------------------------------------------------------
# Entry points


# What a resume must buy the same way as the run it continues (never timeout_s, nor the
# api_base of a local server, which gets a new port each time).
PURCHASE_KEYS = ("model", "extra_body")
NOT_PURCHASE = frozenset({"timeout_s", "api_base"})


def _purchase(request: dict[str, Any], ignore_pinning: bool = False) -> dict[str, Any]:
    out = {k: v for k, v in request.items() if k not in NOT_PURCHASE}
    routing = (out.get("extra_body") or {}).get("provider")
    if ignore_pinning and isinstance(routing, dict):
        # serving=auto pins the job to the providers its probes fitted, and re-pins it when
        # the route changes: that pin is the job's own, every record names its provider.
        routing = {k: v for k, v in routing.items() if k not in ("only", "order")}
        out["extra_body"] = {**out["extra_body"], "provider": routing}
    return out


def refuse_other_purchase(
    records_path: Path, request: dict[str, Any], ignore_pinning: bool = False
) -> None:
    """A run directory holds one job: refuse to resume it with settings that buy something
    else (another model, routing, sampling parameters), naming both."""
    recorded = next(
        (
            rec.get("request")
            for rec in iter_records(records_path)
            if isinstance(rec.get("request"), dict)
        ),
        None,
    )
    if recorded is None:
        return
    old, new = _purchase(recorded, ignore_pinning), _purchase(request, ignore_pinning)
    if old == new:
        return
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    diff = "; ".join(
        f"{k}: recorded {json.dumps(old.get(k), sort_keys=True)}, now "
        f"{json.dumps(new.get(k), sort_keys=True)}"
        for k in keys
    )
    raise GenerateError(
        f"{records_path.parent} holds a run bought with other settings ({diff}); resuming "
        "would mix them. Use another output_dir (the default one is derived from these "
        "settings) or run with the recorded settings"
    )


def run_dir_of(cfg: DictConfig) -> Path:
    """The run directory: `output_dir`, which a single Hydra run's `hydra.run.dir` must
    agree with; in a multirun, the job's directory (hydra.sweep.dir/subdir, one per job)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hydra_cfg = HydraConfig.get()
    except (ImportError, ValueError):
        return Path(str(cfg.output_dir))
    job_dir = Path(hydra_cfg.runtime.output_dir)
    if str(hydra_cfg.mode) == "RunMode.MULTIRUN":
        if any(o.lstrip("+~").startswith("output_dir=") for o in hydra_cfg.overrides.task):
            raise GenerateError(
                "output_dir with --multirun: every job writes to its own "
                f"hydra.sweep.dir/hydra.sweep.subdir ({job_dir}); drop output_dir"
            )
        return job_dir
    if not same_dir(job_dir, str(cfg.output_dir)):
        raise GenerateError(
            f"hydra.run.dir ({job_dir}) differs from output_dir ({cfg.output_dir}): records "
            "would go to one and the logs to the other; set output_dir only"
        )
    return Path(str(cfg.output_dir))


def _pointed_at(cfg: DictConfig, endpoint: dict[str, Any]) -> DictConfig:
    """A copy of cfg whose provider talks to the started local server."""
    from omegaconf import OmegaConf, open_dict

    out = cfg.copy()
    with open_dict(out):
        OmegaConf.update(out, "provider.model", endpoint["model"], force_add=True)
        OmegaConf.update(out, "provider.api_base", endpoint["api_base"], force_add=True)
        OmegaConf.update(out, "provider.server", None, force_add=True)
    return out


def generate(
    cfg: DictConfig, run_dir: Path | None = None, *, buy_probes: BuyProbes | None = None
) -> tuple[int, dict[str, Any] | None]:
    """Run the stage; returns (exit status, summary). Config/input problems -> status 2,
    said as one line here. `buy_probes`: as for `run_generate`."""
    try:
        run_dir, summary = run_generate(cfg, run_dir, buy_probes=buy_probes)
    except (KimiPipeError, OSError) as exc:
        # A user's mistake or the host's fault (a full disk, a read-only directory): one
        # line naming the path; every complete record and the journal are on disk.
        host = host_error(exc, run_dir or cfg.get("output_dir"))  # a write names no file
        message = (
            one_line(exc)
            or (one_line(host) if host is not None else None)
            or (" ".join(str(exc).split()) if isinstance(exc, FileNotFoundError) else None)
        )
        if message is None:
            raise  # a bug: keep its traceback
        log.error("%s", message)
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR, None
    except KeyboardInterrupt:
        # Every finished answer is already on disk; the requests in flight are lost.
        where = run_dir if run_dir is not None else cfg.get("output_dir")
        print(f"interrupted; run the same command again to resume ({where})", file=sys.stderr)
        return EXIT_INTERRUPTED, None
    return finish_status(run_dir, summary), summary


def run_generate(
    cfg: DictConfig, run_dir: Path | None = None, *, buy_probes: BuyProbes | None = None
) -> tuple[Path, dict[str, Any]]:
    """The stage's work: (run directory, summary). A user-facing failure is raised, not
    printed (`generate` says it; a sweep or the probes say it once for all their jobs).
    `buy_probes` buys serving=auto's probe battery (generation/probes.py's `buy_battery`,
    passed in: buying probes is itself a generate run)."""
    from kimi_pipe.core.models import load_model
    from kimi_pipe.core.serving import serving_profile
    from kimi_pipe.providers.local_server import provider_endpoint
    from kimi_pipe.store.prompt_datasets import check_prompt_source

    # Before anything is written: no secret in any value, budget and provider settings that
    # can buy, a run directory that may be one, a prompt file that is there (before
    # serving=auto's probes buy anything).
    refuse_secrets(cfg)
    check_settings(cfg)
    check_prompt_source(cfg.dataset)
    run_dir = check_run_dir(run_dir or run_dir_of(cfg), RUN_FILES)
    # One process per run directory, held until the summary is written.
    with RunLock(run_dir), provider_endpoint(cfg, run_dir) as endpoint:
        # provider=local: its server is started around the run, reached like any other.
        if endpoint.get("server") is not None:
            cfg = _pointed_at(cfg, endpoint)
        if serving_auto.is_plain_auto(serving_profile(cfg)):
            # A model config its tokenizer contradicts fails here, once, before the
            # probes buy anything (their own generate runs would each say it again).
            load_model(cfg.model)
        for _ in range(serving_auto.MAX_ROUTE_CHANGES + 1):
            # serving=auto: probes (booked in this run's journal) before any answer.
            job_cfg, route = serving_auto.prepare(cfg, run_dir, buy=buy_probes)
            gen = Generator(job_cfg, run_dir, route=route)
            summary = asyncio.run(gen.run())
            if summary["stop_reason"] != "route_changed":
                break
    return run_dir, summary


def check_settings(cfg: DictConfig) -> None:
    """The budget and provider settings as the run reads them: a value that cannot buy
    (budget.usd=0, provider.concurrency=0) is a ConfigError naming it, raised before Hydra
    writes the run directory and before serving=auto's probes."""
    budget_settings(cfg)
    ProviderSettings.from_config(cfg.provider)


def finish_status(run_dir: Path, summary: dict[str, Any]) -> int:
    """Say how a finished run ended; its exit status (0, stopped, or every request failed)."""
    line = (
        f"generate {summary['stop_reason']}: {summary['counts']['answered']} answered "
        f"({summary['counts']['ok']} ok, {summary['counts']['flagged']} flagged), "
        f"{summary['counts']['failed']} failed, ${summary['spend_usd']:.4f} spent "
        f"-> {run_dir / RECORDS}"
    )
    log.info("%s", line)
    if summary["stop_message"]:
        print(f"generate: {summary['stop_message']}", file=sys.stderr)
    stopped = summary["stop_reason"] in ("payment_required", "auth", "too_many_failures")
    this_run = summary["this_run"]
    failed_now = sum(this_run["failed"].values()) + this_run["given_up_retry_next_run"]
    if not stopped and this_run["answered"] == 0 and failed_now:
        # Nothing bought at all: a total outage or a wrong setting, never a quiet success.
        causes = ", ".join(f"{k}: {v}" for k, v in Counter(this_run["failed"]).most_common(3))
        print(
            f"generate: every request of this run failed ({causes}); see "
            f"{run_dir / ATTEMPT_ERRORS} and {run_dir / RECORDS}",
            file=sys.stderr,
        )
        return EXIT_ALL_FAILED
    return EXIT_STOPPED if stopped else 0


def _refuse_keys_on_the_command_line(argv: list[str]) -> None:
    """Hydra saves every override in .hydra/ (and the log) before the task runs: refuse a
    key there, whatever the key it is given under."""
    why = key_in_overrides(argv)
    if why:
        print(
            f"error: {why} (Hydra would save it in .hydra/ and the log); export the "
            "provider's key variable (e.g. OPENROUTER_API_KEY) instead",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_USER_ERROR)


def job_overrides(argv: list[str]) -> list[list[str]]:
    """The overrides of every job the command line starts (one, or a multirun's each)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [a for a in argv if not a.startswith("-")]
    if not any(a in ("-m", "--multirun") for a in argv):
        return [overrides]
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def writable(run_dir: Path) -> None:
    """Create the run directory, or raise the OSError (naming it) that says why not."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(run_dir, os.W_OK | os.X_OK):
        err = errno.EROFS if os.statvfs(run_dir).f_flag & os.ST_RDONLY else errno.EACCES
        raise OSError(err, os.strerror(err), str(run_dir))


def check_before_launch(argv: list[str], environ: dict[str, str] | None = None) -> None:
    """What Hydra would write before the stage runs (`.hydra/`, the log, the run directory
    itself), checked for every job first: no secret in any resolved value or directory
    name, a run directory that may be one, one directory per job. Raises a KimiPipeError;
    a config Hydra cannot compose is left for Hydra to report."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    # A config that does not compose is reported by the command (one line), before Hydra
    # writes anything.
    not_composed = (HydraException, OmegaConfBaseException, YAMLError, UnicodeDecodeError)
    multirun = any(a in ("-m", "--multirun") for a in argv)
    try:
        jobs = job_overrides(argv)
    except not_composed:
        return
    seen: dict[str, list[str]] = {}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for job in jobs:
            try:
                cfg = hydra_compose(config_name="config", overrides=job, return_hydra_config=True)
                hydra_node = cfg.hydra
                if multirun:
                    where = "hydra.sweep.dir/subdir"
                    run_dir = os.path.join(str(hydra_node.sweep.dir), str(hydra_node.sweep.subdir))
                else:
                    where, run_dir = "hydra.run.dir", str(hydra_node.run.dir)
                output_dir = str(cfg.output_dir)
                with open_dict(cfg):
                    del cfg["hydra"]
            except not_composed:
                return
            refuse_secrets(cfg, environ, {where: run_dir})
            check_settings(cfg)
            check_run_dir(run_dir)
            if not multirun and not same_dir(run_dir, output_dir):
                raise GenerateError(
                    f"hydra.run.dir ({run_dir}) differs from output_dir ({output_dir}): records "
                    "would go to one and the logs to the other; set output_dir only"
                )
            writable(Path(run_dir))  # Hydra creates it and writes its log there first
            seen.setdefault(os.path.realpath(run_dir), []).append(" ".join(job))
    shared = {d: js for d, js in seen.items() if len(js) > 1}
    if shared:
        run_dir, js = next(iter(shared.items()))
        raise GenerateError(
            f"{len(js)} jobs of this multirun would share the run directory {run_dir} "
            f"({' | '.join(js)}): each would resume the other's records. Give each its own "
            "hydra.sweep.subdir (the default one is derived from what a job buys)"
        )
