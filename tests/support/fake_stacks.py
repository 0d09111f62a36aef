"""Fake upstream providers that imitate real Kimi serving stacks, for the fake OpenRouter.

A `Stack` plays one provider end to end: a scripted "model" writes the true output token
ids (with non-canonical splits sampled into them, as a real model sometimes does), a
"server" turns those ids into the chat-completion fields the way a serving stack does,
and the answer can carry `logprobs.content[]` in OpenAI's shape, built from the true ids.
Billing (`usage.completion_tokens`) counts the true ids, like a real engine.

The server transformations imitate the behaviour documented in
../shared/docs/kimi-k25-format.md ("What a provider returns"): vLLM's spaces between
special tokens, trailing-whitespace stripping of the reasoning, SGLang's double-counted
tool index, argument re-serialisation, dotted-name truncation, a detokenizer that drops
`</think>`. They are written from that description, not taken from the real parsers (the
real-parser corpus is another branch's work).

    from tests.support.fake_stacks import Stack, STACKS
    Behaviour(stack=Stack(model, name="vllm_spaced", marker_spacing=True, logprobs="whole"))

The scripted model answers the probe prompts of conf/probes/*.yaml the way an obedient
model would ("begin your answer with the word X", "call TOOL with KEY set to the string
V", "end your reasoning with a blank line"); any other prompt gets a fixed answer with
numbers in it, so that non-canonical splits are possible.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kimi_pipe.core.models import Model

MODEL_ID = "moonshotai/kimi-k2.5"

_BEGIN_WITH = re.compile(r"[Bb]egin your answer with the word '([^']+)'")
_TOOL_ARG = re.compile(r"[Cc]all (\S+) with (\w+) set to the string \"([^\"]*)\"")
_ARGUMENT_EDGES = re.compile(r"newline before and after the arguments")
_REASONING_BLANK = re.compile(r"end your reasoning with a blank line")
_EXACT_LINE = re.compile(r"[Rr]eply with exactly the line '([^']+)' followed by a newline")


def _last_user_text(messages: list[dict]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            return m["content"]
    return ""


def _earlier_calls(messages: list[dict]) -> int:
    return sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")


@dataclass
class ModelAnswer:
    reasoning: str
    content: str
    calls: list[dict]  # [{"name", "arguments" (JSON text), "index" (the model's counter)}]


def scripted_answer(messages: list[dict], tools: list[dict] | None) -> ModelAnswer:
    """What an obedient Kimi would write for this prompt (deterministic)."""
    text = _last_user_text(messages)
    reasoning = "The user asks something. Let me check 12345 and 67890 first."
    if _REASONING_BLANK.search(text):
        reasoning += "\n\n"  # trailing whitespace in the reasoning: a server may strip it
    if m := _TOOL_ARG.search(text):
        name, key, value = m.groups()
        args = json.dumps({key: value}, ensure_ascii=False)
        if _ARGUMENT_EDGES.search(text):
            args = f"\n{args}\n"
        index = _earlier_calls(messages)  # the model's own counter runs over the conversation
        return ModelAnswer(reasoning, "", [{"name": name, "arguments": args, "index": index}])
    if tools and "call" in text.lower():
        fn = tools[0].get("function", tools[0])
        props = list((fn.get("parameters") or {}).get("properties") or {"q": None})
        args = json.dumps({props[0]: "12345"})
        return ModelAnswer(
            reasoning,
            "",
            [{"name": fn["name"], "arguments": args, "index": _earlier_calls(messages)}],
        )
    if m := _BEGIN_WITH.search(text):
        return ModelAnswer(reasoning, f"{m.group(1)} is the answer: 24680 in total.", [])
    if m := _EXACT_LINE.search(text):
        return ModelAnswer(reasoning, m.group(1) + "\n", [])
    return ModelAnswer(reasoning, "The answer is 13579 and 24680.", [])


@dataclass
class Stack:
    """One imitated provider: its model's splits, its server's text changes, its logprobs."""

    model: Model
    name: str = "exact"
    # --- the model: how many non-canonical splits it samples per answer -------------------
    splits: int = 1  # same token count as canonical (billing cannot see them)
    count_changing_splits: int = 0  # one token sampled as two (billing sees +1 each)
    # --- the server: text transformations ------------------------------------------------
    marker_spacing: bool = False  # vLLM spaces_between_special_tokens: " " before fields
    strip_reasoning_end: bool = False  # vLLM 0.33: trailing whitespace of reasoning dropped
    strip_whitespace: bool = False  # reasoning and content stripped at both ends
    drop_think_end: bool = False  # a detokenizer that drops </think>: all in reasoning
    tool_index: str = "model"  # "model" (kept), "double" (SGLang 0.5.14), "response" (0..)
    foreign_ids: bool = False  # call_<hex> ids instead of the model's
    reserialise_args: bool = False  # typed re-serialisation: "30" -> 30
    strip_argument_edges: bool = False  # the Kimi parsers of vLLM and SGLang: `\s*{args}\s*`
    truncate_dotted_names: bool = False  # older vLLM: web.search -> search
    delete_marker_text: bool = False  # literal <think>/<|im_end|> text removed from fields
    # --- logprobs -------------------------------------------------------------------------
    logprobs: str = "none"  # "none" | "whole" (reasoning, markers, content) | "content"
    logprobs_include_end: bool = False  # the end-of-turn token among the entries
    bad_logprobs: str | None = None  # "not_a_token" (two tokens glued into one entry)
    only_when_asked: bool = True  # logprobs only when the request says logprobs: true
    seen_bodies: list[dict] = field(default_factory=list)
    emitted: dict[str, list[int]] = field(default_factory=dict)  # last user text -> true ids

    # ---------------------------------------------------------------------------------
    def true_ids(self, ans: ModelAnswer) -> tuple[list[int], int]:
        """The ids the model emitted, and where its content starts (after </think>)."""
        m = self.model
        enc = m.tokenizer.encode_ordinary
        ids = enc(ans.reasoning) + [m.markers["</think>"]]
        ids += enc(ans.content)
        if ans.calls:
            ids.append(m.markers["<|tool_calls_section_begin|>"])
            for call in ans.calls:
                ids.append(m.markers["<|tool_call_begin|>"])
                ids += enc(f"functions.{call['name']}:{call['index']}")
                ids.append(m.markers["<|tool_call_argument_begin|>"])
                ids += enc(call["arguments"])
                ids.append(m.markers["<|tool_call_end|>"])
            ids.append(m.markers["<|tool_calls_section_end|>"])
        ids.append(m.markers["<|im_end|>"])
        ids = self._resplit(ids, self.splits, same_count=True)
        ids = self._resplit(ids, self.count_changing_splits, same_count=False)
        return ids, self._content_start(ids)

    def _content_start(self, ids: list[int]) -> int:
        return ids.index(self.model.markers["</think>"]) + 1

    def _resplit(self, ids: list[int], count: int, *, same_count: bool) -> list[int]:
        """Replace `count` spots with a split re-encoding would never give."""
        tok = self.model.tokenizer
        special = set(self.model.markers.values())
        out, done, i = list(ids), 0, 0
        while done < count and i < len(out) - 1:
            a, b = out[i], out[i + 1]
            if a in special or (same_count and b in special):
                i += 1
                continue
            if same_count:
                joined = tok.token_bytes(a) + tok.token_bytes(b)
                for cut in range(1, len(joined)):
                    x, y = tok.id_of_bytes(joined[:cut]), tok.id_of_bytes(joined[cut:])
                    if x is not None and y is not None and (x, y) != (a, b):
                        out[i : i + 2] = [x, y]
                        done += 1
                        i += 1
                        break
                i += 1
            else:
                whole = tok.token_bytes(a)
                for cut in range(1, len(whole)):
                    x, y = tok.id_of_bytes(whole[:cut]), tok.id_of_bytes(whole[cut:])
                    if x is not None and y is not None:
                        out[i : i + 1] = [x, y]
                        done += 1
                        i += 1
                        break
                i += 1
        return out

    # ---------------------------------------------------------------------------------
    def server_fields(self, ans: ModelAnswer, messages: list[dict]) -> tuple[str, str, list[dict]]:
        """reasoning, content and tool_calls as this server hands them back."""
        reasoning, content = ans.reasoning, ans.content
        if self.drop_think_end:
            reasoning, content = reasoning + content, ""
        if self.delete_marker_text:
            for literal in ("<think>", "</think>", "<|im_end|>"):
                reasoning, content = reasoning.replace(literal, ""), content.replace(literal, "")
        if self.marker_spacing:
            reasoning = " " + reasoning
            content = " " + content if content else content
        if self.strip_reasoning_end:
            reasoning = reasoning.rstrip()
        if self.strip_whitespace:
            reasoning, content = reasoning.strip(), content.strip()
        calls = []
        earlier = _earlier_calls(messages)
        for n, call in enumerate(ans.calls):
            name, args = call["name"], call["arguments"]
            index = call["index"]
            if self.tool_index == "double":
                index = 2 * earlier + n
            elif self.tool_index == "response":
                index = n
            if self.truncate_dotted_names:
                name = name.rsplit(".", 1)[-1]
            if self.strip_argument_edges:
                args = args.strip()
            if self.reserialise_args:
                args = json.dumps(
                    {k: _typed(v) for k, v in json.loads(args).items()}, ensure_ascii=False
                )
            call_id = (
                f"call_{uuid.uuid4().hex[:24]}"
                if self.foreign_ids
                else (f"functions.{name}:{index}")
            )
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "index": n,
                    "function": {"name": name, "arguments": args},
                }
            )
        return reasoning, content, calls

    def logprob_entries(self, ids: list[int], content_start: int) -> list[dict] | None:
        if self.logprobs == "none":
            return None
        end_id = self.model.markers["<|im_end|>"]
        chosen = ids if self.logprobs == "whole" else ids[content_start:]
        if not self.logprobs_include_end and chosen and chosen[-1] == end_id:
            chosen = chosen[:-1]
        tok = self.model.tokenizer
        entries = []
        for t in chosen:
            data = tok.token_bytes(t)
            entries.append(
                {
                    "token": data.decode("utf-8", "replace"),
                    "logprob": -0.125,
                    "bytes": list(data),
                    "top_logprobs": [],
                }
            )
        if self.bad_logprobs == "not_a_token" and len(entries) > 3:
            glued = entries[1]["bytes"] + entries[2]["bytes"]
            entries[1:3] = [
                {**entries[1], "token": bytes(glued).decode("utf-8", "replace"), "bytes": glued}
            ]
        return entries

    # ---------------------------------------------------------------------------------
    def completion(self, body: dict, behaviour: Any) -> tuple[dict, float, int, int]:
        """The OpenRouter JSON body for this request, and what it bills (fake_openrouter's
        `build_completion` contract)."""
        self.seen_bodies.append(body)
        messages = body.get("messages") or []
        tools = body.get("tools")
        ans = scripted_answer(messages, tools)
        ids, content_start = self.true_ids(ans)
        self.emitted[_last_user_text(messages)] = ids
        reasoning, content, calls = self.server_fields(ans, messages)
        prompt_tokens = behaviour.counter.prompt(messages, tools)
        completion_tokens = len(ids)
        finish = "tool_calls" if calls else "stop"
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "reasoning": reasoning,
            "reasoning_details": [{"type": "reasoning.text", "text": reasoning, "index": 0}],
        }
        if calls:
            message["tool_calls"] = calls
        asked = bool(body.get("logprobs")) or not self.only_when_asked
        entries = self.logprob_entries(ids, content_start) if asked else None
        cost = prompt_tokens * behaviour.input_price + completion_tokens * behaviour.output_price
        gen_id = f"gen-{uuid.uuid4().hex[:20]}"
        out = {
            "id": gen_id,
            "provider": behaviour.provider_name,
            "model": MODEL_ID,
            "object": "chat.completion",
            "created": int(time.time()),
            "choices": [
                {
                    "logprobs": {"content": entries, "refusal": None} if entries else None,
                    "finish_reason": finish,
                    "native_finish_reason": finish,
                    "index": 0,
                    "message": message,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "cost": cost,
            },
        }
        return out, cost, prompt_tokens, completion_tokens


def _typed(value: Any) -> Any:
    """What a typed re-serialisation makes of a string argument ("30" -> 30)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def stacks(model: Model) -> dict[str, Stack]:
    """Five imitated stacks plus an exact one; provider name -> stack."""
    return {
        "exact_whole": Stack(model, "exact_whole", logprobs="whole"),
        "vllm_spaced": Stack(
            model,
            "vllm_spaced",
            marker_spacing=True,
            strip_argument_edges=True,
            logprobs="content",
        ),
        "vllm_033": Stack(
            model,
            "vllm_033",
            strip_reasoning_end=True,
            reserialise_args=True,
            truncate_dotted_names=True,
            delete_marker_text=True,
            strip_argument_edges=True,
        ),
        "sglang_0514": Stack(
            model, "sglang_0514", tool_index="double", strip_argument_edges=True, logprobs="whole"
        ),
        "stripping": Stack(model, "stripping", strip_whitespace=True),
        "dropped_think": Stack(model, "dropped_think", drop_think_end=True, logprobs="whole"),
    }


__all__ = ["ModelAnswer", "Stack", "scripted_answer", "stacks"]


def routed_fake(default: Any, behaviours: dict[str, Any]) -> Any:
    """A started FakeOpenRouter whose single base URL routes by `provider.order[0]`."""
    import io
    import threading
    from http.server import ThreadingHTTPServer

    from tests.support.fake_openrouter import FakeOpenRouter, _make_handler

    srv = FakeOpenRouter(default, behaviours)
    base = _make_handler(srv)

    class Routed(base):  # type: ignore[valid-type,misc]
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                order = (json.loads(raw).get("provider") or {}).get("order") or []
            except (ValueError, AttributeError):
                order = []
            if order and not self.path.startswith("/p/"):
                self.path = f"/p/{order[0]}{self.path}"
            sock_file, self.rfile = self.rfile, io.BytesIO(raw)
            try:
                super().do_POST()
            finally:
                self.rfile = sock_file

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Routed)
    httpd.daemon_threads = True
    srv._httpd, srv.port = httpd, httpd.server_address[1]
    srv._thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    srv._thread.start()
    return srv
