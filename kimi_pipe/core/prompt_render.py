"""Prompt rendering from the model's declarative format (pure functions, no IO).

Every value taken from a message is ordinary text: a user who types `<|im_end|>` gets
the characters, never the end-of-turn id.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kimi_pipe.core.formats import Marker, ModelFormat, OutputFormat, Piece, PromptFormat
from kimi_pipe.core.models import Model
from kimi_pipe.core.tool_declarations import render_tools
from kimi_pipe.errors import InputError


class PromptError(InputError):
    """The messages cannot be rendered (unknown role, unsupported content part, ...)."""


# Every field a client may send an earlier turn's reasoning in: the model's own
# (`reasoning_content` for Kimi), OpenRouter's string and OpenRouter's list of blocks.
REASONING_FIELDS = ("reasoning_content", "reasoning", "reasoning_details")


@dataclass(frozen=True)
class HistoryRendering:
    """How earlier turns are rendered: as the model's template does (the default), or as a
    stack that re-renders history does (core/prompt_proof.py weighs each against the bill).

    reasoning: "template" (the fields `model.prompt.history_reasoning_fields` names),
      "any_field" (any spelling in REASONING_FIELDS: a router that passes OpenRouter's
      `reasoning` or `reasoning_details` on as the model's own field), "dropped" (no
      earlier reasoning at all).
    arguments: "verbatim" (as sent), "compact" or "spaced" (earlier calls' JSON arguments
      re-serialised without or with json.dumps' default spaces).
    ids: "verbatim" (as sent), "canonical" (earlier call ids outside the model's id pattern,
      and the tool results that name them, rebuilt in the model's own form, as Moonshot
      advises clients to keep them: `add:0` -> `functions.add:0`).
    """

    reasoning: str = "template"
    arguments: str = "verbatim"
    ids: str = "verbatim"

    @property
    def name(self) -> str:
        parts = [] if self.reasoning == "template" else [f"reasoning_{self.reasoning}"]
        parts += [] if self.arguments == "verbatim" else [f"arguments_{self.arguments}"]
        parts += [] if self.ids == "verbatim" else [f"ids_{self.ids}"]
        return "+".join(parts) or "template"


TEMPLATE_HISTORY = HistoryRendering()


def message_text(content: Any, join: str = "") -> str:
    """Text of an OpenAI message content: a string, None, or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type", "text") == "text":
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise PromptError(f"unsupported content part {kind!r} (only text is rendered)")
        return join.join(texts)
    raise PromptError(f"message content must be a string or a list, not {type(content).__name__}")


def arguments_text(arguments: Any) -> str:
    """Tool-call arguments as the model wrote them: strings verbatim, objects as the
    chat templates serialise them (json.dumps, ensure_ascii=False, default separators)."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tool_calls(
    out: OutputFormat, calls: Sequence[Mapping[str, Any]], ids: Sequence[str]
) -> tuple[list[Piece], bool]:
    """The model's native tool-call section. Returns pieces and whether any argument
    string had to be kept verbatim because it was not JSON (xml_parameters only)."""
    pieces: list[Piece] = []
    not_json = False
    for index, (call, call_id) in enumerate(zip(calls, ids, strict=True)):
        function = call.get("function") or {}
        name = str(function.get("name") or "")
        raw = arguments_text(function.get("arguments"))
        arguments: str | list[Piece] = raw
        if out.arguments == "xml_parameters" and out.parameter is not None:
            try:
                parsed = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                arguments = []
                for key, value in parsed.items():
                    # Template rule: strings verbatim, anything else as JSON (null for None).
                    text = value if isinstance(value, str) else _json(value)
                    arguments.extend(out.parameter.render(key=str(key), value=text))
            else:
                not_json = True
        if index and out.tool_call_separator:
            pieces.append(out.tool_call_separator)
        pieces.extend(out.tool_call.render(id=call_id, name=name, arguments=arguments))
    return out.tool_calls.render(calls=pieces), not_json


def _keep_reasoning_from(fmt: PromptFormat, messages: Sequence[Mapping[str, Any]]) -> int:
    """Index from which assistant turns keep their reasoning in the prompt."""
    roles = [m.get("role") for m in messages]
    if fmt.keep_reasoning == "all":
        return 0
    if fmt.keep_reasoning == "none":
        return len(messages)
    if fmt.keep_reasoning == "after_last_user":
        return max((i for i, r in enumerate(roles) if r == "user"), default=-1) + 1
    # after_last_final_answer: the last assistant turn without tool calls and all before it
    # lose their reasoning (Kimi K2 family templates).
    last = -1
    for i, m in enumerate(messages):
        if m.get("role") == "assistant" and not m.get("tool_calls"):
            last = i
    return last + 1


def _history_reasoning(
    fmt: PromptFormat, message: Mapping[str, Any], history: HistoryRendering = TEMPLATE_HISTORY
) -> str:
    """The reasoning an earlier assistant turn shows in the prompt: the first configured
    field the message has (`model.prompt.history_reasoning_fields`; under `any_field` also
    every spelling of REASONING_FIELDS), a null one rendered as the template renders null; a
    field the template would print some other way is refused rather than guessed."""
    keys = fmt.history_reasoning_fields
    if history.reasoning == "any_field":
        keys = tuple(dict.fromkeys([*keys, *REASONING_FIELDS]))
    for key in keys:
        if key not in message:
            continue
        value = message[key]
        if key == "reasoning_details" and isinstance(value, list):
            value = reasoning_details_text(value)
            if not value:
                continue
        if value is None:
            return fmt.history_reasoning_null
        if isinstance(value, str):
            return value
        raise PromptError(f"assistant {key} must be a string or null, not {type(value).__name__}")
    return ""


def reasoning_details_text(details: Sequence[Any]) -> str:
    """The text of OpenRouter's `reasoning_details` blocks (`reasoning.text`; summaries and
    encrypted blocks carry no model text)."""
    return "".join(
        str(block.get("text") or "")
        for block in details
        if isinstance(block, Mapping) and block.get("type", "reasoning.text") == "reasoning.text"
    )


def render_prompt(
    fmt: ModelFormat,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    history: HistoryRendering = TEMPLATE_HISTORY,
) -> list[Piece]:
    """Pieces of the prompt: tool declarations, the turns, then the generation prompt.
    `history`: how earlier turns are rendered (default: as the model's template does)."""
    p = fmt.prompt
    pieces: list[Piece] = p.prefix.render()  # a new list
    for index, message in enumerate(messages):
        # (dict, Mapping): Mapping's answer, JSON's dict without the ABC's registry lookup.
        if not isinstance(message, (dict, Mapping)):
            raise PromptError(f"message {index} is not an object")
    skip: set[int] = set()
    system_in_tools = False
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)
    ):
        raise PromptError("tools must be a list of objects")
    if tools and p.tools is not None:
        declared = render_tools(list(tools), p.tools_style)
        if "system" in p.tools.fields:
            # The template declares tools inside the system turn (Qwen3.5): a leading system
            # message (or the default one) goes into that turn instead of its own.
            system_in_tools = True
            system = _leading_system(p, messages)
            if messages and messages[0].get("role") in ("system", "developer"):
                skip.add(0)
            merged = p.tools_system.render(content=system) if system and p.tools_system else []
            pieces += p.tools.render(tools=declared, system=merged)
        else:
            pieces += p.tools.render(tools=declared)
    if p.default_system is not None and not system_in_tools and not _starts_with_system(messages):
        pieces += p.system.render(name="system", role="system", content=_trim(p, p.default_system))
    keep_from: int | None = None  # read at the first assistant turn: only those turns use it
    renamed = _canonical_ids(fmt, messages) if history.ids == "canonical" else {}
    roles: list[Any] | None = None  # read where a tool result needs its neighbours
    for index, message in enumerate(messages):
        if index in skip:
            continue
        role = message.get("role")
        name = str(message.get("name") or role)
        content = _trim(p, message_text(message.get("content"), p.content_join))
        if role == "system" or role == "developer":
            pieces += p.system.render(name=name, role="system", content=content)
        elif role == "user":
            pieces += p.user.render(name=name, role=role, content=content)
        elif role == "tool":
            if roles is None:
                roles = [m.get("role") for m in messages]
            # Optional group framing: consecutive tool results share one turn.
            if p.tool_group_start is not None and (index == 0 or roles[index - 1] != "tool"):
                pieces += p.tool_group_start.render()
            call_id = str(message.get("tool_call_id") or "")
            call_id = renamed.get(call_id, call_id)
            pieces += p.tool.render(name=name, role=role, tool_call_id=call_id, content=content)
            last_of_run = index + 1 == len(roles) or roles[index + 1] != "tool"
            if p.tool_group_end is not None and last_of_run:
                pieces += p.tool_group_end.render()
        elif role == "assistant":
            if keep_from is None:
                dropped = history.reasoning == "dropped"
                keep_from = len(messages) if dropped else _keep_reasoning_from(p, messages)
            body = _assistant_body(fmt, message, content, index >= keep_from, history, renamed)
            pieces += p.assistant.render(name=name, role=role, body=body)
        else:
            raise PromptError(f"message {index}: unknown role {role!r}")
    pieces += p.generation.render()
    return pieces


