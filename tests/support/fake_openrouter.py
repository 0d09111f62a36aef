"""A real HTTP server on 127.0.0.1 that speaks OpenRouter's chat-completions wire format.

It stands in for OpenRouter (which cannot be reached from tests). Every request goes over
a real socket; the bodies are what OpenRouter sends: top-level ``provider``, ``usage.cost``,
``reasoning``/``reasoning_details``, ``tool_calls``, ``{"error": {...}}`` bodies.

API
---
    from tests.fake_openrouter import Behaviour, FakeOpenRouter

    with FakeOpenRouter(default=Behaviour(), behaviours={"slow": Behaviour(delay_s=0.2)}) as srv:
        srv.url()          # "http://127.0.0.1:PORT/api/v1"       -> default behaviour
        srv.url("slow")    # "http://127.0.0.1:PORT/p/slow/api/v1" -> behaviours["slow"]
        ...
        srv.total_cost()          # USD billed over all behaviours (thread-safe)
        srv.total_cost("slow")    # USD billed by one behaviour
        srv.bills                 # list[Bill]: one per billed answer
        srv.requests              # list[SeenRequest]: every chat request (body, headers, time)

Endpoints (under each base url): ``POST /chat/completions`` (non-streaming),
``GET /models`` (model listing with per-token ``pricing``), ``GET /generation?id=``,
``GET /key`` (the key's ``usage`` = what this behaviour billed, ``limit``,
``limit_remaining``; 404 unless ``key_limit`` or ``key_endpoint`` is set).

A ``Behaviour`` is one simulated upstream provider:
  - ``reasoning_field``: how reasoning comes back: ``reasoning`` (OpenRouter: ``reasoning``
    plus ``reasoning_details``), ``reasoning_content``, ``reasoning_details`` (only the
    blocks), ``think_in_content`` (``{reasoning}</think>{content}`` in content), ``none``.
  - ``strip_whitespace``: strip reasoning/content like old SGLang parsers did.
  - ``tool_call_ids``: ``native`` (``functions.NAME:IDX``) or ``call`` (``call_<hex>``).
  - ``delay_s``: sleep before answering; ``error_rate`` + ``error_mode``: that fraction of
    requests gets that failure mode.
  - ``script``: ``{trigger: [mode, mode, ...]}``; a request whose messages contain the text
    ``trigger`` gets the next mode of the list on each attempt (then ``ok``).
  - ``credit_usd``: like an account's credit; once billed reaches it, answers are 402.
  - prices (USD per token) and a ``counter`` that counts prompt/completion tokens
    (default: about 4 characters per token; tests pass an exact Kimi counter).
  - ``list_models``: False makes ``GET /models`` a 404 (a server with no price listing).

Failure modes: ``ok``, ``429`` (with ``Retry-After: retry_after``), ``408``, ``500``,
``502``, ``503``, ``400``, ``401``, ``402``, ``403``, ``200error`` (HTTP 200 with an
error body), ``empty`` (HTTP 200, empty message, prompt billed), ``emptybody`` (HTTP 200,
zero-length body), ``hang`` (no answer for ``hang_s``), ``reset`` (socket closed, no reply).

Hostile modes (each answer is billed at its true cost in the ledger, whatever it says):
``cost_nan``, ``cost_inf``, ``cost_neg``, ``cost_true``, ``cost_under`` (usage.cost a tenth
of the bill), ``no_usage`` (no usage object); ``finish_list``, ``tool_calls_str``,
``message_null`` (an answer that does not parse); ``other_model``, ``dated_model``,
``no_model`` (the answer without its ``model``),
``finish_null``, ``finish_unknown``, ``content_filter``; ``surrogate`` (a lone ``\ud800``
in the content), ``badutf8`` (raw invalid UTF-8 bytes in the content), ``echo_key`` (the
request's API key inside the content), ``huge`` (50 MB of content), ``tool_args_object``
(tool-call ``arguments`` a JSON object, not the string the model wrote); ``200error_billed``
(an HTTP 200 error body that carries the usage and cost it billed), ``reset_billed``
(billed, then the connection is reset before the answer). ``key_usage_factor`` and
``generation_cost_factor`` make ``/key`` and ``/generation`` under-report; ``delay_range_s``
draws each delay uniformly. ``overbill``
multiplies every bill (and the usage.cost it reports); ``listed_prices`` replaces the
prices ``/models`` lists. ``rpm_limit`` / ``tpm_limit`` (over ``rate_window_s``) answer 429
past a provider-like rate limit (``srv.rate_refused`` counts them).

Run standalone (for a reviewer or the benchmark), from the repository root:
    PYTHONPATH=. python tests/support/fake_openrouter.py --port 8765 [--delay 0.05] \
        [--reasoning-field reasoning] [--kimi-tokenizer ../shared/tokenizers/kimi-k2.5]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qs, urlparse

MODEL_ID = "moonshotai/kimi-k2.5"


class TokenCounter(Protocol):
    def prompt(
        self, messages: list[dict], tools: list[dict] | None, thinking: bool = True
    ) -> int: ...

    def completion(
        self, reasoning: str, content: str, tool_calls: list[dict], thinking: bool = True
    ) -> int: ...


class ApproxCounter:
    """About 4 characters per token: enough for a server that only needs plausible usage."""

    def prompt(self, messages: list[dict], tools: list[dict] | None, thinking: bool = True) -> int:
        text = json.dumps(messages) + (json.dumps(tools) if tools else "")
        return len(text) // 4 + 4 * len(messages)

    def completion(
        self, reasoning: str, content: str, tool_calls: list[dict], thinking: bool = True
    ) -> int:
        text = reasoning + content + json.dumps(tool_calls)
        return len(text) // 4 + 2


class KimiCounter:
    """Token counts as Kimi's own tokenizer gives them (`model` from
    `kimi_pipe.core.models.load_model`). The prompt is counted on the rendered chat template
    (what a provider bills). The completion is assembled here, independently of the
    reconstruction code, from what the model emits in thinking mode:
    {reasoning}</think>{content}[<|tool_calls_section_begin|>(<|tool_call_begin|>{id}
    <|tool_call_argument_begin|>{arguments}<|tool_call_end|>)+<|tool_calls_section_end|>]
    <|im_end|>  -- every marker is one id. With thinking off (instant mode, OpenRouter's
    `reasoning.enabled: false` honoured) the model writes no reasoning and no </think>, and the
    prompt is counted as the `instant` model config renders it (`thinking=false`)."""

    def __init__(self, model: Any, instant: Any = None) -> None:
        self.model = model
        self.instant = instant
        self.enc = model.tokenizer.encode_ordinary

    def prompt(self, messages: list[dict], tools: list[dict] | None, thinking: bool = True) -> int:
        from kimi_pipe.core.prompt_render import prompt_ids

        model = self.model if thinking or self.instant is None else self.instant
        return len(prompt_ids(model, messages, tools))

    def completion(
        self, reasoning: str, content: str, tool_calls: list[dict], thinking: bool = True
    ) -> int:
        n = (len(self.enc(reasoning)) + 1 if thinking else 0) + len(self.enc(content))
        if tool_calls:
            n += 2  # section begin/end
            for call in tool_calls:
                n += 3 + len(self.enc(call["id"])) + len(self.enc(call["function"]["arguments"]))
        return n + 1  # <|im_end|>


@dataclass
class Behaviour:
    provider_name: str = "FakeProvider"
    reasoning_field: str = "reasoning"
    # OpenRouter's `reasoning.enabled: false` (instant mode): honoured, the model does not think;
    # False: a provider that ignores the switch and thinks anyway.
    honours_reasoning_switch: bool = True
    strip_whitespace: bool = False
    tool_call_ids: str = "native"
    delay_s: float = 0.0
    error_rate: float = 0.0
    error_mode: str = "502"
    script: dict[str, list[str]] = field(default_factory=dict)
    credit_usd: float | None = None
    retry_after: str = "1"
    hang_s: float = 30.0
    input_price: float = 0.6e-6  # USD per prompt token
    output_price: float = 2.5e-6  # USD per completion token
    counter: TokenCounter = field(default_factory=ApproxCounter)
    seed: int = 0
    list_models: bool = True  # False: GET /models answers 404 (a server without a listing)
    overbill: float = 1.0  # bill (and report) this multiple of the listed prices
    listed_prices: tuple[Any, Any] | None = None  # what /models lists instead of the prices
    key_limit: float | None = None  # the key's credit limit shown by GET /key
    key_endpoint: bool = False  # GET /key answers even without a limit
    stack: Any = (
        None  # an imitated serving stack that writes the answer (tests/support/fake_stacks.py)
    )
    delay_range_s: tuple[float, float] | None = None  # a uniform random delay (real latencies)
    key_usage_factor: float = 1.0  # GET /key shows this multiple of what was billed (a liar)
    generation_cost_factor: float = 1.0  # GET /generation states this multiple of the bill
    # Rate limits like a provider's: past `rpm_limit` requests, or `tpm_limit` tokens (the
    # prompt of a request as it arrives, prompt + completion once answered), arrived in the
    # last `rate_window_s`, a request is answered 429 (and not counted).
    rpm_limit: int | None = None
    tpm_limit: int | None = None
    rate_window_s: float = 60.0


@dataclass
class Bill:
    behaviour: str
    generation_id: str
    cost: float
    prompt_tokens: int
    completion_tokens: int
    marker: str  # last user message text, to tie a bill to a sample in tests


@dataclass
class SeenRequest:
    behaviour: str
    path: str
    body: dict
    headers: dict[str, str]  # lower-case names
    time: float  # arrival
    mode: str  # what it was answered with
    answered_at: float | None = None
    rate_entry: list | None = None  # [arrival (monotonic), tokens] under the rate limits


def _last_user_text(messages: list[dict]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            c = m.get("content")
            return c if isinstance(c, str) else json.dumps(c)
    return ""


def make_answer(messages: list[dict], tools: list[dict] | None, behaviour: Behaviour) -> dict:
    """A deterministic answer (reasoning, content, tool calls) derived from the prompt."""
    topic = _last_user_text(messages)[:60]
    reasoning = f"The user asks: {topic!r}.\n\nLet me think  step by step. "
    content = f"\n\nHere is my answer about {topic[:30]}.\n"
    calls: list[dict] = []
    if tools:
        fn = tools[0].get("function", tools[0])
        name = fn.get("name", "tool")
        props = list((fn.get("parameters") or {}).get("properties", {}) or {"q": None})
        args = json.dumps({props[0]: topic[:20]}, ensure_ascii=False)
        # The model always emits its native id; a provider may rename it afterwards.
        calls.append(
            {
                "id": f"functions.{name}:0",
                "type": "function",
                "index": 0,
                "function": {"name": name, "arguments": args},
            }
        )
        content = ""
    return {"reasoning": reasoning, "content": content, "tool_calls": calls}


def build_completion(body: dict, behaviour: Behaviour) -> tuple[dict, float, int, int]:
    """The OpenRouter JSON body for a successful answer, and what it bills."""
    if behaviour.stack is not None:
        return behaviour.stack.completion(body, behaviour)
    messages = body.get("messages") or []
    tools = body.get("tools")
    ans = make_answer(messages, tools, behaviour)
    reasoning, content, calls = ans["reasoning"], ans["content"], ans["tool_calls"]
    switch_off = (body.get("reasoning") or {}).get("enabled") is False
    thinking = not (switch_off and behaviour.honours_reasoning_switch)
    if not thinking:
        reasoning = ""
    # Billing counts what the model generated, before any parser touched it. (The thinking
    # keyword only when off: counters written before instant mode take two arguments.)
    off = {"thinking": False}
    prompt_tokens = behaviour.counter.prompt(messages, tools, **(off if switch_off else {}))
    completion_tokens = behaviour.counter.completion(
        reasoning, content, calls, **({} if thinking else off)
    )
    finish = "tool_calls" if calls else "stop"
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
    if max_tokens is not None and completion_tokens > int(max_tokens):
        completion_tokens, finish = int(max_tokens), "length"
    if behaviour.tool_call_ids == "call":
        calls = [{**c, "id": f"call_{uuid.uuid4().hex[:24]}"} for c in calls]
    if behaviour.strip_whitespace:
        reasoning, content = reasoning.strip(), content.strip()
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    field_ = behaviour.reasoning_field if thinking else "none"
    if field_ == "reasoning":
        message["reasoning"] = reasoning
        message["reasoning_details"] = [
            {"type": "reasoning.text", "text": reasoning, "format": "unknown", "index": 0}
        ]
    elif field_ == "reasoning_content":
        message["reasoning_content"] = reasoning
    elif field_ == "reasoning_details":
        half = len(reasoning) // 2  # two blocks: the client must join them before encoding
        message["reasoning_details"] = [
            {"type": "reasoning.text", "text": reasoning[:half], "format": "unknown", "index": 0},
            {"type": "reasoning.text", "text": reasoning[half:], "format": "unknown", "index": 0},
        ]
    elif field_ == "think_in_content":
        message["content"] = f"{reasoning}</think>{content}"
    elif field_ != "none":
        raise ValueError(f"unknown reasoning_field {field_!r}")
    if calls:
        message["tool_calls"] = calls
    cost = prompt_tokens * behaviour.input_price + completion_tokens * behaviour.output_price
    cost *= behaviour.overbill
    gen_id = f"gen-{uuid.uuid4().hex[:20]}"
    out = {
        "id": gen_id,
        "provider": behaviour.provider_name,
        "model": MODEL_ID,
        "object": "chat.completion",
        "created": int(time.time()),
        "choices": [
            {
                "logprobs": None,
                "finish_reason": finish,
                "native_finish_reason": finish,
                "index": 0,
                "message": message,
            }
        ],
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "cost": cost,
            "is_byok": False,
            "prompt_tokens_details": {"cached_tokens": 0},
            "cost_details": {"upstream_inference_cost": None},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
    }
    return out, cost, prompt_tokens, completion_tokens


_ERRORS = {
    "400": (400, "Bad request: invalid message"),
    "401": (401, "No auth credentials found"),
    "402": (402, "Insufficient credits. Add more using https://openrouter.ai/credits"),
    "403": (403, "Input flagged by moderation"),
    "408": (408, "Request timed out"),
    "429": (429, "Rate limit exceeded"),
    "500": (500, "Internal Server Error"),
    "502": (502, "Provider returned error"),
    "503": (503, "No instances available"),
}


class _Server(ThreadingHTTPServer):
    request_queue_size = 512  # the default backlog of 5 resets bursts of 64+ connects
    daemon_threads = True  # a hanging request must not block shutdown
    block_on_close = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client killed mid-request (kill loops) leaves a broken pipe: not a server error.
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeOpenRouter:
    def __init__(
        self, default: Behaviour | None = None, behaviours: dict[str, Behaviour] | None = None
    ) -> None:
        self.default = default or Behaviour()
        self.behaviours = dict(behaviours or {})
        self.bills: list[Bill] = []
        self.requests: list[SeenRequest] = []
        self.generations: dict[str, dict] = {}
        self._attempts: dict[tuple[str, str], int] = {}
        self._lock = threading.RLock()  # total_cost is called under it
        self._windows: dict[str, list[list]] = {}  # per behaviour: rate-limit entries
        self.rate_refused = 0  # requests answered 429 for the rate limits
        self._rng = random.Random(self.default.seed)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # --- lifecycle -------------------------------------------------------------------
    def start(self, port: int = 0) -> FakeOpenRouter:
        handler = _make_handler(self)
        httpd = _Server(("127.0.0.1", port), handler)
        self._httpd, self.port = httpd, httpd.server_address[1]
        self._thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FakeOpenRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def url(self, behaviour: str | None = None) -> str:
        prefix = f"/p/{behaviour}" if behaviour else ""
        return f"http://127.0.0.1:{self.port}{prefix}/api/v1"

    # --- ledger ----------------------------------------------------------------------
    def total_cost(self, behaviour: str | None = None) -> float:
        with self._lock:
            return sum(b.cost for b in self.bills if behaviour in (None, b.behaviour))

    def behaviour_for(self, name: str | None) -> Behaviour:
        if name is None:
            return self.default
        if name not in self.behaviours:
            raise KeyError(name)
        return self.behaviours[name]

    def admit(self, bname: str, beh: Behaviour, body: dict) -> list | None:
        """Under the behaviour's rate limits: the request's entry in the window ([arrival,
        tokens]), or None when it is past a limit (answered 429). No limits: an entry that
        is not kept."""
        if beh.rpm_limit is None and beh.tpm_limit is None:
            return [time.monotonic(), 0]
        prompt = beh.counter.prompt(body.get("messages") or [], body.get("tools"))
        with self._lock:
            now = time.monotonic()
            log = self._windows.setdefault(bname, [])
            log[:] = [e for e in log if e[0] > now - beh.rate_window_s]
            if beh.rpm_limit is not None and len(log) + 1 > beh.rpm_limit:
                self.rate_refused += 1
                return None
            if beh.tpm_limit is not None and sum(e[1] for e in log) + prompt > beh.tpm_limit:
                self.rate_refused += 1
                return None
            entry = [now, prompt]
            log.append(entry)
            return entry

    def choose_mode(self, bname: str, beh: Behaviour, body: dict) -> str:
        text = json.dumps(body.get("messages") or [], ensure_ascii=False)
        with self._lock:
            if beh.credit_usd is not None and self.total_cost(bname) >= beh.credit_usd:
                return "402"
            for trigger, modes in beh.script.items():
                if trigger in text:
                    n = self._attempts.get((bname, trigger), 0)
                    self._attempts[(bname, trigger)] = n + 1
                    return modes[n] if n < len(modes) else "ok"
            if beh.error_rate and self._rng.random() < beh.error_rate:
                return beh.error_mode
        return "ok"

    def bill(
        self,
        bname: str,
        beh: Behaviour,
        body: dict,
        gen_id: str,
        cost: float,
        p: int,
        c: int,
        answer: dict,
    ) -> bool:
        """Record a bill; False when the credit would be overdrawn (then the answer is 402)."""
        with self._lock:
            spent = sum(b.cost for b in self.bills if b.behaviour == bname)
            if beh.credit_usd is not None and spent + cost > beh.credit_usd:
                return False
            marker = _last_user_text(body.get("messages") or [])
            self.bills.append(Bill(bname, gen_id, cost, p, c, marker))
            self.generations[gen_id] = {
                "id": gen_id,
                "total_cost": cost,
                "provider_name": beh.provider_name,
                "native_tokens_prompt": p,
                "native_tokens_completion": c,
                "finish_reason": answer["choices"][0]["finish_reason"],
                "model": MODEL_ID,
            }
            return True


HOSTILE = frozenset(
    {
        "cost_nan",
        "cost_inf",
        "cost_neg",
        "cost_true",
        "cost_under",
        "no_usage",
        "finish_list",
        "tool_calls_str",
        "message_null",
        "other_model",
        "dated_model",
        "no_model",
        "finish_null",
        "finish_unknown",
        "content_filter",
        "surrogate",
        "badutf8",
        "echo_key",
        "huge",
        "tool_args_object",
    }
)
_BAD_UTF8_MARK = "@@BAD-UTF8@@"


def _hostile(mode: str, answer: dict, headers_of_request: Any) -> dict:
    """Turn a correct answer (already billed at its true cost) into a hostile one."""
    choice = answer["choices"][0]
    message = choice["message"]
    usage = answer["usage"]
    if mode == "cost_nan":
        usage["cost"] = float("nan")
    elif mode == "cost_inf":
        usage["cost"] = float("inf")
    elif mode == "cost_neg":
        usage["cost"] = -abs(usage["cost"]) - 1.0
    elif mode == "cost_true":
        usage["cost"] = True
    elif mode == "cost_under":
        usage["cost"] = usage["cost"] / 10
    elif mode == "no_usage":
        del answer["usage"]
    elif mode == "finish_list":
        choice["finish_reason"] = ["stop"]
    elif mode == "tool_calls_str":
        message["tool_calls"] = "not a list"
    elif mode == "message_null":
        choice["message"] = None
    elif mode == "other_model":
        answer["model"] = "openai/gpt-4o-mini"
    elif mode == "dated_model":
        answer["model"] = MODEL_ID + "-0127"
    elif mode == "no_model":
        del answer["model"]
    elif mode == "finish_null":
        choice["finish_reason"] = choice["native_finish_reason"] = None
    elif mode == "finish_unknown":
        choice["finish_reason"] = choice["native_finish_reason"] = "banana"
    elif mode == "content_filter":
        choice["finish_reason"] = choice["native_finish_reason"] = "content_filter"
    elif mode == "surrogate":
        message["content"] = (message.get("content") or "") + "\ud800 lone"
    elif mode == "badutf8":
        message["content"] = (message.get("content") or "") + _BAD_UTF8_MARK
    elif mode == "huge":  # 50 MB of content
        message["content"] = "x" * (50 << 20)
    elif mode == "tool_args_object":
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    elif mode == "echo_key":
        auth = headers_of_request.get("Authorization") or ""
        message["content"] = f"{message.get('content') or ''} your key is {auth[7:]}"
    return answer


def _make_handler(server: FakeOpenRouter) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like the real API
        disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms stall

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # quiet: tests read the ledger, not stderr

        def _split(self) -> tuple[str | None, str]:
            path = urlparse(self.path).path
            name = None
            if path.startswith("/p/"):
                _, _, name, path = path.split("/", 3)
                path = "/" + path
            return name, path.removeprefix("/api/v1")

        def _send(
            self,
            status: int,
            payload: Any,
            headers: dict[str, str] | None = None,
            seen: SeenRequest | None = None,
        ) -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            if seen is not None:
                seen.answered_at = time.time()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            name, path = self._split()
            try:
                beh = server.behaviour_for(name)
            except KeyError:
                return self._send(404, {"error": {"code": 404, "message": "unknown provider"}})
            if path == "/models" and beh.list_models:
                return self._send(
                    200,
                    {
                        "data": [
                            {
                                "id": MODEL_ID,
                                "name": "MoonshotAI: Kimi K2.5",
                                "context_length": 262144,
                                "pricing": {
                                    "prompt": f"{beh.input_price:.12f}",
                                    "completion": f"{beh.output_price:.12f}",
                                }
                                if beh.listed_prices is None
                                else {
                                    "prompt": beh.listed_prices[0],
                                    "completion": beh.listed_prices[1],
                                },
                            }
                        ]
                    },
                )
            if path == "/key" and (beh.key_limit is not None or beh.key_endpoint):
                used = server.total_cost(name or "") * beh.key_usage_factor
                limit = beh.key_limit
                remaining = None if limit is None else max(0.0, limit - used)
                return self._send(
                    200,
                    {
                        "data": {
                            "label": "fake",
                            "usage": used,
                            "limit": limit,
                            "limit_remaining": remaining,
                        }
                    },
                )
            if path == "/generation":
                gid = parse_qs(urlparse(self.path).query).get("id", [""])[0]
                gen = server.generations.get(gid)
                if gen is None:
                    return self._send(404, {"error": {"code": 404, "message": "not found"}})
                factor = server.behaviour_for(name).generation_cost_factor
                return self._send(200, {"data": {**gen, "total_cost": gen["total_cost"] * factor}})
            self._send(404, {"error": {"code": 404, "message": f"no route {path}"}})

        def do_POST(self) -> None:
            name, path = self._split()
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if path != "/chat/completions":
                return self._send(404, {"error": {"code": 404, "message": f"no route {path}"}})
            try:
                beh = server.behaviour_for(name)
                body = json.loads(raw)
            except (KeyError, ValueError) as e:
                return self._send(400, {"error": {"code": 400, "message": f"bad request: {e}"}})
            entry = server.admit(name or "", beh, body)
            mode = "429" if entry is None else server.choose_mode(name or "", beh, body)
            headers = {k.lower(): v for k, v in self.headers.items()}
            seen = SeenRequest(name or "", path, body, headers, time.time(), mode, None, entry)
            with server._lock:
                server.requests.append(seen)
            if beh.delay_s:
                time.sleep(beh.delay_s)
            if beh.delay_range_s is not None:
                with server._lock:
                    delay = server._rng.uniform(*beh.delay_range_s)
                time.sleep(delay)
            self._answer(name or "", beh, body, seen)

        def _answer(self, bname: str, beh: Behaviour, body: dict, seen: SeenRequest) -> None:
            mode = seen.mode
            if mode == "hang":
                time.sleep(beh.hang_s)
                self.close_connection = True
                return
            if mode in ("reset", "reset_billed"):
                if mode == "reset_billed":  # generated and billed; the answer never arrives
                    answer, cost, p, c = build_completion(body, beh)
                    server.bill(bname, beh, body, answer["id"], cost, p, c, answer)
                # An abortive close (RST), like a proxy dropping the connection.
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                self.close_connection = True
                self.connection.close()
                return
            if mode == "emptybody":
                return self._send(200, b"", seen=seen)
            if mode == "200error_billed":  # an error body that says what it billed
                answer, cost, p, c = build_completion(body, beh)
                server.bill(bname, beh, body, answer["id"], cost, p, c, answer)
                return self._send(
                    200,
                    {
                        "id": answer["id"],
                        "error": {"code": 502, "message": "Upstream error"},
                        "usage": answer["usage"],
                    },
                    seen=seen,
                )
            if mode == "200error":
                meta = {"provider_name": beh.provider_name}
                return self._send(
                    200,
                    {"error": {"code": 502, "message": "Upstream error", "metadata": meta}},
                    seen=seen,
                )
            if mode in _ERRORS:
                status, msg = _ERRORS[mode]
                headers = {"Retry-After": beh.retry_after} if status == 429 else None
                return self._send(
                    status, {"error": {"code": status, "message": msg}}, headers, seen=seen
                )
            answer, cost, p, c = build_completion(body, beh)
            if seen.rate_entry is not None:
                with server._lock:
                    seen.rate_entry[1] = p + c  # what the tokens limit counts once answered
            if mode == "empty":  # a cold start: nothing generated, the prompt still billed
                msg = answer["choices"][0]["message"]
                for k in ("reasoning", "reasoning_details", "reasoning_content", "tool_calls"):
                    msg.pop(k, None)
                msg["content"] = ""
                c, cost = 0, p * beh.input_price
                answer["usage"].update(completion_tokens=0, total_tokens=p, cost=cost)
            elif mode in HOSTILE:
                answer = _hostile(mode, answer, headers_of_request=self.headers)
            elif mode != "ok":
                raise ValueError(f"unknown mode {mode!r}")
            if not server.bill(bname, beh, body, answer["id"], cost, p, c, answer):
                seen.mode = "402"  # the credit ran out while this request was being answered
                status, msg = _ERRORS["402"]
                return self._send(status, {"error": {"code": status, "message": msg}}, seen=seen)
            payload = json.dumps(answer).encode()
            if mode == "badutf8":  # raw bytes that are not UTF-8 inside the content string
                payload = payload.replace(_BAD_UTF8_MARK.encode(), b"\xff\xfe")
            self._send(200, payload, {"X-Generation-Id": answer["id"]}, seen=seen)

    return Handler


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--reasoning-field", default="reasoning")
    ap.add_argument("--error-rate", type=float, default=0.0)
    ap.add_argument(
        "--kimi-tokenizer",
        default=None,
        help="Kimi tokenizer dir: exact usage counts (else about 4 chars/token)",
    )
    args = ap.parse_args(argv)
    beh = Behaviour(
        delay_s=args.delay, reasoning_field=args.reasoning_field, error_rate=args.error_rate
    )
    if args.kimi_tokenizer:
        from pathlib import Path

        from omegaconf import OmegaConf

        from kimi_pipe.core.models import load_model

        conf = Path(__file__).resolve().parents[2] / "conf" / "model" / "kimi_k25.yaml"
        cfg = OmegaConf.load(conf)
        cfg.tokenizer.path = args.kimi_tokenizer
        beh.counter = KimiCounter(load_model(cfg))
    srv = FakeOpenRouter(default=beh).start(args.port)
    print(f"fake OpenRouter at {srv.url()}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        srv.stop()


if __name__ == "__main__":
    main()


__all__: list[str] = [
    "ApproxCounter",
    "Behaviour",
    "Bill",
    "FakeOpenRouter",
    "KimiCounter",
    "SeenRequest",
    "TokenCounter",
    "build_completion",
    "make_answer",
]
