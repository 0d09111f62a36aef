"""One provider call through LiteLLM: settings, error classification, retry with backoff.

Everything provider-specific is data in `conf/provider/*.yaml`. The API key is read from
the environment variable the config names and is never stored, logged or raised: error
text that could echo it goes through `scrub`.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import math
import os
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.core.reconstruction import LENGTH_REASONS
from kimi_pipe.errors import ConfigError, ProviderError

log = logging.getLogger(__name__)

_litellm: Any = None


def get_litellm() -> Any:
    """Import LiteLLM lazily (it takes seconds) and offline (no price-map download)."""
    global _litellm
    if _litellm is None:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import litellm

        litellm.suppress_debug_info = True  # no "Give Feedback" banners on every error
        litellm.telemetry = False
        # One INFO line per request from LiteLLM and httpx drowns the progress lines.
        for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy", "httpx"):
            logging.getLogger(name).setLevel(logging.WARNING)
        _litellm = litellm
    return _litellm


class MissingApiKey(ConfigError, RuntimeError):
    pass


class ProviderConfigError(ConfigError):
    pass


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
    max_response_mb: float | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: DictConfig | Mapping[str, Any]) -> ProviderSettings:
        if isinstance(cfg, DictConfig):
            data = OmegaConf.to_container(cfg, resolve=True)
        else:
            data = dict(cfg)
        assert isinstance(data, dict)
        if "api_key" in data:
            raise ProviderConfigError(
                "provider.api_key must not be in the config (it would be saved in .hydra/); "
                f"export {data.get('api_key_env', 'the API key variable')} instead")
        key_env = data.get("api_key_env")
        if key_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(key_env)):
            raise ProviderConfigError(
                "provider.api_key_env must name an environment variable (e.g. "
                "OPENROUTER_API_KEY), not hold the key itself")
        for header in data.get("headers") or {}:
            if any(w in str(header).lower() for w in ("authorization", "key", "token", "cookie")):
                raise ProviderConfigError(
                    f"provider.headers.{header} would carry a credential in the saved config; "
                    f"the key is sent from {key_env or 'the key variable'} in the environment")
        params = {k: v for k, v in (data.get("params") or {}).items() if v is not None}
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
        pricing = data.get("pricing") or {}
        retry = RetryPolicy(**(data.get("retry") or {}))
        if retry.max_attempts < 1:
            raise ProviderConfigError("provider.retry.max_attempts must be >= 1")
        concurrency = int(data.get("concurrency") or 1)
        if concurrency < 1:
            raise ProviderConfigError("provider.concurrency must be >= 1")
        return cls(
            name=str(data["name"]),
            model=str(data["model"]),
            api_base=data.get("api_base"),
            api_key_env=data.get("api_key_env") or None,
            timeout_s=float(data.get("timeout_s") or 600),
            concurrency=concurrency,
            params=params,
            extra_body=extra,
            retry=retry,
            input_usd_per_mtok=pricing.get("input_usd_per_mtok"),
            output_usd_per_mtok=pricing.get("output_usd_per_mtok"),
            fallback_input_usd_per_mtok=pricing.get("fallback_input_usd_per_mtok"),
            fallback_output_usd_per_mtok=pricing.get("fallback_output_usd_per_mtok"),
            models_path=str(data.get("models_path") or "/models"),
            key_path=str(data.get("key_path") or "/key"),
            max_response_mb=(float(data["max_response_mb"])
                             if data.get("max_response_mb") is not None else None),
            extra_headers=dict(data.get("headers") or {}),
        )

    def request_record(self) -> dict[str, Any]:
        """The request parameters as stored with every record (never the key)."""
        return {"model": self.model, "api_base": self.api_base, "timeout_s": self.timeout_s,
                **self.params, "extra_body": self.extra_body}


def _drop_nones(value: Any) -> Any:
    """Routing objects list every option; unset ones (null) are not sent."""
    if isinstance(value, dict):
        return {k: _drop_nones(v) for k, v in value.items() if v is not None}
    return value


def api_key(settings: ProviderSettings) -> str:
    """The key from the environment ("" when the provider needs none)."""
    if settings.api_key_env is None:
        return ""
    key = os.environ.get(settings.api_key_env, "").strip()
    if not key:
        raise MissingApiKey(
            f"no API key: the environment variable {settings.api_key_env} is not set.\n"
            f"  export {settings.api_key_env}=sk-or-v1-...   (https://openrouter.ai/keys)\n"
            "The key is read only from the environment, never from the config.")
    return key


def scrub(text: str, key: str | None) -> str:
    if key and key in text:
        text = text.replace(key, "***")
    return text


# ---------------------------------------------------------------------------------------
# Errors


@dataclass(frozen=True)
class ErrorInfo:
    cls: str  # short stable class: rate_limited, timeout, server_error, payment_required, ...
    status: int | None
    message: str
    action: str  # "retry" | "fail" (this sample) | "stop" (the run)
    retry_after_s: float | None = None

    def to_record(self) -> dict[str, Any]:
        return {"class": self.cls, "message": self.message, "status": self.status}


# LiteLLM's words for an HTTP-200 body it could not turn into a response.
_UNPARSABLE_ANSWER = ("Invalid response object", "codec can't decode")
TOO_LARGE = "exceeds provider.max_response_mb"
_FAIL_STATUS = {400: "bad_request", 403: "forbidden", 404: "not_found", 413: "too_large",
                422: "unprocessable"}
_STOP_STATUS = {401: "auth", 402: "payment_required"}


def parse_retry_after(headers: Any) -> float | None:
    if not headers:
        return None
    try:
        value = headers.get("retry-after") or headers.get("Retry-After")
    except AttributeError:
        return None
    if value is None:
        return None
    value = str(value).strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:  # HTTP-date form
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _headers_of(exc: BaseException) -> Any:
    headers = getattr(exc, "litellm_response_headers", None)
    if headers:
        return headers
    resp = getattr(exc, "response", None)
    return getattr(resp, "headers", None)


def classify_exception(exc: BaseException, key: str | None = None) -> ErrorInfo:
    litellm = get_litellm()
    status = getattr(exc, "status_code", None)
    status = status if isinstance(status, int) else None
    message = scrub(f"{type(exc).__name__}: {exc}", key)[:2000]
    retry_after = parse_retry_after(_headers_of(exc))
    if isinstance(exc, litellm.Timeout | asyncio.TimeoutError | TimeoutError) or status == 408:
        return ErrorInfo("timeout", status, message, "retry", retry_after)
    if status in _STOP_STATUS:
        return ErrorInfo(_STOP_STATUS[status], status, message, "stop")
    if status == 429:
        return ErrorInfo("rate_limited", status, message, "retry", retry_after)
    if status in _FAIL_STATUS:
        return ErrorInfo(_FAIL_STATUS[status], status, message, "fail")
    if TOO_LARGE in message:  # cut off unread: may still have been billed
        return ErrorInfo("response_too_large", status, message, "fail")
    if any(sign in message for sign in _UNPARSABLE_ANSWER):
        # An answer arrived (and was billed) but does not have the shape of one: buying it
        # again would be billed again for the same garbage.
        return ErrorInfo("malformed_response", status, message, "fail")
    if isinstance(exc, litellm.APIConnectionError):
        return ErrorInfo("connection", status, message, "retry", retry_after)
    if status == 200:  # the body could not be read (empty or not JSON)
        return ErrorInfo("bad_body", status, message, "retry", retry_after)
    if status is not None and status >= 500:
        return ErrorInfo("server_error", status, message, "retry", retry_after)
    if isinstance(exc, ConnectionError | OSError) or "connect" in type(exc).__name__.lower():
        return ErrorInfo("connection", status, message, "retry")
    if status is not None and 400 <= status < 500:
        return ErrorInfo(f"http_{status}", status, message, "fail")
    return ErrorInfo("unexpected", status, message, "retry")


def answer_problem(response: Mapping[str, Any]) -> ErrorInfo | None:
    """An HTTP-200 answer that is really a failure: an error body, finish_reason "error",
    no choices, or nothing generated at all (cold starts)."""
    if response.get("error"):
        err = response["error"]
        msg = err.get("message") if isinstance(err, Mapping) else str(err)
        return ErrorInfo("provider_error", 200, str(msg)[:2000], "retry")
    choices = response.get("choices") or []
    if not choices or not isinstance(choices[0], Mapping):
        return ErrorInfo("malformed_response", 200, "no choices in the answer", "fail")
    choice = choices[0]
    psf = choice.get("provider_specific_fields") or {}
    finish = psf.get("native_finish_reason") or choice.get("finish_reason")
    if finish == "error" or choice.get("error"):
        return ErrorInfo("provider_error", 200, "finish_reason error", "retry")
    message = choice.get("message") or {}
    mpsf = message.get("provider_specific_fields") or {}
    parts = [message.get(k) for k in ("content", "tool_calls", "reasoning_content")]
    parts += [mpsf.get(k) for k in ("reasoning", "reasoning_details")]
    parts += [message.get(k) for k in ("reasoning", "reasoning_details")]
    if not any(parts) and finish not in LENGTH_REASONS:
        return ErrorInfo("empty_response", 200, "the answer is empty", "retry")
    return None


# ---------------------------------------------------------------------------------------
# Calls


@dataclass
class Attempt:
    response: dict[str, Any] | None
    cost: float  # USD billed for this attempt (0 when nothing came back)
    completion_tokens: int
    latency_s: float
    error: ErrorInfo | None
    # Billing problems of an answer (cost_invalid, no_usage, usage_invalid): the attempt
    # is booked at its reservation and the sample flagged with these codes.
    billing_flags: list[str] = field(default_factory=list)
    generation_id: str | None = None


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


def response_cost(response: Mapping[str, Any], hidden: Mapping[str, Any] | None,
                  fallback: Callable[[int, int], float] | None) -> tuple[float | None, list[str]]:
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


def generation_id_of(response: Mapping[str, Any] | None, hidden: Mapping[str, Any] | None,
                     headers: Any = None) -> str | None:
    """OpenRouter's generation id: the response `id`, or its `X-Generation-Id` header."""
    extra = (hidden or {}).get("additional_headers") or {}
    for source in (headers, extra):
        try:
            value = source.get("x-generation-id") or source.get(
                "llm_provider-x-generation-id") if source else None
        except AttributeError:
            value = None
        if isinstance(value, str) and value:
            return value
    rid = (response or {}).get("id")
    return rid if isinstance(rid, str) and rid.startswith("gen-") else None


