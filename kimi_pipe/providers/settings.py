"""A provider's settings as the config states them (`conf/provider/*.yaml`), checked."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kimi_pipe.config import typed_settings, whole_number
from kimi_pipe.core.plain import plain
from kimi_pipe.providers.credentials import header_carries_credential, valid_env_name
from kimi_pipe.providers.errors import ProviderConfigError


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 6
    base_delay_s: float = 1.0
    max_delay_s: float = 60.0
    jitter: float = 0.5  # a delay is drawn from [d*(1-jitter), d]
    max_retry_after_s: float = 300.0  # longest Retry-After honoured
    # Stop the run after this many samples in a row failed without retry (400/403/...):
    # almost always a wrong model name or parameter, not bad prompts.
    max_consecutive_failures: int = 20

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Delay after failed attempt number `attempt` (1-based)."""
        delay = min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1))
        return delay * (1.0 - self.jitter * rng.random())


@dataclass(frozen=True)
class ProviderSettings:
    name: str
    model: str
    api_base: str | None
    api_key_env: str | None  # None: the server needs no key (a local server)
    timeout_s: float
    concurrency: int
    params: dict[str, Any]  # top-level OpenAI sampling params (max_tokens, temperature, ...)
    extra_body: dict[str, Any]  # provider-only fields merged into the body (routing, reasoning)
    retry: RetryPolicy
    input_usd_per_mtok: float | None = None
    output_usd_per_mtok: float | None = None
    fallback_input_usd_per_mtok: float | None = None
    fallback_output_usd_per_mtok: float | None = None
    models_path: str = "/models"
    key_path: str = "/key"
    # The provider's account endpoints (price listing, key usage, generation cost):
    # "openrouter", or None for a provider without them (providers/account.py).
    account: str | None = None
    max_response_mb: float | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)
    # The provider's rate limits over `rate_window_s` (None: not paced; providers/pacing.py).
    rpm: int | None = None
    tpm: int | None = None
    rate_window_s: float = 60.0

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ProviderSettings:
        data = plain(cfg)
        if not isinstance(data, dict):
            raise ProviderConfigError(f"provider: a mapping of settings, not {cfg!r}")
        if "api_key" in data:
            raise ProviderConfigError(
                "provider.api_key must not be in the config (it would be saved in .hydra/); "
                f"export {data.get('api_key_env', 'the API key variable')} instead"
            )
        key_env = data.get("api_key_env")
        if key_env and not valid_env_name(str(key_env)):
            raise ProviderConfigError(
                "provider.api_key_env must name an environment variable (e.g. "
                "OPENROUTER_API_KEY), not hold the key itself"
            )
        for header in data.get("headers") or {}:
            if header_carries_credential(str(header)):
                raise ProviderConfigError(
                    f"provider.headers.{header} would carry a credential in the saved config; "
                    f"the key is sent from {key_env or 'the key variable'} in the environment"
                )
        params = {k: v for k, v in (data.get("params") or {}).items() if v is not None}
        # The sampling params have no schema (sent as given) and a null price none either: the
        # values a typo in kind would send to the provider, or into the budget's arithmetic,
        # are checked here, whoever composed the config.
        whole_number(params.get("max_tokens"), "provider.params.max_tokens")
        for key in ("temperature", "top_p"):
            _number(params.get(key), f"provider.params.{key}")
        pricing = data.get("pricing") or {}
        for key, value in pricing.items():
            _number(value, f"provider.pricing.{key}")
        _number(data.get("max_response_mb"), "provider.max_response_mb")
        extra: dict[str, Any] = {}
        for key, body_key in (data.get("extra_body_keys") or {}).items():
            value = _drop_nones(data.get(key))
            if value not in (None, {}, []):
                extra[body_key] = value
        extra.update(_drop_nones(data.get("extra_body")) or {})
        if data.get("logprobs"):
            # Only providers that honour every parameter return logprobs: route to those.
            params["logprobs"] = True
            routing_key = (data.get("extra_body_keys") or {}).get("routing")
            if routing_key:
                extra[routing_key] = {**(extra.get(routing_key) or {}), "require_parameters": True}
        retry = typed_settings(data.get("retry"), RetryPolicy, "provider.retry")
        if retry.max_attempts < 1:
            raise ProviderConfigError(
                f"provider.retry.max_attempts={retry.max_attempts}: must be >= 1"
            )
        # Unset means one request at a time; a value given must be one (0 is not "unset").
        concurrency = whole_number(data.get("concurrency"), "provider.concurrency")
        if concurrency is not None and concurrency < 1:
            raise ProviderConfigError(
                f"provider.concurrency={concurrency}: give the number of requests in flight "
                "at once, a whole number >= 1"
            )
        rates = {k: whole_number(data.get(k), f"provider.{k}") for k in ("rpm", "tpm")}
        for key, value in rates.items():
            if value is not None and value < 1:
                raise ProviderConfigError(
                    f"provider.{key}={value}: give the provider's limit per "
                    "provider.rate_window_s (a whole number >= 1), or null for none"
                )
        window = data.get("rate_window_s", 60.0)
        if isinstance(window, bool) or not isinstance(window, int | float) or not window > 0:
            raise ProviderConfigError(
                f"provider.rate_window_s={window}: give the seconds the provider's limits "
                "count over (60 for limits per minute)"
            )
        timeout_s = data.get("timeout_s")
        number = isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool)
        if timeout_s is not None and not (number and timeout_s > 0):
            raise ProviderConfigError(
                f"provider.timeout_s={timeout_s}: give the seconds one request may take (> 0)"
            )
        return cls(
            name=str(data["name"]),
            model=str(data["model"]),
            api_base=data.get("api_base"),
            api_key_env=data.get("api_key_env") or None,
            timeout_s=float(timeout_s) if timeout_s is not None else 600.0,
            concurrency=concurrency or 1,
            params=params,
            extra_body=extra,
            retry=retry,
            input_usd_per_mtok=pricing.get("input_usd_per_mtok"),
            output_usd_per_mtok=pricing.get("output_usd_per_mtok"),
            fallback_input_usd_per_mtok=pricing.get("fallback_input_usd_per_mtok"),
            fallback_output_usd_per_mtok=pricing.get("fallback_output_usd_per_mtok"),
            models_path=str(data.get("models_path") or "/models"),
            key_path=str(data.get("key_path") or "/key"),
            account=str(data["account"]) if data.get("account") else None,
            max_response_mb=(
                float(data["max_response_mb"]) if data.get("max_response_mb") is not None else None
            ),
            extra_headers=dict(data.get("headers") or {}),
            rpm=rates["rpm"],
            tpm=rates["tpm"],
            rate_window_s=float(window),
        )

    def request_record(self) -> dict[str, Any]:
        """The request parameters as stored with every record (never the key)."""
        return {
            "model": self.model,
            "api_base": self.api_base,
            "timeout_s": self.timeout_s,
            **self.params,
            "extra_body": self.extra_body,
        }


def _number(value: Any, key: str) -> None:
    """A setting that is null or a number; a ProviderConfigError naming `key` otherwise."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ProviderConfigError(f"{key}={value!r}: expected a number")


def _drop_nones(value: Any) -> Any:
    """Routing objects list every option; unset ones (null) are not sent."""
    if isinstance(value, dict):
        return {k: _drop_nones(v) for k, v in value.items() if v is not None}
    return value
