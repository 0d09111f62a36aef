"""Build tests/fixtures/server_shapes/*.jsonl by running the serving stacks' own code.

Run by hand, never in CI (docs/serving_profiles.md, "Server-shape corpus"):

    # 1. one throwaway venv per server, its wheel without dependencies plus the few light
    #    packages its parser modules import (torch is read from the project venv via a .pth)
    python3.11 -m venv /tmp/srv9a/venv-vllm0151
    /tmp/srv9a/venv-vllm0151/bin/pip install --no-deps vllm==0.15.1
    /tmp/srv9a/venv-vllm0151/bin/pip install regex pydantic "transformers<5" tiktoken openai \
        fastapi cachetools psutil numpy msgspec pyzmq partial-json-parser pyyaml cloudpickle
    #    (same for sglang==0.5.14 and sglang==0.5.23). vLLM 0.33.0 and 0.34.0 (venv-vllm0330,
    #    venv-vllm0340) import more at load time; what a 2026-12-07 run needed besides the
    #    list above, with transformers 5 instead of 4 (xgrammar brings its own torch):
    #      "transformers>=5.16.1,<5.21" "tokenizers>=0.23.2" "huggingface_hub>=1.31" xgrammar \
    #      cbor2 aiohttp openai-harmony pillow pybase64 prometheus_client uvloop py-cpuinfo
    # 2. build the ground truth, run every server, write the fixtures
    python tools/make_server_fixtures.py --venvs /tmp/srv9a
    #    or some of them: --only vllm-0.34.0 (repeatable)
    # 3. a new version of a server: does it answer as the last one did (then its profile
    #    covers it)? --compare vllm-0.33.0 vllm-0.34.0

Ground truth: each answer is written as the model's output pieces (text and marker names)
and encoded with the real Kimi K2.5 tokenizer; those ids are what the model emitted. Each
server worker (this same file, run with `--worker` inside the server's venv) decodes the
ids with the server's own incremental detokenizer and runs the server's own reasoning and
tool parsers, then assembles the message the way that server's chat endpoint does (the
steps are named in `_vllm_message` / `_sglang_message`). Nothing here writes server output
by hand: OpenRouter-shaped variants are derived from a real server response by the
documented reshaping (reasoning -> `reasoning` + `reasoning_details`, ids kept or replaced).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kimi_slow_vocab import byte_chars, load_kimi_vocab  # scripts/, also in a server venv

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_DIR = ROOT / "tests" / "fixtures" / "server_shapes"

# The servers run, each with the marker spacings it is run with (SGLang's decode ignores
# spaces_between_special_tokens: off only). Every one is run whole and streamed; a variant's
# `settings` are passed to the worker as they are.
SERVERS: list[tuple[str, str, str, tuple[bool, ...]]] = [
    ("vllm", "0.15.1", "venv-vllm0151", (True, False)),
    ("vllm", "0.33.0", "venv-vllm0330", (True, False)),
    ("vllm", "0.34.0", "venv-vllm0340", (True, False)),
    ("sglang", "0.5.14", "venv-sgl0514", (False,)),
    ("sglang", "0.5.23", "venv-sgl0523", (False,)),
]
# Streaming is accumulated as a client does (deltas concatenated, tool calls by index).
VARIANTS: list[dict[str, Any]] = [
    {
        "server": server,
        "version": version,
        "venv": venv,
        "settings": {"spaces_between_special_tokens": spaces}
        | ({"stream": True} if stream else {}),
    }
    for stream in (False, True)
    for server, version, venv, spacings in SERVERS
    for spaces in spacings
]

# ---------------------------------------------------------------- ground truth (project venv)

TOOLS = [
    {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}
    for name, desc, params in [
        (
            "get_weather",
            "Weather for a city",
            {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        ),
        (
            "web.search",
            "Search the web",
            {
                "type": "object",
                "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
                "required": ["query"],
            },
        ),
        (
            "fetch-url",
            "Fetch a page",
            {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]},
        ),
        (
            "run_code",
            "Run Python",
            {
                "type": "object",
                "properties": {"code": {"type": "string"}, "timeout": {"type": "string"}},
                "required": ["code"],
            },
        ),
        (
            "set_timer",
            "Start a timer",
            {
                "type": "object",
                "properties": {"seconds": {"type": "integer"}, "labels": {"type": "object"}},
                "required": ["seconds"],
            },
        ),
    ]
]

REASONINGS = [
    "The user wants the weather. I should call the tool.",
    "Let me think.\n\n```python\ndef f(x):\n    return x * 2\n```\nThat doubles it.",
    "## Plan\n- step one\n- step two\n\n**Bold** and `code`.",
    "用户想知道天气。我应该调用工具。",
    "Emoji check 🎉🚀 done.",
    "Trailing whitespace matters.   \n\n",
    "  Leading spaces and a tab\tinside.",
    "",
    "I might write the literal text <think> or <|im_end|> here.",
    "Short.",
]
CONTENTS = [
    "The weather in Paris is sunny.",
    "",
    "Here is the code:\n\n```js\nconsole.log(1)\n```",
    "你好！今天天气很好。",
    "  \n",
    "Done 👍",
    " Leading space answer.",
    "Ends with newline\n",
]
CALLS = [
    [],
    [("get_weather", '{"city": "Paris"}')],
    [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "東京"}')],
    [("web.search", '{"query": "kimi k2.5 tokenizer", "top_k": 5}')],
    [("fetch-url", '{"url": "https://example.com/a?b=1"}')],
    [("set_timer", '{"seconds": "30", "labels": {"a": ["x", {"b": null}], "c": 1.5}}')],
    [("run_code", '{"code": "print(\\"héllo\\")\\n", "timeout": "10"}')],
    [("get_weather", ' {"city": "Rome"} ')],
    [
        ("web.search", '{"query": "a"}'),
        ("fetch-url", '{"url": "b"}'),
        ("set_timer", '{"seconds": "5"}'),
    ],
]


def _history(earlier_calls: int) -> list[dict[str, Any]]:
    """A multi-turn prompt whose assistant turns already made `earlier_calls` tool calls."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris, then Rome?"}]
    for index in range(earlier_calls):
        call_id = f"functions.get_weather:{index}"
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "I call the tool.",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": "sunny"})
    return messages


