"""How the report writes numbers: percentages, rates, dollars, counts ("n/a" for none)."""

from __future__ import annotations

from collections import Counter


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