class ResponseTooLarge(ProviderError):
    pass


def size_limited_client(settings: ProviderSettings) -> Any:
    """A LiteLLM HTTP client that stops reading an answer after `provider.max_response_mb`
    (a hostile or broken provider can send gigabytes). LiteLLM takes a `client` for the
    providers it calls through its own HTTP handler (OpenRouter); None for the others,
    which then read whole answers; None as well when no limit is set (LiteLLM's own client,
    which also re-sends a request whose pooled connection dropped). Create it inside the
    running event loop."""
    if settings.max_response_mb is None or not settings.model.startswith("openrouter/"):
        return None
    import httpx
    from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler

    limit = int(settings.max_response_mb * (1 << 20))

    class Limited(httpx.AsyncByteStream):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def __aiter__(self) -> Any:
            seen = 0
            async for chunk in self.inner:
                seen += len(chunk)
                if seen > limit:
                    raise ResponseTooLarge(f"the answer {TOO_LARGE} ({settings.max_response_mb}"
                                           " MB); raise it if such answers are expected")
                yield chunk

        async def aclose(self) -> None:
            await self.inner.aclose()

    class LimitedTransport(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
            self.inner = inner

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            response = await self.inner.handle_async_request(request)
            response.stream = Limited(response.stream)
            return response

        async def aclose(self) -> None:
            await self.inner.aclose()

    inner = AsyncHTTPHandler._create_async_transport() or httpx.AsyncHTTPTransport()
    return AsyncHTTPHandler(timeout=settings.timeout_s, transport=LimitedTransport(inner))


async def attempt_once(
    settings: ProviderSettings, key: str, messages: list[dict], tools: list[dict] | None,
    price_fallback: Callable[[int, int], float] | None = None, http_client: Any = None,
) -> Attempt:
    """One HTTP request; never raises for provider trouble (returns it as `error`)."""
    litellm = get_litellm()
    kwargs: dict[str, Any] = dict(
        # The OpenAI client under LiteLLM insists on a non-empty key even for a local server.
        model=settings.model, messages=messages, api_key=key or "no-key",
        timeout=settings.timeout_s,
        num_retries=0, max_retries=0,  # retries are ours: counted, budgeted, backed off
        **settings.params,
    )
    if settings.api_base:
        kwargs["api_base"] = settings.api_base
    if tools:
        kwargs["tools"] = tools
    if settings.extra_body:
        kwargs["extra_body"] = settings.extra_body
    if settings.extra_headers:
        kwargs["extra_headers"] = settings.extra_headers
    if http_client is not None:
        kwargs["client"] = http_client
    start = time.monotonic()
    try:
        # LiteLLM has its own timeout; wait_for is the backstop for a hanging transport.
        resp = await asyncio.wait_for(litellm.acompletion(**kwargs), settings.timeout_s + 5)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - every provider failure is classified
        return Attempt(None, 0.0, 0, time.monotonic() - start, classify_exception(exc, key),
                       generation_id=generation_id_of(None, None, _headers_of(exc)))
    latency = time.monotonic() - start
    data = resp.model_dump()
    hidden = getattr(resp, "_hidden_params", None) or {}
    cost, flags = response_cost(data, hidden, price_fallback)
    completion = _count(_usage(data).get("completion_tokens")) or 0
    problem = answer_problem(data)
    return Attempt(data, 0.0 if cost is None else cost, completion, latency, problem, flags,
                   generation_id_of(data, hidden))


@dataclass
class CallResult:
    response: dict[str, Any] | None
    cost: float  # USD of the attempt that answered (0 when none did)
    completion_tokens: int  # billed completion tokens of that attempt
    latency_s: float  # of the attempt that answered (or the last one)
    attempts: int
    error: ErrorInfo | None  # set when no usable answer came back
    attempt_errors: list[str] = field(default_factory=list)
    billing_flags: list[str] = field(default_factory=list)  # of the answering attempt


# The caller's budget hooks: reserve before an attempt (None: no money left -> give up),
# settle after it with (reservation, the attempt as booked, answered).
Reserve = Callable[[], Awaitable[Any]]
Settle = Callable[[Any, Attempt, bool], None]
# Called for every failed attempt with (error, attempt number, its cost, its tokens).
OnFailed = Callable[[ErrorInfo, int, float, int], None]

# Failures after which the provider may have generated (and billed) an answer we never saw
# or could not read: booked at the attempt's worst case.
BILLED_UNSEEN = frozenset({"timeout", "malformed_response", "bad_body", "response_too_large"})
# Billing flags after which the answer's own cost cannot be trusted.
UNTRUSTED_COST = frozenset({"cost_invalid", "no_usage", "usage_invalid"})
OVERBILLED = "billed_above_reservation"

STOPPED = ErrorInfo("stopped", None, "the run is stopping", "stop")
NO_BUDGET = ErrorInfo("budget", None, "budget cap reached", "stop")


def book(attempt: Attempt, reservation: Any) -> Attempt:
    """The attempt as it goes into the budget: never an unvalidated or unseen cost."""
    reserved = float(getattr(reservation, "usd", 0.0))
    flags = list(attempt.billing_flags)
    if (attempt.error is not None and attempt.error.cls in BILLED_UNSEEN) or (
        set(flags) & UNTRUSTED_COST
    ):
        tokens = attempt.completion_tokens
        if set(flags) & {"no_usage", "usage_invalid"}:
            tokens = int(getattr(reservation, "output_tokens", 0))
        return replace(attempt, cost=reserved, completion_tokens=tokens)
    if attempt.cost > reserved + 1e-12:
        flags.append(OVERBILLED)
    return replace(attempt, billing_flags=flags)


async def call_with_retries(
    settings: ProviderSettings, key: str, messages: list[dict], tools: list[dict] | None,
    reserve: Reserve, settle: Settle, rng: random.Random,
    price_fallback: Callable[[int, int], float] | None = None,
    on_failed: OnFailed | None = None,
    stop_event: asyncio.Event | None = None,
    max_attempts: int | None = None,
    http_client: Any = None,
) -> CallResult:
    """Attempts until an answer, a non-retryable error, `max_attempts` (default
    `retry.max_attempts`), no budget, or `stop_event`. Backoff is exponential with jitter
    and at least any `Retry-After`."""
    limit = settings.retry.max_attempts if max_attempts is None else max_attempts
    errors: list[str] = []
    last: Attempt | None = None
    attempts = 0
    while True:
        if stop_event is not None and stop_event.is_set():
            return CallResult(None, 0.0, 0, 0.0, attempts, STOPPED, errors)
        reservation = await reserve()
        if reservation is None:
            return CallResult(None, 0.0, 0, 0.0, attempts, NO_BUDGET, errors)
        attempts += 1
        last = book(await attempt_once(settings, key, messages, tools, price_fallback,
                                       http_client), reservation)
        ok = last.error is None
        settle(reservation, last, ok)
        if ok:
            return CallResult(last.response, last.cost, last.completion_tokens, last.latency_s,
                              attempts, None, errors, last.billing_flags)
        err = last.error
        assert err is not None
        errors.append(err.cls)
        if on_failed is not None:
            on_failed(err, attempts, last.cost, last.completion_tokens)
        if err.action != "retry" or attempts >= limit:
            return CallResult(None, 0.0, 0, last.latency_s, attempts, err, errors)
        delay = settings.retry.backoff(attempts, rng)
        if err.retry_after_s is not None:
            delay = max(delay, min(err.retry_after_s, settings.retry.max_retry_after_s))
        log.debug("retry in %.2fs after %s", delay, err.cls)
        await asyncio.sleep(delay)


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
                "provider.pricing.input_usd_per_mtok and output_usd_per_mtok")
        out.append(usd)
    return out[0], out[1]


