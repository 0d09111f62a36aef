"""The run's state while it buys (`RunStats`) and `summary.json`, written at its end."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from kimi_pipe.core.evidence import LADDER, evidence_of
from kimi_pipe.store.records import iter_records, record_cost

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kimi_pipe.providers.account import KeyStatus
    from kimi_pipe.providers.budget import Budget, BudgetSettings, Pricing, SlowStart
    from kimi_pipe.providers.settings import ProviderSettings
    from kimi_pipe.store.spend_journal import SpendJournal


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


class RunSummary:
    """`summary.json`: a part of `Generator` (generation/buying.py), which sets these."""

    cfg: DictConfig
    run_dir: Path
    stats: RunStats
    total: int
    skipped_examples: dict[str, list[str]]
    journal: SpendJournal
    spent_before: float
    key_delta: float
    key_start: KeyStatus | None
    recovered: tuple[int, float]
    budget: Budget
    caps: BudgetSettings
    reserve_factor: float
    pricing: Pricing
    price_source: str
    startup_s: float
    settings: ProviderSettings
    window: SlowStart

    def summary(
        self, records_path: Path, errors_path: Path, skipped_rows: Counter[str]
    ) -> dict[str, Any]:
        """`summary.json` of a finished (or stopped) run."""
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
