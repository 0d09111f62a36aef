"""How the report and the stages write numbers: percentages, rates, dollars, counts ("n/a"
for none)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping


def pct(rate: float | None) -> float | None:
    return None if rate is None else 100.0 * rate


def fmt_pct(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}%"


def fmt_num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def fmt_usd(value: float | None) -> str:
    return "n/a" if value is None else f"${value:.4g}"


def counter_text(counter: Counter[str]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in counter.most_common()) or "none"


def skipped_line(counts: Mapping[str, int]) -> str:
    """What extraction's reading of the records skipped (extraction/token_samples.py), as a
    reader reads it: `0`, or `1 (not ok 1; rung unresolved 1)`. A record with ids is counted
    twice in `counts`, once by why it was skipped and once by its evidence rung
    (`skipped_evidence_<rung>`): the total is of the first kind only."""
    why = {k.removeprefix("skipped_"): n for k, n in counts.items() if k.startswith("skipped_")}
    rungs = {k.removeprefix("evidence_"): n for k, n in why.items() if k.startswith("evidence_")}
    reasons = {k: n for k, n in why.items() if not k.startswith("evidence_") and n}
    if not reasons:
        return "0"
    said = ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in reasons.items())
    by_rung = ", ".join(f"{k} {n}" for k, n in rungs.items() if n)
    return f"{sum(reasons.values())} ({said}{'; rung ' + by_rung if by_rung else ''})"
