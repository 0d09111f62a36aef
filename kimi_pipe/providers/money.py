"""Money and counts as a provider states them: checked USD amounts, token counts, listed
prices, and the account records (a key's status, one generation's bill). The bottom of the
providers package: it imports none of it but its errors, so accounts and costs both build on
it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kimi_pipe.providers.errors import PriceError


@dataclass(frozen=True)
class KeyStatus:
    """OpenRouter's `GET /key`: USD used by the key so far and its credit limit."""

    usage: float
    limit: float | None  # None: the key has no credit limit
    limit_remaining: float | None


@dataclass(frozen=True)
class GenerationBill:
    """What the provider says one generation cost, with the tokens it counted."""

    usd: float | None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def _usage(response: Mapping[str, Any]) -> Mapping[str, Any]:
    usage = response.get("usage")
    return usage if isinstance(usage, Mapping) else {}


def valid_usd(value: Any) -> float | None:
    """A USD amount as a provider may state it: a finite number >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _number(value: Any) -> Any:
    """A listing's price string ("0.0000006") as a number; anything else unchanged."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


# A listed price below this (USD per million tokens) is a listing error, not a price: a cap
# computed from it would let thousands of times the budget through.
MIN_LISTED_USD_PER_MTOK = 0.001


def _checked_prices(prices: tuple[Any, Any], where: str, minimum: float) -> tuple[float, float]:
    """USD per token, refused unless both are finite numbers >= `minimum` per Mtok."""
    out = []
    for name, value in zip(("input", "output"), prices, strict=True):
        usd = valid_usd(value)
        if usd is None or usd * 1e6 < minimum:
            raise PriceError(
                f"{where}: the {name} price {value!r} USD per token is not a usable price "
                f"(must be a finite number >= {minimum} USD per million tokens); set "
                "provider.pricing.input_usd_per_mtok and output_usd_per_mtok"
            )
        out.append(usd)
    return out[0], out[1]


def usd(amount: float) -> str:
    """USD with 4 decimals, more below a cent so that 3 digits show (a worst case of
    $0.00084 held at 1000x must not read as $0.0008 x 1000)."""
    digits = 4 if amount <= 0 or amount >= 0.01 else 2 - math.floor(math.log10(amount))
    return f"${amount:.{min(digits, 10)}f}"


def usd_pair(amount: float, limit: float) -> tuple[str, str]:
    """Two USD amounts as a message prints them: 4 decimals, more where 4 would print them
    equal (a message that says one exceeds the other shows it)."""
    for digits in (4, 6, 8, 10):
        first, second = f"${amount:.{digits}f}", f"${limit:.{digits}f}"
        if first != second:
            break
    return first, second
