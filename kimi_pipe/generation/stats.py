"""What a generate run counts while it buys (`RunStats`), shared by its parts
(generation/buying.py) and written into summary.json (generation/summary.py)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


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
