"""Declarative chat formats: what a model's prompt looks like and what it emits.

A format is data from `conf/model/*.yaml`. Templates are plain strings with `{field}`
placeholders (`{{`/`}}` for literal braces). Inside a template's literal text, every
marker the model config declares (`<|im_end|>`, `</think>`, ...) is a marker id; the
values substituted into `{field}` are always ordinary text, so text taken from a
dataset or a provider can never become a marker id by accident.
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any


@dataclass(frozen=True)
class Marker:
    """A structural token, kept as its name; the model maps it to its id."""

    name: str


Piece = str | Marker
"""A rendered fragment: ordinary text, or a marker."""


@dataclass(frozen=True)
class Template:
    """A parsed template: literal text, markers, and `{field}` slots in order."""

    source: str
    parts: tuple[tuple[str, str], ...]  # ("text"|"marker"|"field", value)

    @classmethod
    def parse(cls, source: str, marker_names: Sequence[str]) -> Template:
        split = _marker_splitter(tuple(marker_names))
        parts: list[tuple[str, str]] = []
        for literal, field_name, spec, conversion in string.Formatter().parse(source):
            if literal:
                for chunk in split.split(literal) if split else [literal]:
                    if not chunk:
                        continue
                    kind = "marker" if chunk in marker_names else "text"
                    parts.append((kind, chunk))
            if field_name is not None:
                if spec or conversion or not field_name.isidentifier():
                    raise ValueError(f"template {source!r}: only plain {{name}} fields allowed")
                parts.append(("field", field_name))
        return cls(source=source, parts=tuple(parts))

    @cached_property
    def fields(self) -> frozenset[str]:
        return frozenset(v for k, v in self.parts if k == "field")

    @cached_property
    def _runs(self) -> tuple[tuple[Piece, ...], tuple[tuple[str, tuple[Piece, ...]], ...]]:
        """The literal pieces before the first field, then each field with the literal pieces
        after it, markers built once: a template is rendered several times for every answer,
        and a literal run is one `extend`, not a step each."""
        head: list[Piece] = []
        fields: list[tuple[str, list[Piece]]] = []
        for kind, value in self.parts:
            if kind == "field":
                fields.append((value, []))
            else:
                (fields[-1][1] if fields else head).append(
                    Marker(value) if kind == "marker" else value
                )
        return tuple(head), tuple((name, tuple(after)) for name, after in fields)

    def render(self, **values: str | Sequence[Piece]) -> list[Piece]:
        """Substitute fields; a value may be text or already-rendered pieces."""
        head, fields = self._runs
        out: list[Piece] = list(head)
        for name, after in fields:
            filled = values[name]
            if isinstance(filled, str):
                if filled:
                    out.append(filled)
            else:
                out.extend(filled)
            if after:
                out.extend(after)
        return out


@lru_cache(maxsize=64)
def _marker_splitter(marker_names: tuple[str, ...]) -> re.Pattern[str] | None:
    if not marker_names:
        return None
    # Longest first so that a marker that is a prefix of another never wins.
    alternatives = sorted(marker_names, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(n) for n in alternatives) + ")")


@lru_cache(maxsize=64)
def _shared_start(marker_names: tuple[str, ...]) -> str:
    """What every marker name begins with ("<|tool_call" for a tool section's markers)."""
    return os.path.commonprefix(list(marker_names)) if marker_names else ""


_STARTS_TRIED = 8


def split_markers(text: str, marker_names: Sequence[str]) -> list[Piece]:
    """Split model-output text at raw marker names (model output may spell markers)."""
    names_key = tuple(marker_names)
    split = _marker_splitter(names_key)
    if split is None or not text:
        return [text] if text else []
    start = _shared_start(names_key)
    if start:
        # Each place the names' shared start occurs is tried against the names (C calls, no
        # regex): code and prose hold "<" often, a marker name seldom. A text with more such
        # places than _STARTS_TRIED goes to the regex.
        at = text.find(start)
        for _ in range(_STARTS_TRIED):
            if at == -1:
                return [text]  # no marker begins anywhere
            if text.startswith(names_key, at):
                break
            at = text.find(start, at + 1)
    names = set(marker_names)
    return [Marker(c) if c in names else c for c in split.split(text) if c]


@dataclass(frozen=True)
class OutputFormat:
    """What the model emits after the prompt, and how to rebuild it from an API answer."""

    reasoning: Template | None  # e.g. "{reasoning}</think>"; None: the model does not think
    content: Template
    tool_calls: Template  # wraps "{calls}"
    tool_call: Template  # "{id}" "{name}" "{arguments}" fields
    tool_call_separator: str
    tool_call_id: str  # python format with {name} and {index}
    tool_call_id_pattern: re.Pattern[str] | None
    arguments: str  # "json_verbatim" | "xml_parameters"
    parameter: Template | None  # for xml_parameters: "{key}" "{value}"
    end: Template
    think_end: str | None  # marker name that closes reasoning, to split raw content
    reasoning_strip: str
    content_strip: str
    # Whitespace the templates put next to a field, which some providers hand back inside the
    # field and others strip: one copy is removed when present (the template adds it back).
    reasoning_trim_suffix: str = ""
    content_trim_prefix: str = ""
    tool_calls_after_content: str = ""  # between non-empty content and the tool-call section
    # Markers a server leaves as text in decoded answers (not skipped as special tokens), so
    # their text inside `content` stands for the marker id. Others (end of turn, role
    # headers) are dropped by servers when decoding: their text in an answer is text.
    content_markers: tuple[str, ...] = ()
    # How the model numbers its tool calls: "conversation" (after the calls already in the
    # prompt's assistant turns, as Kimi's template and vLLM do) or "response" (0 in each answer).
    tool_call_index: str = "conversation"
    # Servers decode this model with a slow tokenizer whose spaces_between_special_tokens puts
    # a space beside every kept marker: with an unknown serving profile, a leading space after
    # a marker cannot be told from the model's own and is flagged.
    marker_spacing_risk: bool = False


@dataclass(frozen=True)
class PromptFormat:
    """How a conversation is laid out before the model answers."""

    prefix: Template
    system: Template
    user: Template
    assistant: Template  # "{body}" = reasoning block + content + tool calls + end
    tool: Template
    history_reasoning: Template  # "{reasoning}" kept in history
    history_no_reasoning: Template  # reasoning dropped from history
    keep_reasoning: str  # "after_last_final_answer" | "after_last_user" | "all" | "none"
    tools: Template | None  # "{tools}" declaration block
    tools_style: str
    generation: Template
    default_system: str | None
    content_join: str  # how the text parts of a multi-part content are joined
    trim_content: bool = False  # strip whitespace of every content and history reasoning
    tool_group_start: Template | None = None  # opens a run of consecutive tool results
    tool_group_end: Template | None = None  # closes it
    tools_system: Template | None = None  # a leading system message inside `tools` ({system})
    # Message fields read for a kept history reasoning, first one present wins, and the text a
    # null value renders as (a Jinja template prints None as "None"). The default keeps
    # accepting both spellings for models whose config does not say.
    history_reasoning_fields: tuple[str, ...] = ("reasoning_content", "reasoning")
    history_reasoning_null: str = ""
    # The end of `generation` a stack may leave for the model to write (Kimi: `<think>`, billed
    # then as output): the same ids, the prompt/output boundary moved (core/prompt_proof.py).
    generation_open: Template | None = None


@dataclass(frozen=True)
class LossMaskSpec:
    prompt: int = 0
    output: int = 1
    end_token: int = 1  # set 0 to exclude the end-of-turn marker (TorchSpec convention)


@dataclass(frozen=True)
class ModelFormat:
    prompt: PromptFormat
    output: OutputFormat
    loss_mask: LossMaskSpec
    marker_names: tuple[str, ...] = field(default_factory=tuple)


def parse_format(cfg: Mapping[str, Any], marker_names: Sequence[str]) -> ModelFormat:
    """Build the format from `model.prompt`, `model.output` and `model.loss_mask`."""
    names = tuple(marker_names)

    def tpl(value: str | None) -> Template:
        return Template.parse(value or "", names)

    def opt(value: str | None) -> Template | None:
        return None if value is None else tpl(value)

    p, o = dict(cfg["prompt"]), dict(cfg["output"])
    pattern = o.get("tool_call_id_pattern")
    think_end = o.get("think_end")
    if think_end is not None and think_end not in names:
        raise ValueError(f"model.output.think_end {think_end!r} is not a declared marker")
    output = OutputFormat(
        reasoning=opt(o.get("reasoning")),
        content=tpl(o.get("content", "{content}")),
        tool_calls=tpl(o.get("tool_calls", "{calls}")),
        tool_call=tpl(o["tool_call"]),
        tool_call_separator=o.get("tool_call_separator", ""),
        tool_call_id=o.get("tool_call_id", "{name}:{index}"),
        tool_call_id_pattern=re.compile(pattern) if pattern else None,
        arguments=o.get("arguments", "json_verbatim"),
        parameter=opt(o.get("parameter")),
        end=tpl(o["end"]),
        think_end=think_end,
        reasoning_strip=o.get("reasoning_strip", ""),
        content_strip=o.get("content_strip", ""),
        reasoning_trim_suffix=o.get("reasoning_trim_suffix", ""),
        content_trim_prefix=o.get("content_trim_prefix", ""),
        tool_calls_after_content=o.get("tool_calls_after_content", ""),
        content_markers=tuple(o.get("content_markers") or ()),
        tool_call_index=o.get("tool_call_index", "conversation"),
        marker_spacing_risk=bool(o.get("marker_spacing_risk", False)),
    )
    if output.tool_call_index not in ("response", "conversation"):
        raise ValueError("model.output.tool_call_index must be response or conversation")
    unknown = set(output.content_markers) - set(names)
    if unknown:
        raise ValueError(f"model.output.content_markers not declared as markers: {sorted(unknown)}")
    if output.arguments not in ("json_verbatim", "xml_parameters"):
        raise ValueError(f"model.output.arguments: unknown style {output.arguments!r}")
    if output.arguments == "xml_parameters" and output.parameter is None:
        raise ValueError("model.output.parameter is required for xml_parameters arguments")
    prompt = PromptFormat(
        prefix=tpl(p.get("prefix", "")),
        system=tpl(p["system"]),
        user=tpl(p["user"]),
        assistant=tpl(p["assistant"]),
        tool=tpl(p["tool"]),
        history_reasoning=tpl(p.get("history_reasoning", "{reasoning}")),
        history_no_reasoning=tpl(p.get("history_no_reasoning", "")),
        keep_reasoning=p.get("keep_reasoning", "none"),
        tools=opt(p.get("tools")),
        tools_style=p.get("tools_style", "json_lines"),
        generation=tpl(p["generation"]),
        default_system=p.get("default_system"),
        content_join=p.get("content_join", ""),
        trim_content=bool(p.get("trim_content", False)),
        tool_group_start=opt(p.get("tool_group_start")),
        tool_group_end=opt(p.get("tool_group_end")),
        tools_system=opt(p.get("tools_system")),
        history_reasoning_fields=tuple(
            p.get("history_reasoning_fields") or ("reasoning_content", "reasoning")
        ),
        history_reasoning_null=str(p.get("history_reasoning_null") or ""),
        generation_open=opt(p.get("generation_open")),
    )
    if prompt.generation_open is not None and not p["generation"].endswith(p["generation_open"]):
        raise ValueError("model.prompt.generation_open must be the end of model.prompt.generation")
    if prompt.tools is not None and "system" in prompt.tools.fields and prompt.tools_system is None:
        raise ValueError("model.prompt.tools has a {system} field: set model.prompt.tools_system")
    allowed = ("after_last_final_answer", "after_last_user", "all", "none")
    if prompt.keep_reasoning not in allowed:
        raise ValueError(f"model.prompt.keep_reasoning must be one of {allowed}")
    loss = LossMaskSpec(**dict(cfg.get("loss_mask") or {}))
    return ModelFormat(prompt=prompt, output=output, loss_mask=loss, marker_names=names)
