"""OpenRouter's account endpoints: the model listing's prices (`GET /models`), the key's
usage and credit limit (`GET /key`) and one generation's billed cost (`GET /generation`).
Used only by a provider whose config says `account: openrouter`."""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

from kimi_pipe.providers.credentials import scrub
from kimi_pipe.providers.errors import ProviderConfigError, ProviderUnreachable
from kimi_pipe.providers.money import (
    MIN_LISTED_USD_PER_MTOK,
    GenerationBill,
    KeyStatus,
    _checked_prices,
    _count,
    _number,
    valid_usd,
)
from kimi_pipe.providers.settings import ProviderSettings

log = logging.getLogger(__name__)


async def listed_prices(settings: ProviderSettings, key: str) -> tuple[float, float]:
    base = (settings.api_base or "").rstrip("/")
    model_id = settings.model.split("/", 1)[1] if "/" in settings.model else settings.model
    how = (
        "set provider.pricing.input_usd_per_mtok and provider.pricing.output_usd_per_mtok "
        "(USD per million tokens)"
    )
    if not base:
        raise ProviderConfigError(f"no api_base to read prices from; {how}")
    url = base + settings.models_path
    try:
        listing = await get_json(url, key)
    except ProviderUnreachable:
        raise  # not a listing to replace by prices of one's own: no provider at all
    except ProviderConfigError as exc:
        raise ProviderConfigError(f"{exc}; {how}") from None
    for entry in listing.get("data", []) if isinstance(listing, dict) else []:
        if isinstance(entry, dict) and entry.get("id") == model_id:
            pricing = entry.get("pricing")
            if not isinstance(pricing, dict) or not {"prompt", "completion"} <= set(pricing):
                break
            return _checked_prices(
                (_number(pricing["prompt"]), _number(pricing["completion"])),
                f"{url} ({model_id})",
                MIN_LISTED_USD_PER_MTOK,
            )
    raise ProviderConfigError(f"{url} lists no prices for {model_id!r}; {how}")


async def get_json(url: str, key: str, timeout_s: float = 30.0) -> Any:
    """GET a small JSON document from the provider (listing, key, generation stats)."""
    import httpx  # optional dep

    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            resp = await client.get(url, headers=headers)
            resp.raise_for_status()
            if len(resp.content) > 4 << 20:
                raise ValueError(f"{len(resp.content)} bytes is not a small JSON document")
            return resp.json()
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise ProviderUnreachable(
            f"cannot reach the provider at {url} ({scrub(str(exc), key)[:200]}): the network "
            "is down or provider.api_base is wrong"
        ) from None
    except (httpx.HTTPError, ValueError, RecursionError) as exc:
        raise ProviderConfigError(f"cannot read {url}: {scrub(str(exc), key)[:300]}") from None


async def key_status(settings: ProviderSettings, key: str) -> KeyStatus | None:
    """The key's usage and limit, or None where the provider has no such endpoint or
    answers with something that is not a valid account state."""
    base = (settings.api_base or "").rstrip("/")
    if not base:
        return None
    try:
        doc = await get_json(base + settings.key_path, key, timeout_s=15.0)
    except ProviderConfigError as exc:
        log.info("no key status: %s", exc)
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, dict):
        return None
    usage = valid_usd(data.get("usage"))
    if usage is None:
        log.warning(
            "%s%s: usage %r is not a USD amount; ignored",
            base,
            settings.key_path,
            data.get("usage"),
        )
        return None
    if data.get("limit") is None:
        return KeyStatus(usage, None, None)
    limit = valid_usd(data.get("limit"))
    if limit is None:  # a limit that is not a USD amount: assume nothing is left
        return KeyStatus(usage, 0.0, 0.0)
    remaining = valid_usd(data.get("limit_remaining"))
    return KeyStatus(usage, limit, max(0.0, limit - usage) if remaining is None else remaining)


async def generation_bill(
    settings: ProviderSettings, key: str, generation_id: str
) -> GenerationBill | None:
    """What OpenRouter billed for one generation (`GET /generation?id=`: `total_cost`,
    `native_tokens_prompt`, `native_tokens_completion`), if it says."""

    base = (settings.api_base or "").rstrip("/")
    if not base:
        return None
    try:
        doc = await get_json(f"{base}/generation?id={quote(generation_id)}", key, 15.0)
    except ProviderConfigError:
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, dict):
        return None
    return GenerationBill(
        valid_usd(data.get("total_cost")),
        _count(data.get("native_tokens_prompt")),
        _count(data.get("native_tokens_completion")),
    )