def answer_specs() -> Iterator[dict[str, Any]]:
    """At least 60 realistic answers: pieces of the model's own output stream."""
    n = 0
    for r_index, reasoning in enumerate(REASONINGS):
        for c_offset in range(6):
            content = CONTENTS[(r_index + c_offset) % len(CONTENTS)]
            calls = (
                [] if c_offset % 3 == 0 else CALLS[1 + (r_index * 6 + c_offset) % (len(CALLS) - 1)]
            )
            earlier = 2 if (r_index + c_offset) % 4 == 0 else 0
            n += 1
            yield {
                "id": f"a{n:03d}",
                "reasoning": reasoning,
                "content": content,
                "calls": calls,
                "earlier_calls": earlier,
                "cut": None,
            }
    # Truncated answers: cut inside the reasoning, inside content, inside a tool call.
    for cut, calls in [(5, []), (30, []), (45, CALLS[1]), (60, CALLS[5])]:
        n += 1
        yield {
            "id": f"a{n:03d}",
            "reasoning": REASONINGS[1],
            "content": CONTENTS[2],
            "calls": calls,
            "earlier_calls": 0,
            "cut": cut,
        }
    # Reasoning only (no </think> emitted, then end of turn): a model can stop this way.
    n += 1
    yield {
        "id": f"a{n:03d}",
        "reasoning": REASONINGS[0],
        "content": "",
        "calls": [],
        "earlier_calls": 0,
        "cut": None,
        "no_think_end": True,
    }


# Whitespace where a stack acts: field edges, beside markers, between calls (issue 30). Each
# class a stack was seen to turn into a wrong `ok` record has several members here.
EDGE_REASONINGS = [" ", "  ", "\n", "\n\n", " \n", "\t", " Hi.", "Hi. ", "Hi.\n", "\nHi.", "Ok"]
EDGE_CONTENTS = ["", " ", "\n", "\n\n", "  ", " Sure.", "Sure. ", "\nSure.\n", "Sure.\n\n", "Sure"]
EDGE_CALLS: list[list[tuple[str, str]]] = [
    [],
    [("get_weather", ' {"city": "Rome"}')],
    [("get_weather", '{"city": "Rome"}\n')],
    [("get_weather", '\n{"city": "Rome"}\n')],
    [("get_weather", '  {"city": "Rome"}')],
    [("get_weather", '{"city": "Rome"} ')],
    [("get_weather", '{"city": "Rome"}'), ("get_weather", '{"city": "Oslo"}')],
    [("get_weather", '{"city": " Rome "}')],
]
# Separators the model writes inside the section: between calls, after the section begin.
EDGE_SEPARATORS = [("", ""), ("\n", ""), (" ", ""), ("", "\n")]