def _trim(fmt: PromptFormat, text: str) -> str:
    """Jinja's `|trim` (Python str.strip()) where the model's template applies it."""
    return text.strip() if fmt.trim_content else text


def _starts_with_system(messages: Sequence[Mapping[str, Any]]) -> bool:
    return bool(messages) and messages[0].get("role") == "system"


def _leading_system(fmt: PromptFormat, messages: Sequence[Mapping[str, Any]]) -> str:
    """Text of a leading system/developer message, else the default system prompt, else ""."""
    if messages and messages[0].get("role") in ("system", "developer"):
        return _trim(fmt, message_text(messages[0].get("content"), fmt.content_join))
    return _trim(fmt, fmt.default_system or "")


def content_and_tool_calls(
    out: OutputFormat,
    content: Sequence[Piece],
    calls: Sequence[Mapping[str, Any]],
    ids: Sequence[str],
) -> tuple[list[Piece], bool]:
    """Content, then the tool-call section; `tool_calls_after_content` goes between the two
    when the content has text. Returns the pieces and render_tool_calls' not-JSON flag."""
    pieces = out.content.render(content=list(content))
    if not calls:
        return pieces, False
    section, not_json = render_tool_calls(out, calls, ids)
    if out.tool_calls_after_content and has_text(content):
        pieces.append(out.tool_calls_after_content)
    return pieces + section, not_json