class PriceError(ProviderConfigError):
    """Prices that exist but cannot be trusted: never replaced by fallback prices."""


async def fetch_pricing(settings: ProviderSettings, key: str) -> tuple[float, float, str]:
    """USD per token (input, output) and where they came from: the config, else the
    provider's model listing (`GET {api_base}/models`, OpenRouter's `pricing.prompt` /
    `pricing.completion`), else the configured fallback prices. Prices must be finite and
    >= 0 (config) or >= MIN_LISTED_USD_PER_MTOK (listing)."""
    if settings.input_usd_per_mtok is not None and settings.output_usd_per_mtok is not None:
        fin, fout = _checked_prices(
            (settings.input_usd_per_mtok / 1e6, settings.output_usd_per_mtok / 1e6),
            "provider.pricing", 0.0)
        return fin, fout, "config"
    try:
        return (*await _listed_prices(settings, key), "listing")
    except PriceError:
        raise
    except ProviderConfigError as exc:
        fin, fout = settings.fallback_input_usd_per_mtok, settings.fallback_output_usd_per_mtok
        if fin is None or fout is None:
            raise
        log.warning("%s; using the fallback prices $%s/$%s per Mtok", exc, fin, fout)
        fin, fout = _checked_prices((fin / 1e6, fout / 1e6), "provider.pricing.fallback", 0.0)
        return fin, fout, "fallback"