def edge_specs() -> Iterator[dict[str, Any]]:
    """Answers at the whitespace edges: each reasoning, content, call set and separator appears
    beside several others; a second turn restarts the call index at 0 in some."""
    n = 0
    for r_index, reasoning in enumerate(EDGE_REASONINGS):
        for c_index, content in enumerate(EDGE_CONTENTS):
            calls = EDGE_CALLS[(r_index + 3 * c_index) % len(EDGE_CALLS)]
            between, after_begin = EDGE_SEPARATORS[(r_index + c_index) % len(EDGE_SEPARATORS)]
            earlier = 2 if (r_index * 7 + c_index) % 5 == 0 else 0
            n += 1
            yield {
                "id": f"e{n:03d}",
                "reasoning": reasoning,
                "content": content,
                "calls": calls,
                "earlier_calls": earlier,
                # The model's own index restarts at 0 in a second turn (it is not a counter
                # a stack can trust): in every other answer with earlier calls.
                "index_restart": bool(earlier) and n % 2 == 0,
                "between_calls": between,
                "after_section_begin": after_begin,
                "cut": None,
            }


def build_ground_truth() -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT))
    from kimi_pipe.config import compose
    from kimi_pipe.core.formats import Marker, Piece
    from kimi_pipe.core.models import load_model
    from kimi_pipe.core.prompt_render import prompt_ids

    model = load_model(compose(["model=kimi_k25"]).model)
    answers = []
    for spec in [*answer_specs(), *edge_specs()]:
        pieces: list[Piece] = [spec["reasoning"]]
        if not spec.get("no_think_end"):
            pieces.append(Marker("</think>"))
        pieces.append(spec["content"])
        earlier = spec["earlier_calls"]
        if spec["calls"]:
            pieces.append(Marker("<|tool_calls_section_begin|>"))
            pieces.append(spec.get("after_section_begin", ""))
            first = 0 if spec.get("index_restart") else earlier
            for index, (name, arguments) in enumerate(spec["calls"]):
                if index:
                    pieces.append(spec.get("between_calls", ""))
                pieces += [Marker("<|tool_call_begin|>"), f"functions.{name}:{first + index}"]
                pieces += [Marker("<|tool_call_argument_begin|>"), arguments]
                pieces.append(Marker("<|tool_call_end|>"))
            pieces.append(Marker("<|tool_calls_section_end|>"))
        pieces.append(Marker("<|im_end|>"))
        ids = model.encode(pieces)
        if spec["cut"] is not None:
            ids = ids[: min(spec["cut"], len(ids) - 4)]  # always inside the answer
        messages = _history(earlier) if earlier else [{"role": "user", "content": "Help me."}]
        tools = TOOLS if (spec["calls"] or earlier) else None
        prompt = prompt_ids(model, messages, tools)
        answers.append(
            {**spec, "messages": messages, "tools": tools, "prompt_ids": prompt, "output_ids": ids}
        )
    return answers


# ---------------------------------------------------------------- worker (server venv)


class KimiSlowTokenizerView:
    """The surface of Moonshot's slow `TikTokenTokenizer` that the servers' detokenizers and
    parsers call (tokens as byte-level strings, added tokens by name, special-token list from
    tokenizer_config.json). Moonshot's own Python file cannot be fetched offline; this view
    reads the same two data files, and the decoding logic that runs is the server's."""

    is_fast = False

    def __init__(self, tokenizer_dir: Path) -> None:
        self.ranks, self.added, self.all_special_tokens, _ = load_kimi_vocab(tokenizer_dir)
        self.all_special_ids = [i for i, n in self.added.items() if n in self.all_special_tokens]
        self.byte_chars = byte_chars()
        self.char_bytes = {c: b for b, c in self.byte_chars.items()}
        self.vocab = {self._token(i): i for i in self.ranks} | {n: i for i, n in self.added.items()}
        self.added_vocab = {n: i for i, n in self.added.items()}
        self.eos_token_id = 163586

    def _token(self, token_id: int) -> str:
        if token_id in self.added:
            return self.added[token_id]
        return "".join(self.byte_chars[b] for b in self.ranks[token_id])

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_vocab

    def __len__(self) -> int:
        return len(self.vocab)

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._token(i) for i in ids if i not in skip]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = bytearray()
        for token in tokens:
            if token in self.added_vocab:
                data += token.encode()
            else:
                data += bytes(self.char_bytes[c] for c in token)
        return data.decode("utf-8", errors="replace")

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_: Any) -> str:
        return self.convert_tokens_to_string(self.convert_ids_to_tokens(ids, skip_special_tokens))


