"""One provider call through LiteLLM: error classification, the attempt, retry with backoff.

Everything provider-specific is data in `conf/provider/*.yaml` (providers/settings.py). The
API key is read from the environment variable the config names and is never stored, logged
or raised: error text that could echo it goes through `scrub`.

Why about 540 lines: one attempt's whole life (the call, the wire tap, classifying what came
back, booking what it may have cost) is read and reviewed as one piece: a mistake between two
of its steps is a lost dollar or a lost answer.
"""

from __future__ import annotations

import asyncio
import contextvars
import email.utils
import json
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kimi_pipe.core.issue_codes import (
    BILLED_ABOVE_RESERVATION,
    BILLED_ERROR_BODY,
    COST_BELOW_LISTED_PRICE,
    TOOL_ARGUMENTS_NOT_STRING,
    Code,
)
from kimi_pipe.core.reconstruction import LENGTH_REASONS
from kimi_pipe.providers.costs import _count, _usage, response_cost
from kimi_pipe.providers.credentials import scrub
from kimi_pipe.providers.errors import NO_BUDGET, STOPPED, ErrorInfo, ResponseTooLarge
from kimi_pipe.providers.settings import ProviderSettings

log = logging.getLogger(__name__)

_litellm: Any = None


def get_litellm() -> Any:
    """Import LiteLLM lazily (it takes seconds) and offline (no price-map download)."""
    global _litellm
    if _litellm is None:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import litellm  # optional dep

        litellm.suppress_debug_info = True  # no "Give Feedback" banners on every error
        litellm.telemetry = False
        # One INFO line per request from LiteLLM and httpx drowns the progress lines.
        for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy", "httpx"):
            logging.getLogger(name).setLevel(logging.WARNING)
        _litellm = litellm
    return _litellm


# LiteLLM's words for an HTTP-200 body it could not turn into a response.
_UNPARSABLE_ANSWER = ("Invalid response object", "codec can't decode")
TOO_LARGE = "exceeds provider.max_response_mb"
_FAIL_STATUS = {
    400: "bad_request",
    403: "forbidden",
    404: "not_found",
    413: "too_large",
    422: "unprocessable",
}
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
    if LOST_AFTER_SEND in message:  # the provider may have billed an answer we never saw
        return ErrorInfo("connection_lost", status, message, "retry", retry_after)
    if TOO_LARGE in message:  # cut off unread: may still have been billed
        return ErrorInfo("response_too_large", status, message, "fail")
    if any(sign in message for sign in _UNPARSABLE_ANSWER):
        # An answer arrived (and was billed) but does not have the shape of one: buying it
        # again would be billed again for the same garbage.
        return ErrorInfo(Code.MALFORMED_RESPONSE, status, message, "fail")
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
        return ErrorInfo(Code.PROVIDER_ERROR, 200, str(msg)[:2000], "retry")
    choices = response.get("choices") or []
    if not choices or not isinstance(choices[0], Mapping):
        return ErrorInfo(Code.MALFORMED_RESPONSE, 200, "no choices in the answer", "fail")
    choice = choices[0]
    psf = choice.get("provider_specific_fields") or {}
    finish = psf.get("native_finish_reason") or choice.get("finish_reason")
    if finish == "error" or choice.get("error"):
        return ErrorInfo(Code.PROVIDER_ERROR, 200, "finish_reason error", "retry")
    message = choice.get("message") or {}
    mpsf = message.get("provider_specific_fields") or {}
    parts = [message.get(k) for k in ("content", "tool_calls", "reasoning_content")]
    parts += [mpsf.get(k) for k in ("reasoning", "reasoning_details")]
    parts += [message.get(k) for k in ("reasoning", "reasoning_details")]
    if not any(parts) and finish not in LENGTH_REASONS:
        return ErrorInfo(Code.EMPTY_RESPONSE, 200, "the answer is empty", "retry")
    return None


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
    prompt_tokens: int | None = None  # as the answer's usage states them (None: unknown)
    # What the wire showed that LiteLLM's parsed answer hides (tool_arguments_not_string).
    wire_flags: list[str] = field(default_factory=list)


