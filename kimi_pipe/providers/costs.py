"""What an answer cost: its own statement checked (finite USD, sane token counts) and the
listed prices a budget reserves against."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kimi_pipe.core.issue_codes import Code
from kimi_pipe.providers.account import account_for
from kimi_pipe.providers.errors import PriceError, ProviderConfigError, ProviderUnreachable
from kimi_pipe.providers.money import (  # noqa: F401  (re-exported: the cost names callers use)
    MIN_LISTED_USD_PER_MTOK,
    _checked_prices,
    _count,
    _number,
    _usage,
    valid_usd,
)
from kimi_pipe.providers.settings import ProviderSettings

log = logging.getLogger(__name__)


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
        return None, [Code.NO_USAGE]
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


async def fetch_pricing(settings: ProviderSettings, key: str) -> tuple[float, float, str]:
    """USD per token (input, output) and where they came from: the config, else the
    provider's model listing (`GET {api_base}/models`, OpenRouter's `pricing.prompt` /
    `pricing.completion`), else the configured fallback prices. Prices must be finite and
    >= 0 (config) or >= MIN_LISTED_USD_PER_MTOK (listing)."""
    if settings.input_usd_per_mtok is not None and settings.output_usd_per_mtok is not None:
        fin, fout = _checked_prices(
            (settings.input_usd_per_mtok / 1e6, settings.output_usd_per_mtok / 1e6),
            "provider.pricing",
            0.0,
        )
        return fin, fout, "config"
    try:
        return (*await account_for(settings).listed_prices(key), "listing")
    except (PriceError, ProviderUnreachable):
        raise  # no network is not a missing listing: fallback prices would hide it
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