def _number(value: Any) -> Any:
    """A listing's price string ("0.0000006") as a number; anything else unchanged."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


async def _listed_prices(settings: ProviderSettings, key: str) -> tuple[float, float]:
    base = (settings.api_base or "").rstrip("/")
    model_id = settings.model.split("/", 1)[1] if "/" in settings.model else settings.model
    how = ("set provider.pricing.input_usd_per_mtok and provider.pricing.output_usd_per_mtok "
           "(USD per million tokens)")
    if not base:
        raise ProviderConfigError(f"no api_base to read prices from; {how}")
    url = base + settings.models_path
    try:
        listing = await get_json(url, key)
    except ProviderConfigError as exc:
        raise ProviderConfigError(f"{exc}; {how}") from None
    for entry in listing.get("data", []) if isinstance(listing, dict) else []:
        if isinstance(entry, dict) and entry.get("id") == model_id:
            pricing = entry.get("pricing")
            if not isinstance(pricing, dict) or not {"prompt", "completion"} <= set(pricing):
                break
            return _checked_prices((_number(pricing["prompt"]), _number(pricing["completion"])),
                                   f"{url} ({model_id})", MIN_LISTED_USD_PER_MTOK)
    raise ProviderConfigError(f"{url} lists no prices for {model_id!r}; {how}")


async def get_json(url: str, key: str, timeout_s: float = 30.0) -> Any:
    """GET a small JSON document from the provider (listing, key, generation stats)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            resp = await client.get(url, headers=headers)
            resp.raise_for_status()
            if len(resp.content) > 4 << 20:
                raise ValueError(f"{len(resp.content)} bytes is not a small JSON document")
            return resp.json()
    except (httpx.HTTPError, ValueError, RecursionError) as exc:
        raise ProviderConfigError(f"cannot read {url}: {scrub(str(exc), key)[:300]}") from None


@dataclass(frozen=True)
class KeyStatus:
    """OpenRouter's `GET /key`: USD used by the key so far and its credit limit."""

    usage: float
    limit: float | None  # None: the key has no credit limit
    limit_remaining: float | None


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
        log.warning("%s%s: usage %r is not a USD amount; ignored", base, settings.key_path,
                    data.get("usage"))
        return None
    if data.get("limit") is None:
        return KeyStatus(usage, None, None)
    limit = valid_usd(data.get("limit"))
    if limit is None:  # a limit that is not a USD amount: assume nothing is left
        return KeyStatus(usage, 0.0, 0.0)
    remaining = valid_usd(data.get("limit_remaining"))
    return KeyStatus(usage, limit, max(0.0, limit - usage) if remaining is None else remaining)


async def generation_cost(settings: ProviderSettings, key: str, generation_id: str) -> float | None:
    """What the provider billed for one generation (`GET /generation?id=`), if it says."""
    from urllib.parse import quote

    base = (settings.api_base or "").rstrip("/")
    if not base:
        return None
    try:
        doc = await get_json(f"{base}/generation?id={quote(generation_id)}", key, 15.0)
    except ProviderConfigError:
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    return valid_usd(data.get("total_cost")) if isinstance(data, dict) else None
