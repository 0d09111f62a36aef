"""Test oracle for Kimi K2.5 prompt ids: the reference template rendered to one string, then
encoded the way the reference tokenizer is called by servers, written here independently of
kimi_pipe: transformers splits the string at every added token of tokenizer_config.json, and
the reference `encode` cuts each text segment into 400,000-character slices and cuts every
whitespace or non-whitespace run longer than 25,000 characters before BPE."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2

from kimi_pipe.core.models import Model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REFERENCE_MAX_CHARS = 400_000
REFERENCE_MAX_RUN = 25_000


def render_reference(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, thinking: bool = True
) -> str:
    """The oracle's text; `thinking=False` renders as the official template with
    `thinking=false` (instant mode); True leaves the variable undefined, as servers do."""
    env = jinja2.Environment(undefined=jinja2.ChainableUndefined)
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    template = env.from_string((FIXTURES / "kimi_k25_reference_template.jinja").read_text())
    tools_text = None
    if tools:
        from kimi_pipe.core.tool_declarations import render_tools

        tools_text = render_tools(tools, "typescript")
    switch = {} if thinking else {"thinking": False}
    return template.render(messages=messages, tools_text=tools_text, **switch)


def cut_runs(text: str, max_run: int) -> Iterator[str]:
    """Character by character: a piece ends before the character that would make the current
    whitespace or non-whitespace run longer than `max_run`."""
    start = 0
    length = 0
    previous_space: bool | None = None
    for index, char in enumerate(text):
        space = char.isspace()
        length = length + 1 if space == previous_space else 1
        previous_space = space
        if length > max_run:
            yield text[start:index]
            start = index
            length = 1
    if start < len(text):
        yield text[start:]


def reference_pieces(text: str, max_chars: int, max_run: int) -> list[str]:
    return [
        piece
        for offset in range(0, len(text), max_chars)
        for piece in cut_runs(text[offset : offset + max_chars], max_run)
    ]


def added_token_names(tokenizer_dir: Path) -> list[str]:
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    return [entry["content"] for entry in config["added_tokens_decoder"].values()]


def reference_encode(model: Model, tokenizer_dir: Path, text: str) -> list[int]:
    names = sorted(added_token_names(tokenizer_dir), key=len, reverse=True)
    splitter = re.compile("(" + "|".join(re.escape(n) for n in names) + ")")
    ids: list[int] = []
    for segment in splitter.split(text):
        if not segment:
            continue
        if segment in names:
            ids.extend(model.tokenizer.encode_with_markers(segment))
            continue
        for piece in reference_pieces(segment, REFERENCE_MAX_CHARS, REFERENCE_MAX_RUN):
            ids.extend(model.tokenizer.encode_with_markers(piece))
    return ids


def reference_prompt_ids(
    model: Model,
    tokenizer_dir: Path,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    thinking: bool = True,
) -> list[int]:
    return reference_encode(model, tokenizer_dir, render_reference(messages, tools, thinking))