def generation_id_of(
    response: Mapping[str, Any] | None, hidden: Mapping[str, Any] | None, headers: Any = None
) -> str | None:
    """OpenRouter's generation id: the response `id`, or its `X-Generation-Id` header."""
    extra = (hidden or {}).get("additional_headers") or {}
    for source in (headers, extra):
        try:
            value = (
                source.get("x-generation-id") or source.get("llm_provider-x-generation-id")
                if source
                else None
            )
        except AttributeError:
            value = None
        if isinstance(value, str) and value:
            return value
    rid = (response or {}).get("id")
    return rid if isinstance(rid, str) and rid.startswith("gen-") else None


@dataclass
class WireTap:
    """What the HTTP layer saw of one attempt, below LiteLLM: the raw body (up to
    INSPECT_LIMIT) and whether the connection died after the request had been sent."""

    status: int | None = None
    body: bytearray = field(default_factory=bytearray)
    body_complete: bool = False
    lost_after_send: bool = False

    def json(self) -> dict[str, Any] | None:
        if not self.body_complete or not self.body:
            return None
        try:
            doc = json.loads(bytes(self.body))
        except (ValueError, RecursionError):
            return None
        return doc if isinstance(doc, dict) else None


_TAP: contextvars.ContextVar[WireTap | None] = contextvars.ContextVar("wire_tap", default=None)
INSPECT_LIMIT = 16 << 20  # bodies above this are not inspected again (answers are far smaller)
# Our words for a connection that died after the request went out: the provider may have
# generated and billed the answer. Not an httpx.RemoteProtocolError, so LiteLLM's handler
# does not re-send it unseen on a fresh connection: our retry loop books and re-sends it.
LOST_AFTER_SEND = "the connection was lost after the request was sent"


def http_client_for(settings: ProviderSettings) -> Any:
    """The LiteLLM HTTP client for providers it calls through its own handler (OpenRouter):
    it stops reading an answer after `provider.max_response_mb` (a hostile or broken
    provider can send gigabytes), keeps the raw body for the checks LiteLLM's parsing hides
    (an error body that states what it billed, tool arguments sent as objects) and turns a
    connection lost after sending into our own error instead of LiteLLM's silent re-send.
    None for other providers (their SDK client reads whole answers). Create it inside the
    running event loop."""
    if not settings.model.startswith("openrouter/"):
        return None
    get_litellm()  # first: its import settings (no price-map download)
    import httpx  # optional dep
    from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler  # optional dep

    limit = None if settings.max_response_mb is None else int(settings.max_response_mb * (1 << 20))

    def _connected(exc: httpx.ConnectError) -> bool:
        """LiteLLM's aiohttp transport maps a reset of an open connection (ClientOSError)
        to httpx.ConnectError too; only a failure to connect is one."""
        cause = exc.__cause__ or exc.__context__
        try:
            import aiohttp  # optional dep
        except ImportError:
            return False
        if cause is None or isinstance(cause, aiohttp.ClientConnectorError):
            return False
        return isinstance(cause, aiohttp.ClientOSError | aiohttp.ServerDisconnectedError)

    def lost(exc: Exception) -> Exception:
        tap = _TAP.get()
        if tap is not None:
            tap.lost_after_send = True
        return httpx.ReadError(f"{LOST_AFTER_SEND} ({type(exc).__name__}: {exc})")

    class Tapped(httpx.AsyncByteStream):
        def __init__(self, inner: Any, tap: WireTap | None) -> None:
            self.inner = inner
            self.tap = tap

        async def __aiter__(self) -> Any:
            seen = 0
            try:
                async for chunk in self.inner:
                    seen += len(chunk)
                    if limit is not None and seen > limit:
                        raise ResponseTooLarge(
                            f"the answer {TOO_LARGE} ({settings.max_response_mb} MB); raise "
                            "it if such answers are expected"
                        )
                    if self.tap is not None and seen <= INSPECT_LIMIT:
                        self.tap.body += chunk
                    yield chunk
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                raise lost(exc) from None
            if self.tap is not None:
                self.tap.body_complete = seen <= INSPECT_LIMIT

        async def aclose(self) -> None:
            await self.inner.aclose()

    class TappedTransport(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
            self.inner = inner

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            tap = _TAP.get()
            try:
                response = await self.inner.handle_async_request(request)
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                raise lost(exc) from None
            except httpx.ConnectError as exc:
                if not _connected(exc):
                    raise  # never reached the provider: LiteLLM may re-send it, unbilled
                raise lost(exc) from None
            if tap is not None:
                tap.status = response.status_code
            response.stream = Tapped(response.stream, tap)
            return response

        async def aclose(self) -> None:
            await self.inner.aclose()

    inner = AsyncHTTPHandler._create_async_transport() or httpx.AsyncHTTPTransport()
    return AsyncHTTPHandler(timeout=settings.timeout_s, transport=TappedTransport(inner))


# Kept for callers of the old name.
size_limited_client = http_client_for


def tool_arguments_not_strings(raw: Mapping[str, Any] | None) -> bool:
    """Whether the provider sent a tool call's `arguments` as something other than the
    string the model wrote (an object it parsed): LiteLLM re-serialises it, so the text,
    and the ids rebuilt from it, are the provider's, not the model's."""
    choices = (raw or {}).get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return False
    message = choices[0].get("message")
    calls = message.get("tool_calls") if isinstance(message, Mapping) else None
    for call in calls if isinstance(calls, list) else []:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping) and "arguments" in fn and not isinstance(fn["arguments"], str):
            return True
    return False


