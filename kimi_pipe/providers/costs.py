"""What an answer cost: its own statement checked (finite USD, sane token counts) and the
listed prices a budget reserves against."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from kimi_pipe.providers.errors import PriceError, ProviderConfigError
from kimi_pipe.providers.settings import ProviderSettings

log = logging.getLogger(__name__)


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


def response_cost(
    response: Mapping[str, Any],
    hidden: Mapping[str, Any] | None,
    fallback: Callable[[int, int], float] | None,
) -> tuple[float | None, list[str]]:
    """usage.cost (OpenRouter), else LiteLLM's response_cost, else tokens x prices; with
    the billing flags of the answer. None: no trustworthy cost (book the reservation)."""
    usage = _usage(response)
    # LiteLLM fills a missing usage with zeros: no cost key and no tokens means none came.
    if "cost" not in usage and not any(
        usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    ):
        return None, ["no_usage"]
    raw = [usage.get(k) for k in ("prompt_tokens", "completion_tokens")]
    tokens = [_count(value) for value in raw]
    if any(value is not None and count is None for value, count in zip(raw, tokens, strict=True)):
        return None, ["usage_invalid"]  # a bill whose token counts are nonsense: no trust
    if "cost" in usage:
        cost = valid_usd(usage.get("cost"))
        return cost, ([] if cost is not None else ["cost_invalid"])
    if (hidden or {}).get("response_cost") is not None:
        cost = valid_usd((hidden or {})["response_cost"])
        return cost, ([] if cost is not None else ["cost_invalid"])
    if fallback is not None:
        return valid_usd(fallback(tokens[0] or 0, tokens[1] or 0)), []
    return None, ["cost_invalid"]


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


async def fetch_pricing(settings: ProviderSettings, key: str) -> tuple[float, float, str]:
    """USD per token (input, output) and where they came from: the config, else the
    provider's model listing (`GET {api_base}/models`, OpenRouter's `pricing.prompt` /
    `pricing.completion`), else the configured fallback prices. Prices must be finite and
    >= 0 (config) or >= MIN_LISTED_USD_PER_MTOK (listing)."""
    from kimi_pipe.providers.account import account_for

    if settings.input_usd_per_mtok is not None and settings.output_usd_per_mtok is not None:
        fin, fout = _checked_prices(
            (settings.input_usd_per_mtok / 1e6, settings.output_usd_per_mtok / 1e6),
            "provider.pricing",
            0.0,
        )
        return fin, fout, "config"
    try:
        return (*await account_for(settings).listed_prices(key), "listing")
    except PriceError:
        raise
    except ProviderConfigError as exc:
        per_m_in = settings.fallback_input_usd_per_mtok
        per_m_out = settings.fallback_output_usd_per_mtok
        if per_m_in is None or per_m_out is None:
            raise
        log.warning("%s; using the fallback prices $%s/$%s per Mtok", exc, per_m_in, per_m_out)
        fin, fout = _checked_prices(
            (per_m_in / 1e6, per_m_out / 1e6), "provider.pricing.fallback", 0.0
        )
        return fin, fout, "fallback"


def _number(value: Any) -> Any:
    """A listing's price string ("0.0000006") as a number; anything else unchanged."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value