def _vllm_decode(
    tok: KimiSlowTokenizerView, prompt: list[int], output: list[int], spaces: bool
) -> str:
    """vLLM's SlowIncrementalDetokenizer loop: detokenize_incrementally per output token."""
    from vllm.tokenizers.detokenizer_utils import (
        convert_prompt_ids_to_tokens,
        detokenize_incrementally,
    )

    tokens, prefix_offset, read_offset = convert_prompt_ids_to_tokens(
        tokenizer=tok, prompt_ids=prompt, skip_special_tokens=True
    )
    all_ids = list(prompt)
    text = ""
    for token_id in output:
        if token_id == tok.eos_token_id:
            break  # the stop token ends generation and is not decoded into the text
        all_ids.append(token_id)
        new_tokens, delta, prefix_offset, read_offset = detokenize_incrementally(
            tokenizer=tok,
            all_input_ids=all_ids,
            prev_tokens=tokens,
            prefix_offset=prefix_offset,
            read_offset=read_offset,
            skip_special_tokens=True,
            spaces_between_special_tokens=spaces,
        )
        tokens.extend(new_tokens)
        text += delta
    return text


def _request(answer: dict[str, Any]) -> Any:
    if not answer["tools"]:
        return {"messages": answer["messages"]}
    return {"messages": answer["messages"], "tools": answer["tools"], "tool_choice": "auto"}


def _vllm_message(version: str, tok: Any, answer: dict[str, Any], text: str) -> dict[str, Any]:
    """Non-streaming chat completion message as vLLM's serving_chat builds it."""
    history_calls = sum(len(m.get("tool_calls") or []) for m in answer["messages"])
    if version.startswith("0.15"):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.reasoning.kimi_k2_reasoning_parser import KimiK2ReasoningParser
        from vllm.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser

        request = ChatCompletionRequest(model="kimi", **_request(answer))
        reasoning, content = KimiK2ReasoningParser(tok).extract_reasoning(text, request=request)
        calls: list[dict[str, Any]] = []
        if answer["tools"] and content is not None:
            info = KimiK2ToolParser(tok).extract_tool_calls(content, request=request)
            if info.tools_called:
                # serving_chat (tool_choice auto) wraps each FunctionCall in ToolCall(), whose
                # default id is make_tool_call_id(): "chatcmpl-tool-<uuid>".
                from vllm.entrypoints.openai.engine.protocol import ToolCall

                for call in info.tool_calls:
                    wrapped = ToolCall(function=call.function, type="function")
                    calls.append(wrapped.model_dump())
                content = info.content
        return {"reasoning": reasoning, "content": content, "tool_calls": calls}
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.kimi_k2 import KimiK2Parser

    request = ChatCompletionRequest(model="kimi", **_request(answer))
    # serving_chat._make_parser: the request's tools go to the parser (schema coercion).
    parser = KimiK2Parser(tok, request.tools)
    try:
        reasoning, content, fcalls = parser.parse(text, request, enable_auto_tools=True)
    except Exception as exc:  # record the real failure rather than guess its output
        return {"error": f"{type(exc).__name__}: {exc}"}
    calls = []
    for index, call in enumerate(fcalls or []):
        call_id = call.id or f"functions.{call.name}:{history_calls + index}"
        calls.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
        )
    return {"reasoning": reasoning, "content": content, "tool_calls": calls}


