"""`summary.json`, written at a generate run's end (its counts: generation/stats.py)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kimi_pipe.core.evidence import (
    LADDER,
    POSTERIOR_SAMPLED,
    PREFIX_PROVEN,
    UNRESOLVED,
    parse_accept,
)
from kimi_pipe.core.token_yield import yield_block
from kimi_pipe.store.records import iter_records, record_cost
from kimi_pipe.store.records_index import iter_digests

if TYPE_CHECKING:
    from kimi_pipe.generation.job import GenerateJob
    from kimi_pipe.generation.spending import Spending
    from kimi_pipe.providers.budget import SlowStart
    from kimi_pipe.providers.pacing import Pacer


def run_summary(
    job: GenerateJob,
    run_dir: Path,
    spending: Spending,
    *,
    records_path: Path,
    errors_path: Path,
    prompts: int,
    skipped_rows: Counter[str],
    skipped_examples: dict[str, list[str]],
    startup_s: float,
    concurrency: int,
    window: SlowStart,
    pacer: Pacer | None,
) -> dict[str, Any]:
    """`summary.json` of a finished (or stopped) run."""
    tally = tally_records(records_path)
    counts, flagged, failed = tally.counts, tally.flagged, tally.failed
    providers, spend = tally.providers, tally.spend
    prompt_tokens, reported, rebuilt = tally.prompt_tokens, tally.reported, tally.rebuilt
    failed_attempts_cost = sum(record_cost(r) for r in iter_records(errors_path))
    journal_spend = spending.journal.spent()
    # Every count is a lower bound of what was billed: the spend is the largest.
    total_spend = max(
        spend + failed_attempts_cost, journal_spend, spending.spent_before + spending.key_delta
    )
    wall = time.monotonic() - spending.stats.started
    s = spending.stats
    return {
        "run_dir": str(run_dir),
        "stop_reason": s.stop_reason,
        "stop_message": s.stop_message,
        "prompts": prompts,
        "prompt_rows_skipped": dict(skipped_rows),
        "prompt_rows_skipped_examples": skipped_examples,
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
        if spending.key_start is None
        else {
            "usage_at_start": spending.key_start.usage,
            "limit": spending.key_start.limit,
            "usage_delta_this_run": spending.key_delta,
        },
        "journal": {
            "recovered_requests": spending.recovered[0],
            "recovered_usd": spending.recovered[1],
        },
        "budget": {
            "usd": spending.budget.cap_usd,
            "max_samples": spending.budget.max_samples,
            "max_output_tokens": spending.budget.max_output_tokens,
            "reserve_factor": spending.prices.reserve_factor,
            "price_in_usd_per_mtok": spending.prices.pricing.input_per_token * 1e6,
            "price_out_usd_per_mtok": spending.prices.pricing.output_per_token * 1e6,
            "price_source": spending.prices.source,
            "overruns": spending.budget.overruns,
            "overbill_ratio": spending.budget.overbill_ratio,
            "max_usd_per_sample": spending.caps.max_usd_per_sample,
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
        "yield": _token_yield(job.accept, tally, spending.prices.pricing, total_spend),
        "this_run": {
            "startup_s": round(startup_s, 3),
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
                "hold": spending.budget.hold_note(),
            },
            "attempts_exhausted": s.attempts_exhausted,
            "attempts": s.attempts,
            "retries": s.retries,
            "output_tokens_billed": s.output_tokens,
            "samples_per_s": s.answered / wall if wall > 0 else None,
            "output_tokens_per_s": s.output_tokens / wall if wall > 0 else None,
            "concurrency": concurrency,
            "concurrency_reached": window.peak,
            # Requests held back to stay within provider.rpm / tpm (None: not paced).
            "paced": None
            if pacer is None
            else {
                "rpm": pacer.rpm,
                "tpm": pacer.tpm,
                "window_s": pacer.window_s,
                "requests_waited": pacer.paced,
                "wait_s": round(pacer.waited_s, 3),
            },
        },
    }


def _token_yield(given: Any, tally: RecordTally, pricing: Any, spend: float) -> dict[str, Any]:
    """The yield block (core/token_yield.py) under the run's `export.accept` (`given`)."""
    accept = parse_accept(given)
    return tally.token_yield(accept, price_out_per_token=pricing.output_per_token, spend_usd=spend)


@dataclass
class RecordTally:
    """What summary.json counts over a records file, added one record's digest at a time
    (store/records_index.py `digest`): read from the index of ids, not the records."""

    counts: Counter[str] = field(default_factory=Counter)
    flagged: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    providers: Counter[str] = field(default_factory=Counter)
    spend: float = 0.0
    prompt_tokens: int = 0
    reported: int = 0
    rebuilt: int = 0
    # For the yield, as core/token_yield.py counts it: a later answer of an id replaces an
    # earlier one; answers without an id all count. (rung, bought, exact, has output ids,
    # has a proven prefix, drawn output ids)
    latest: dict[Any, tuple[str, int, int, bool, bool, int]] = field(default_factory=dict)
    anonymous: list[tuple[str, int, int, bool, bool, int]] = field(default_factory=list)

    def add(self, rid: Any, cost: float, dig: dict[str, Any]) -> None:
        self.counts["records"] += 1
        self.spend += cost
        if "e" in dig:
            self.failed[dig["e"]] += 1
            return
        self.counts["answered"] += 1
        self.counts["ok" if dig["k"] else "flagged"] += 1
        self.counts[f"evidence:{dig['r']}"] += 1
        if dig["i"]:
            self.flagged.update(dig["i"])
        self.providers[str(dig["v"])] += 1
        self.prompt_tokens += dig["p"]
        if dig["c"] is not None:
            self.reported += dig["c"]
            self.rebuilt += dig["n"]
        part = (dig["r"], dig["b"], dig["x"], bool(dig["o"]), bool(dig["f"]), dig["d"])
        if rid is None:
            self.anonymous.append(part)
        else:
            self.latest.pop(rid, None)
            self.latest[rid] = part

    def token_yield(
        self,
        accept: Sequence[str],
        *,
        price_out_per_token: float | None = None,
        spend_usd: float | None = None,
    ) -> dict[str, Any]:
        """core/token_yield.py's `token_yield` of the records, from their digests."""
        bought = accepted = drawn = 0
        by_rung = dict.fromkeys(LADDER, 0)
        bought_by_rung = dict.fromkeys(LADDER, 0)
        taken = set(accept)
        for rung, paid, exact, has_output, has_prefix, drawn_ids in [
            *self.latest.values(),
            *self.anonymous,
        ]:
            bought += paid
            bought_by_rung[rung] += paid
            if rung != UNRESOLVED:
                by_rung[rung] += exact
            # `usable`: output ids, a rung the policy accepts, or a drawn record's proven
            # prefix (a never-usable record has no exact tokens).
            drawn_prefix = rung == POSTERIOR_SAMPLED and PREFIX_PROVEN in taken and has_prefix
            if has_output and (rung in taken or drawn_prefix):
                accepted += exact
                if rung == POSTERIOR_SAMPLED and rung in taken:  # `taken_whole`
                    drawn += drawn_ids - exact
        return yield_block(
            accept, bought, bought_by_rung, by_rung, accepted, drawn, price_out_per_token, spend_usd
        )


def tally_records(records_path: Path) -> RecordTally:
    """The tally of every record of `records_path`, read through its index of ids (only the
    records past the index parsed; all of them when no index describes the file)."""
    tally = RecordTally()
    for rid, cost, dig in iter_digests(records_path):
        tally.add(rid, cost, dig)
    return tally
