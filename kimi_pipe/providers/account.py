"""A provider's account endpoints, chosen by `provider.account`: what the provider lists
as prices, what its key has used, what one generation was billed. A provider without them
(a local server, another OpenAI-compatible API) gets `NoAccount`: no listing (the config's
or the fallback prices hold), no key status, no per-generation cost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kimi_pipe.errors import ConfigError
from kimi_pipe.plugins import ACCOUNTS, resolve_plugin
from kimi_pipe.providers import openrouter_account
from kimi_pipe.providers.errors import ProviderConfigError
from kimi_pipe.providers.money import GenerationBill, KeyStatus
from kimi_pipe.providers.settings import ProviderSettings


class Account(Protocol):
    async def listed_prices(self, key: str) -> tuple[float, float]: ...

    async def key_status(self, key: str) -> KeyStatus | None: ...

    async def generation_bill(self, key: str, generation_id: str) -> GenerationBill | None: ...


@dataclass(frozen=True)
class NoAccount:
    settings: ProviderSettings

    async def listed_prices(self, key: str) -> tuple[float, float]:
        raise ProviderConfigError(
            f"provider {self.settings.name} has no price listing (provider.account is null); "
            "set provider.pricing.input_usd_per_mtok and provider.pricing.output_usd_per_mtok "
            "(USD per million tokens)"
        )

    async def key_status(self, key: str) -> KeyStatus | None:
        return None

    async def generation_bill(self, key: str, generation_id: str) -> GenerationBill | None:
        return None


@dataclass(frozen=True)
class OpenRouterAccount:
    settings: ProviderSettings

    async def listed_prices(self, key: str) -> tuple[float, float]:
        return await openrouter_account.listed_prices(self.settings, key)

    async def key_status(self, key: str) -> KeyStatus | None:
        return await openrouter_account.key_status(self.settings, key)

    async def generation_bill(self, key: str, generation_id: str) -> GenerationBill | None:
        return await openrouter_account.generation_bill(self.settings, key, generation_id)


def account_for(settings: ProviderSettings) -> Account:
    """`provider.account`: null (NoAccount), a name in kimi_pipe/plugins.py's ACCOUNTS, or
    `package.module:Class` of your own (a class taking the ProviderSettings)."""
    if settings.account is None:
        return NoAccount(settings)
    try:
        cls = resolve_plugin("provider.account", settings.account, ACCOUNTS)
    except ConfigError as exc:
        raise ProviderConfigError(f"{exc} (or null)") from None
    return cls(settings)  # type: ignore[no-any-return]
