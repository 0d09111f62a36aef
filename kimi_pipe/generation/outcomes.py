"""What one prompt becomes: the token core that rebuilds an answer's ids, the record of an
answer that failed, the flags a record carries."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kimi_pipe.conformance import auto as serving_auto
from kimi_pipe.core.answer_checks import TextRepair, answer_issues, clean_text
from kimi_pipe.core.issue_codes import COST_BELOW_LISTED_PRICE, Code
from kimi_pipe.core.logprobs import LogprobPolicy
from kimi_pipe.core.models import load_model
from kimi_pipe.core.prompt_render import prompt_ids
from kimi_pipe.core.record_builder import RecordBuilder, mark_flagged
from kimi_pipe.core.token_record import TokenRecord
from kimi_pipe.providers.budget import BudgetGate
from kimi_pipe.providers.calls import CallResult
from kimi_pipe.providers.credentials import scrub
from kimi_pipe.providers.errors import NO_BUDGET, STOPPED, ErrorInfo
from kimi_pipe.store.layout import RECORDS
from kimi_pipe.store.records import RecordWriter

if TYPE_CHECKING:
    from kimi_pipe.generation.job import GenerateJob
    from kimi_pipe.generation.spending import Spending
    from kimi_pipe.generation.stats import RunStats
    from kimi_pipe.providers.settings import ProviderSettings

log = logging.getLogger("kimi_pipe.generate")


def to_log_files(level: int, message: str) -> None:
    """`message` into the run's log files only (Hydra's `generate.log`), not the terminal,
    where it is printed once in its own words."""
    record = log.makeRecord(log.name, level, __file__, 0, "%s", (message,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
            handler.handle(record)


_STOP_MESSAGES = {
    "payment_required": "the provider answered 402 (out of credits or the key's limit); "
    "add credits or raise the key limit, then run the same command again "
    "to resume: ",
    "auth": "the provider answered 401 (bad API key); check the key in the environment: ",
}

# ---------------------------------------------------------------------------------------
# The token core (models + render + reconstruction), wired in one place.


@dataclass
class TokenCore:
    prompt_len: Callable[[list[dict], list[dict] | None], int]
    reconstruct: Callable[..., TokenRecord]

    @classmethod
    def load(cls, job: GenerateJob, asked_model: str = "", route: Any = None) -> TokenCore:

        model = load_model(job.model)
        policy = LogprobPolicy(
            record_ids=job.record_ids,
            requested=bool(job.provider.get("logprobs")),
            billing_tolerance=job.billing_tolerance,
        )
        builder = RecordBuilder(model, job.serving, job.billing_tolerance, policy)
        # Which serving profile each answer is undone with: the one fitted (serving=auto)
        # or declared for the provider that answered (conformance/auto.py).
        route = route or serving_auto.named(job.serving)

        def prompt_len(messages: list[dict], tools: list[dict] | None) -> int:
            return len(prompt_ids(model, messages, tools))

        def rebuild(
            messages: list[dict], tools: list[dict] | None, resp: dict, request: dict | None = None
        ) -> TokenRecord:
            serving, spec, probe = route.profile_for(resp.get("provider"))
            record = replace(builder, serving=serving).build(messages, tools, resp, request)
            record |= {"serving_profile": spec, "serving_probe": probe}
            return _with_issues(record, answer_issues(resp, asked_model, request))

        return cls(prompt_len, rebuild)


# Codes about what an answer cost, not about its ids: the record stays as proven as it is.
MONEY_NOTES = frozenset({COST_BELOW_LISTED_PRICE})


def _with_issues(record: TokenRecord, issues: list[str]) -> TokenRecord:
    """Add error codes to a reconstructed record: it is no longer `ok` (rung unresolved)."""
    return mark_flagged(record, issues)


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


class Outcomes:
    """What each purchase becomes (its record, counted in the run's stats), and stopping the
    run where an outcome says to."""

    def __init__(
        self,
        settings: ProviderSettings,
        key: str,
        request: dict[str, Any],
        route: Any,
        stop_event: asyncio.Event,
        stats: RunStats,
        spending: Spending,
    ) -> None:
        self.settings = settings
        self.key = key  # scrubbed from what is said, and from the answers kept
        self.request = request
        self.route = route  # conformance/auto.py's Route, or None
        self.stop_event = stop_event  # shared with the dispatch: set, nothing new is sent
        self.stats = stats
        self.spending = spending

    def finish(
        self,
        prompt: Any,
        result: CallResult,
        core: TokenCore,
        writer: RecordWriter,
        gate: BudgetGate,
        flags: list[str],
    ) -> None:
        """Append the record of one prompt's purchase (an answer with its ids, or why it failed)
        and count it; stop the run where the outcome says to."""
        err = result.error
        if err is None:
            repair = TextRepair()
            try:
                resp = clean_text(result.response, self.key, repair)
            except RecursionError:  # nested too deeply to walk: unusable, cost already booked
                err = ErrorInfo(
                    Code.MALFORMED_RESPONSE, 200, "the answer is nested too deeply", "fail"
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
                self.stop(
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
                    "evidence": Code.UNRESOLVED,
                    "sampling": None,
                }
            extra = [*flags, *result.billing_flags, *result.wire_flags]
            extra += [Code.ANSWER_TEXT_REPLACED] if repair.surrogates else []
            extra += [Code.API_KEY_ECHOED] if repair.key_echoed else []
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
                self.stop(
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
                self.spending.stop_for_budget(0.0)
        elif err is STOPPED:
            pass  # not answered: tried again on the next run
        elif err.action == "stop":
            self.stats.failed[err.cls] += 1
            if not self.stop_event.is_set():
                self.stop(
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

    def stop(self, gate: BudgetGate, reason: str, message: str) -> None:
        """Stop dispatching: requests in flight finish, nothing new is sent."""
        self.stop_event.set()
        gate.close()
        self.stats.stop_reason = reason
        self.stats.stop_message = scrub(message, self.key)
        # The terminal gets the stop once, at the end of the run (generation/run.py).
        to_log_files(logging.ERROR, f"stopping: {self.stats.stop_message}")