def _sglang_message(tok: Any, answer: dict[str, Any], text: str) -> dict[str, Any]:
    """Non-streaming message as SGLang's serving_chat builds it: reasoning parser, then the
    function-call parser, then `_process_tool_call_id` (history count + tool_index)."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    # The K2.5 template ends the prompt with <think>: SGLang's template manager then forces
    # reasoning (the output starts inside the reasoning).
    reasoning_parser = ReasoningParser(
        model_type="kimi_k2", stream_reasoning=False, force_reasoning=True
    )
    reasoning, content = reasoning_parser.parse_non_stream(text)
    calls: list[dict[str, Any]] = []
    if answer["tools"] and content:
        tools = [Tool(**t) for t in answer["tools"]]
        parser = FunctionCallParser(tools, "kimi_k2")
        if parser.has_tool_call(content):
            content, items = parser.parse_non_stream(content)
            history = sum(len(m.get("tool_calls") or []) for m in answer["messages"])
            for item in items:
                calls.append(
                    {
                        "id": f"functions.{item.name}:{history + item.tool_index}",
                        "type": "function",
                        "function": {"name": item.name, "arguments": item.parameters},
                    }
                )
    return {"reasoning_content": reasoning, "content": content or None, "tool_calls": calls}


def _vllm_deltas(
    tok: KimiSlowTokenizerView, prompt: list[int], output: list[int], spaces: bool
) -> list[tuple[str, list[int]]]:
    """(delta_text, [token id]) per generated token, from vLLM's incremental detokenizer."""
    from vllm.tokenizers.detokenizer_utils import (
        convert_prompt_ids_to_tokens,
        detokenize_incrementally,
    )

    tokens, prefix_offset, read_offset = convert_prompt_ids_to_tokens(
        tokenizer=tok, prompt_ids=prompt, skip_special_tokens=True
    )
    all_ids, deltas = list(prompt), []
    for token_id in output:
        if token_id == tok.eos_token_id:
            break
        all_ids.append(token_id)
        new_tokens, delta, prefix_offset, read_offset = detokenize_incrementally(
            tokenizer=tok,
            all_input_ids=all_ids,
            prev_tokens=tokens,
            prefix_offset=prefix_offset,
            read_offset=read_offset,
            skip_special_tokens=True,
            spaces_between_special_tokens=spaces,
        )
        tokens.extend(new_tokens)
        deltas.append((delta, [token_id]))
    return deltas


def _accumulate(message: dict[str, Any], delta: dict[str, Any]) -> None:
    """What a streaming client does: concatenate text, merge tool calls by index."""
    for key in ("reasoning", "reasoning_content", "content"):
        if delta.get(key):
            message[key] = (message.get(key) or "") + delta[key]
    for call in delta.get("tool_calls") or []:
        slots = message.setdefault("tool_calls", [])
        while len(slots) <= call["index"]:
            empty = {"name": "", "arguments": ""}
            slots.append({"id": None, "type": "function", "function": empty})
        slot = slots[call["index"]]
        if call.get("id"):
            slot["id"] = call["id"]
        function = call.get("function") or {}
        if function.get("name"):
            slot["function"]["name"] = function["name"]
        if function.get("arguments"):
            slot["function"]["arguments"] += function["arguments"]