def has_text(pieces: Sequence[Piece]) -> bool:
    """Anything but whitespace (the templates test `content|trim`)."""
    return any(isinstance(p, Marker) or p.strip() for p in pieces)


def _assistant_body(
    fmt: ModelFormat,
    message: Mapping[str, Any],
    content: str,
    keep_reasoning: bool,
    history: HistoryRendering = TEMPLATE_HISTORY,
    renamed: Mapping[str, str] | None = None,
) -> list[Piece]:
    p, out = fmt.prompt, fmt.output
    if keep_reasoning:
        reasoning = _history_reasoning(p, message, history)
        body = p.history_reasoning.render(reasoning=_trim(p, reasoning))
    else:
        body = p.history_no_reasoning.render()
    calls = [_history_call(c, history.arguments) for c in message.get("tool_calls") or []]
    ids = [str(c.get("id") or "") for c in calls]
    ids = [(renamed or {}).get(i, i) for i in ids]
    section, _ = content_and_tool_calls(out, [content] if content else [], calls, ids)
    body += section
    body += out.end.render()
    return body


def _canonical_ids(fmt: ModelFormat, messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Earlier call ids outside the model's id pattern -> the model's own form, numbered over
    the conversation (`model.output.tool_call_id`)."""
    out = fmt.output
    renamed: dict[str, str] = {}
    if out.tool_call_id_pattern is None:
        return renamed
    index = 0
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            call_id = str(call.get("id") or "") if isinstance(call, Mapping) else ""
            function = call.get("function") if isinstance(call, Mapping) else None
            name = str(function.get("name") or "") if isinstance(function, Mapping) else ""
            if call_id and not out.tool_call_id_pattern.match(call_id):
                renamed[call_id] = out.tool_call_id.format(name=name, index=index)
            index += 1
    return renamed


def _history_call(call: Mapping[str, Any], arguments: str = "verbatim") -> Mapping[str, Any]:
    """A tool call of the prompt as the templates print it: arguments that are not a string
    go through `tojson`, so null arguments are the text `null` (not an empty object).
    `arguments` "compact" / "spaced": JSON argument strings re-serialised as a stack that
    parses and re-dumps them does (anything else stays as sent)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        return call
    value = function.get("arguments", "")
    if value is None:
        return {**call, "function": {**function, "arguments": _json(None)}}
    if arguments == "verbatim" or not isinstance(value, str):
        return call
    try:
        parsed = json.loads(value)
    except ValueError:
        return call
    separators = (",", ":") if arguments == "compact" else (", ", ": ")
    text = json.dumps(parsed, ensure_ascii=False, separators=separators)
    return {**call, "function": {**function, "arguments": text}}


def prompt_ids(
    model: Model,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    history: HistoryRendering = TEMPLATE_HISTORY,
) -> list[int]:
    return model.encode_prompt(render_prompt(model.format, messages, tools, history))