async def attempt_once(
    settings: ProviderSettings,
    key: str,
    messages: list[dict],
    tools: list[dict] | None,
    price_fallback: Callable[[int, int], float] | None = None,
    http_client: Any = None,
) -> Attempt:
    """One HTTP request; never raises for provider trouble (returns it as `error`)."""
    litellm = get_litellm()
    kwargs: dict[str, Any] = dict(
        # The OpenAI client under LiteLLM insists on a non-empty key even for a local server.
        model=settings.model,
        messages=messages,
        api_key=key or "no-key",
        timeout=settings.timeout_s,
        num_retries=0,
        max_retries=0,  # retries are ours: counted, budgeted, backed off
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
    tap = WireTap()
    token = _TAP.set(tap)
    start = time.monotonic()
    try:
        # LiteLLM has its own timeout; wait_for is the backstop for a hanging transport.
        resp = await asyncio.wait_for(litellm.acompletion(**kwargs), settings.timeout_s + 5)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - every provider failure is classified
        latency = time.monotonic() - start
        info = classify_exception(exc, key)
        raw = tap.json() if tap.status == 200 else None
        if raw is not None and raw.get("error") and isinstance(raw.get("usage"), Mapping):
            # An error body that carries usage was billed, whatever else it says.
            cost, flags = response_cost(raw, None, price_fallback)
            usage = _usage(raw)
            return Attempt(
                None,
                0.0 if cost is None else cost,
                _count(usage.get("completion_tokens")) or 0,
                latency,
                replace(info, cls=Code.PROVIDER_ERROR),
                [*flags, BILLED_ERROR_BODY],
                generation_id_of(raw, None, _headers_of(exc)),
                prompt_tokens=_count(usage.get("prompt_tokens")),
            )
        return Attempt(
            None,
            0.0,
            0,
            latency,
            info,
            generation_id=generation_id_of(None, None, _headers_of(exc)),
        )
    finally:
        _TAP.reset(token)
    latency = time.monotonic() - start
    data = resp.model_dump()
    hidden = getattr(resp, "_hidden_params", None) or {}
    cost, flags = response_cost(data, hidden, price_fallback)
    usage = _usage(data)
    completion = _count(usage.get("completion_tokens")) or 0
    problem = answer_problem(data)
    wire: list[str] = []
    if tap.body and b"tool_calls" in tap.body and tool_arguments_not_strings(tap.json()):
        wire.append(TOOL_ARGUMENTS_NOT_STRING)
    return Attempt(
        data,
        0.0 if cost is None else cost,
        completion,
        latency,
        problem,
        flags,
        generation_id_of(data, hidden),
        prompt_tokens=_count(usage.get("prompt_tokens")),
        wire_flags=wire,
    )


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
    wire_flags: list[str] = field(default_factory=list)  # of the answering attempt


# The caller's budget hooks: reserve before an attempt (None: no money left -> give up),
# settle after it with (reservation, the attempt as booked, answered).
Reserve = Callable[[], Awaitable[Any]]
Settle = Callable[[Any, Attempt, bool], None]
# Called for every failed attempt with (error, attempt number, its cost, its tokens).
OnFailed = Callable[[ErrorInfo, int, float, int], None]

# Failures after which the provider may have generated (and billed) an answer we never saw
# or could not read: booked at the attempt's worst case.
BILLED_UNSEEN = frozenset(
    {"timeout", Code.MALFORMED_RESPONSE, "bad_body", "response_too_large", "connection_lost"}
)
# Billing flags after which the answer's own cost cannot be trusted.
UNTRUSTED_COST = frozenset({"cost_invalid", Code.NO_USAGE, "usage_invalid"})
OVERBILLED = BILLED_ABOVE_RESERVATION
# A stated cost below tokens x listed price: the floor is booked instead.
BELOW_LISTED = COST_BELOW_LISTED_PRICE
# Relative slack before a stated cost counts as below the floor (float rounding of prices).
FLOOR_SLACK = 1e-6


def book(
    attempt: Attempt, reservation: Any, price_floor: Callable[[int, int], float] | None = None
) -> Attempt:
    """The attempt as it goes into the budget: never an unvalidated or unseen cost, and
    never less than its tokens at the listed prices (`price_floor`) when both are known."""
    reserved = float(getattr(reservation, "usd", 0.0))
    flags = list(attempt.billing_flags)
    if (attempt.error is not None and attempt.error.cls in BILLED_UNSEEN) or (
        set(flags) & UNTRUSTED_COST
    ):
        tokens = attempt.completion_tokens
        if set(flags) & {Code.NO_USAGE, "usage_invalid"}:
            tokens = int(getattr(reservation, "output_tokens", 0))
        return replace(attempt, cost=reserved, completion_tokens=tokens)
    if (
        price_floor is not None
        and attempt.prompt_tokens is not None
        and (attempt.response is not None or BILLED_ERROR_BODY in flags)
    ):
        floor = price_floor(attempt.prompt_tokens, attempt.completion_tokens)
        if attempt.cost < floor * (1 - FLOOR_SLACK) - 1e-12:
            log.warning(
                "an answer states $%.6f, below its tokens at the listed prices "
                "($%.6f): the floor is booked",
                attempt.cost,
                floor,
            )
            flags.append(BELOW_LISTED)
            attempt = replace(attempt, cost=floor)
    if attempt.cost > reserved + 1e-12:
        flags.append(OVERBILLED)
    return replace(attempt, billing_flags=flags)


async def call_with_retries(
    settings: ProviderSettings,
    key: str,
    messages: list[dict],
    tools: list[dict] | None,
    reserve: Reserve,
    settle: Settle,
    rng: random.Random,
    price_fallback: Callable[[int, int], float] | None = None,
    on_failed: OnFailed | None = None,
    stop_event: asyncio.Event | None = None,
    max_attempts: int | None = None,
    http_client: Any = None,
    price_floor: Callable[[int, int], float] | None = None,
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
        last = book(
            await attempt_once(settings, key, messages, tools, price_fallback, http_client),
            reservation,
            price_floor,
        )
        ok = last.error is None
        settle(reservation, last, ok)
        if ok:
            return CallResult(
                last.response,
                last.cost,
                last.completion_tokens,
                last.latency_s,
                attempts,
                None,
                errors,
                last.billing_flags,
                last.wire_flags,
            )
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