def _vllm_stream_message(tok: Any, answer: dict[str, Any], spaces: bool) -> dict[str, Any]:
    """vLLM 0.33 streaming: KimiK2Parser.parse_delta per detokenized token, accumulated."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.kimi_k2 import KimiK2Parser

    request = ChatCompletionRequest(model="kimi", stream=True, **_request(answer))
    parser = KimiK2Parser(tok, request.tools)
    deltas = _vllm_deltas(tok, answer["prompt_ids"], answer["output_ids"], spaces)
    message: dict[str, Any] = {}
    for n, (text, ids) in enumerate(deltas):
        finished = n == len(deltas) - 1
        delta = parser.parse_delta(
            text, ids, request, answer["prompt_ids"] if n == 0 else None, finished=finished
        )
        if delta is not None:
            _accumulate(message, delta.model_dump(exclude_none=True))
    return {
        "reasoning": message.get("reasoning"),
        "content": message.get("content"),
        "tool_calls": message.get("tool_calls") or [],
    }


def _vllm015_stream_message(tok: Any, answer: dict[str, Any], spaces: bool) -> dict[str, Any]:
    """vLLM 0.15.1 streaming, as serving_chat's generator runs it for Kimi K2: the reasoning
    parser's extract_reasoning_streaming until the think-end, then (tools, tool_choice auto)
    the tool parser's extract_tool_calls_streaming with the text carried over; on the last
    chunk the check for unstreamed argument text. Deltas are accumulated as a client does."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning.kimi_k2_reasoning_parser import KimiK2ReasoningParser
    from vllm.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser

    request = ChatCompletionRequest(model="kimi", stream=True, **_request(answer))
    reasoning_parser = KimiK2ReasoningParser(tok)
    tool_parser = KimiK2ToolParser(tok) if answer["tools"] else None
    steps = _vllm_deltas(tok, answer["prompt_ids"], answer["output_ids"], spaces)
    if tok.eos_token_id in answer["output_ids"]:
        steps.append(("", [tok.eos_token_id]))  # the stop token: no text, finish_reason set
    message: dict[str, Any] = {}
    previous_text, previous_ids = "", []
    reasoning_ended = added_content = False
    for n, (delta_text, output_ids) in enumerate(steps):
        finished = n == len(steps) - 1
        current_text = previous_text + delta_text
        current_ids = previous_ids + output_ids
        delta = None
        if tool_parser is None:
            delta = reasoning_parser.extract_reasoning_streaming(
                previous_text, current_text, delta_text, previous_ids, current_ids, output_ids
            )
        else:
            if not reasoning_ended:
                delta = reasoning_parser.extract_reasoning_streaming(
                    previous_text, current_text, delta_text, previous_ids, current_ids, output_ids
                )
                if reasoning_parser.is_reasoning_end(output_ids):
                    reasoning_ended = True
                    current_ids = reasoning_parser.extract_content_ids(output_ids)
                    if delta and delta.content:
                        current_text = delta.content
                        delta.content = None
                    else:
                        current_text = ""
            if reasoning_ended:
                delta_ids = output_ids
                prev_text, prev_ids = previous_text, previous_ids
                if not added_content:
                    added_content = True
                    prev_text, prev_ids = "", []
                    delta_text, delta_ids = current_text, current_ids
                delta = tool_parser.extract_tool_calls_streaming(
                    previous_text=prev_text,
                    current_text=current_text,
                    delta_text=delta_text,
                    previous_token_ids=prev_ids,
                    current_token_ids=current_ids,
                    delta_token_ids=delta_ids,
                    request=request,
                )
        previous_text, previous_ids = current_text, current_ids
        if (
            finished
            and tool_parser is not None
            and delta is not None
            and delta.tool_calls
            and delta.tool_calls[0].function
            and delta.tool_calls[0].function.arguments is not None
        ):
            # serving_chat: arguments the partial-JSON parse knows but did not stream.
            index = max(len(tool_parser.prev_tool_call_arr) - 1, 0)
            function = delta.tool_calls[0].function
            latest = len(function.arguments) if isinstance(function.arguments, str) else 0
            expected = json.dumps(
                tool_parser.prev_tool_call_arr[index].get("arguments", {}), ensure_ascii=False
            )
            actual = tool_parser.streamed_args_for_tool[index]
            if latest > 0:
                actual = actual[:-latest]
            remaining = expected.replace(actual, "", 1)
            original = next((c for c in delta.tool_calls if c.index == index), None)
            piece: dict[str, Any] = {"index": index, "function": {"arguments": remaining}}
            if original is not None and original.id:
                piece["id"] = original.id
            if original is not None and original.function and original.function.name:
                piece["function"]["name"] = original.function.name
            _accumulate(message, {"tool_calls": [piece]})
            continue
        if delta is not None:
            _accumulate(message, delta.model_dump(exclude_none=True))
    return {
        "reasoning": message.get("reasoning") or message.get("reasoning_content"),
        "content": message.get("content"),
        "tool_calls": message.get("tool_calls") or [],
    }


def _sglang_stream_message(tok: Any, answer: dict[str, Any]) -> dict[str, Any]:
    """SGLang streaming: reasoning parser then function-call parser per text delta; ids as
    serving_chat's streaming path makes them (history count + tool_index)."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    reasoning_parser = ReasoningParser(
        model_type="kimi_k2", stream_reasoning=True, force_reasoning=True
    )
    tool_parser = None
    if answer["tools"]:
        tool_parser = FunctionCallParser([Tool(**t) for t in answer["tools"]], "kimi_k2")
    history = sum(len(m.get("tool_calls") or []) for m in answer["messages"])
    ids = answer["output_ids"]
    if tok.eos_token_id in ids:
        ids = ids[: ids.index(tok.eos_token_id)]
    message: dict[str, Any] = {}
    sent = ""
    for end in range(1, len(ids) + 1):
        text = tok.decode(ids[:end], skip_special_tokens=True)
        if text.endswith("\ufffd") and end < len(ids):
            continue  # the detokenizer holds back an incomplete character
        delta, sent = text[len(sent) :], text
        reasoning, normal = reasoning_parser.parse_stream_chunk(delta)
        if reasoning:
            _accumulate(message, {"reasoning_content": reasoning})
        if normal and tool_parser is not None:
            normal, calls = tool_parser.parse_stream_chunk(normal)
            for item in calls:
                piece: dict[str, Any] = {"index": item.tool_index, "function": {}}
                if item.name:
                    piece["id"] = f"functions.{item.name}:{history + item.tool_index}"
                    piece["function"]["name"] = item.name
                if item.parameters:
                    piece["function"]["arguments"] = item.parameters
                _accumulate(message, {"tool_calls": [piece]})
        if normal:
            _accumulate(message, {"content": normal})
    return {
        "reasoning_content": message.get("reasoning_content"),
        "content": message.get("content"),
        "tool_calls": message.get("tool_calls") or [],
    }


def run_worker(server: str, version: str, settings: dict[str, Any], tokenizer_dir: Path) -> None:
    answers = json.load(sys.stdin)
    tok = KimiSlowTokenizerView(tokenizer_dir)
    for answer in answers:
        spaces = bool(settings.get("spaces_between_special_tokens"))
        if settings.get("stream"):
            try:
                if server == "vllm" and version.startswith("0.15"):
                    message = _vllm015_stream_message(tok, answer, spaces)
                elif server == "vllm":
                    message = _vllm_stream_message(tok, answer, spaces)
                else:
                    message = _sglang_stream_message(tok, answer)
            except Exception as exc:  # record the real failure rather than guess its output
                message = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps({"id": answer["id"], "decoded_text": None, "message": message}))
            continue
        if server == "vllm":
            text = _vllm_decode(tok, answer["prompt_ids"], answer["output_ids"], spaces)
            message = _vllm_message(version, tok, answer, text)
        else:
            # SGLang decodes with the tokenizer's own decode(skip_special_tokens=True); under
            # the transformers 5.x it pins, the slow tokenizer's _decode ignores
            # spaces_between_special_tokens, so the pieces are joined as they are.
            ids = answer["output_ids"]
            if tok.eos_token_id in ids:
                ids = ids[: ids.index(tok.eos_token_id)]
            text = tok.decode(ids, skip_special_tokens=True)
            message = _sglang_message(tok, answer, text)
        print(json.dumps({"id": answer["id"], "decoded_text": text, "message": message}))


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    out = {"role": "assistant"}
    out.update({k: v for k, v in message.items() if k != "tool_calls"})
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


def _response(answer: dict[str, Any], message: dict[str, Any], server: str) -> dict[str, Any]:
    finished = answer["cut"] is None
    finish = "length" if not finished else ("tool_calls" if message.get("tool_calls") else "stop")
    return {
        "id": f"chatcmpl-{answer['id']}",
        "object": "chat.completion",
        "model": "moonshotai/Kimi-K2.5",
        "choices": [{"index": 0, "message": _plain_message(message), "finish_reason": finish}],
        "usage": {
            "prompt_tokens": len(answer["prompt_ids"]),
            "completion_tokens": len(answer["output_ids"]),
            "total_tokens": len(answer["prompt_ids"]) + len(answer["output_ids"]),
        },
    }


def _openrouter_shape(response: dict[str, Any], replace_ids: bool) -> dict[str, Any]:
    """OpenRouter's normalisation: `reasoning` plus `reasoning_details` split in chunks."""
    shaped = json.loads(json.dumps(response))
    message = shaped["choices"][0]["message"]
    reasoning = message.pop("reasoning", None) or message.pop("reasoning_content", None)
    message.pop("reasoning_content", None)
    if reasoning:
        message["reasoning"] = reasoning
        size = max(1, len(reasoning) // 3)
        chunks = [reasoning[i : i + size] for i in range(0, len(reasoning), size)]
        message["reasoning_details"] = [
            {"type": "reasoning.text", "text": c, "format": "unknown", "index": 0} for c in chunks
        ]
    for n, call in enumerate(message.get("tool_calls") or []):
        if replace_ids:
            call["id"] = f"call_{n:02d}{'0' * 22}"
    shaped["provider"] = "OpenRouter"
    return shaped


def _differences(a: Any, b: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(path, a's value, b's value) for every leaf where two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            yield from _differences(a.get(key), b.get(key), f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for x, y in zip(a, b, strict=True):
            yield from _differences(x, y, f"{path}[]")
    elif a != b:
        yield path, a, b


def compare(old: str, new: str) -> int:
    """Compare two servers' fixture files, variant by variant (`vllm-0.33.0` `vllm-0.34.0`):
    does a new version answer as the old one did, so that the old profile covers it? A
    random tool-call id (serving_chat's `chatcmpl-tool-<uuid>`) on both sides is counted apart:
    two runs of one version differ there too."""
    differing = compared = 0
    for path in sorted(FIXTURE_DIR.glob(f"{old}-*.jsonl")):
        other = FIXTURE_DIR / path.name.replace(f"{old}-", f"{new}-", 1)
        if not other.exists():
            continue
        compared += 1
        rows = {}
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            rows[row["id"]] = row
        paths: dict[str, int] = {}
        random_ids = same = total = 0
        for line in other.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            total += 1
            mine = rows.pop(row["id"], None)
            if mine is None:
                missing = "(answer missing from the old file)"
                paths[missing] = paths.get(missing, 0) + 1
                continue
            found = [
                (where, a, b) for where, a, b in _differences(mine, row) if where != ".version"
            ]
            ids = [f for f in found if f[0].endswith("tool_calls[].id")]
            if ids and all(
                str(a).startswith("chatcmpl-tool-") and str(b).startswith("chatcmpl-tool-")
                for _, a, b in ids
            ):
                random_ids += 1
                found = [f for f in found if f not in ids]
            same += not found
            for where, _, _ in found:
                paths[where] = paths.get(where, 0) + 1
        if rows:
            paths["(answer missing from the new file)"] = len(rows)
        differing += sum(paths.values())
        print(f"{other.name} against {path.name}: {same} of {total} answers the same", end="")
        print(f" ({random_ids} differ only in random chatcmpl-tool- ids)" if random_ids else "")
        for where, count in sorted(paths.items()):
            print(f"  {count} differ at {where}")
    if not compared:
        print(f"no variant written for both {old} and {new} in {FIXTURE_DIR} (--only {new} first)")
        return 2
    return 1 if differing else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venvs", type=Path, default=Path("/tmp/srv9a"))
    parser.add_argument(
        "--tokenizer", type=Path, default=ROOT.parent / "shared/tokenizers/kimi-k2.5"
    )
    parser.add_argument("--worker", choices=["vllm", "sglang"])
    parser.add_argument("--version", default="")
    parser.add_argument("--settings", default="{}")
    parser.add_argument(
        "--only",
        action="append",
        metavar="SERVER-VERSION",
        help="run these variants only (e.g. vllm-0.34.0; repeatable); the others' files stay",
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("OLD", "NEW"),
        help="compare two servers' written files (e.g. vllm-0.33.0 vllm-0.34.0) and exit",
    )
    args = parser.parse_args()
    if args.compare:
        raise SystemExit(compare(*args.compare))
    if args.worker:
        run_worker(args.worker, args.version, json.loads(args.settings), args.tokenizer)
        return
    answers = build_ground_truth()
    FIXTURE_DIR.mkdir(parents=True, exist_ok=True)
    payload = json.dumps(answers)
    chosen = [v for v in VARIANTS if not args.only or f"{v['server']}-{v['version']}" in args.only]
    if not chosen:
        raise SystemExit(f"--only {args.only}: no such variant")
    for variant in chosen:
        python = args.venvs / variant["venv"] / "bin" / "python"
        done = subprocess.run(
            [
                str(python),
                __file__,
                "--worker",
                variant["server"],
                "--version",
                variant["version"],
                "--settings",
                json.dumps(variant["settings"]),
                "--tokenizer",
                str(args.tokenizer),
            ],
            input=payload,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": ""},
        )
        if done.returncode != 0:
            print(f"{variant['server']} {variant['version']} failed:\n{done.stderr[-3000:]}")
            continue
        by_id = {a["id"]: a for a in answers}
        spaces = (
            "spaces" if variant["settings"].get("spaces_between_special_tokens") else "nospaces"
        )
        stream = "-stream" if variant["settings"].get("stream") else ""
        stem = f"{variant['server']}-{variant['version']}-{spaces}{stream}"
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        shapes = [("", None)]
        if variant["server"] == "vllm" and variant["version"] == "0.33.0" and spaces == "nospaces":
            shapes += [("-openrouter-keep-ids", False), ("-openrouter-call-ids", True)]
        for suffix, replace in shapes:
            path = FIXTURE_DIR / f"{stem}{suffix}.jsonl"
            with path.open("w") as out:
                for row in rows:
                    answer = by_id[row["id"]]
                    if "error" in row["message"]:
                        continue
                    response = _response(answer, row["message"], variant["server"])
                    if replace is not None:
                        response = _openrouter_shape(response, replace)
                    record = {
                        "id": row["id"],
                        "server": variant["server"] + ("+openrouter" if suffix else ""),
                        "version": variant["version"],
                        "settings": variant["settings"]
                        | ({"ids": "call_" if replace else "kept"} if suffix else {}),
                        "messages": answer["messages"],
                        "tools": answer["tools"],
                        "response": response,
                        "ground_truth_output_ids": answer["output_ids"],
                        "decoded_text": row["decoded_text"],
                    }
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
            print(f"wrote {path.relative_to(ROOT)}: {len(rows)} records")


if __name__ == "__main__":
    main()
