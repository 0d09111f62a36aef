"""A streamed answer of tests/fixtures/wild, assembled from its recorded SSE payloads.

Each streamed row of the wild corpus keeps the provider's SSE `data:` payloads as recorded
(`raw_stream`) and the chat.completion they add up to (`response`), which reconstruction
reads. `assemble` is that addition, as an OpenAI-compatible client does it: content and each
reasoning field concatenated, `reasoning_details` merged by (type, index), tool calls by
index (id and name from their first delta, arguments concatenated), the last finish reason,
the last usage, and every other top-level field from its first non-null value.
tests/test_wild_corpus.py checks every streamed row's `response` against it, so no assembled
answer can differ from what the provider sent. Reading a cassette's own format (YAML
interactions, a recorder's JSON) into payloads is per source; docs/wild.md names each.

    python -m tools.cassette2corpus ROWS.jsonl[.gz]   # rows whose response is not their stream's
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_CHUNK_ONLY = ("choices", "usage", "object")


def assemble(payloads: Iterable[str]) -> dict[str, Any]:
    """The chat.completion a stream's `data:` payloads add up to."""
    top: dict[str, Any] = {}
    message: dict[str, Any] = {"role": "assistant"}
    content: str | None = None
    reasoning: dict[str, str] = {}
    details: list[dict[str, Any]] | None = None
    calls: dict[int, dict[str, Any]] = {}
    saw_calls = False
    finish = native = usage = None
    for payload in payloads:
        if payload.strip() == "[DONE]":
            continue
        chunk = json.loads(payload)
        for key in (k for k in chunk if k not in _CHUNK_ONLY):
            if top.get(key) is None:
                top[key] = chunk[key]
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content") is not None:
                content = (content or "") + delta["content"]
            for field in ("reasoning_content", "reasoning"):
                if delta.get(field) is not None:
                    reasoning[field] = reasoning.get(field, "") + delta[field]
            for part in delta.get("reasoning_details") or []:
                details = details if details is not None else []
                last = details[-1] if details else None
                if last and (last.get("type"), last.get("index")) == (
                    part.get("type"),
                    part.get("index"),
                ):
                    last["text"] = last.get("text", "") + (part.get("text") or "")
                else:
                    details.append(dict(part))
            saw_calls = saw_calls or "tool_calls" in delta
            for call in delta.get("tool_calls") or []:
                index = call.get("index", 0)
                function = call.get("function") or {}
                into = calls.setdefault(
                    index,
                    {
                        "index": index,
                        "id": None,
                        "type": "function",
                        "function": {"name": None, "arguments": ""},
                    },
                )
                into["id"] = into["id"] or call.get("id")
                into["function"]["name"] = into["function"]["name"] or function.get("name")
                into["function"]["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
            native = choice.get("native_finish_reason") or native
    message["content"] = content
    message.update(reasoning)
    if calls or saw_calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    if details:
        message["reasoning_details"] = details
    choice_out: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    if native is not None:
        choice_out["native_finish_reason"] = native
    out = {**top, "object": "chat.completion", "choices": [choice_out]}
    if usage is not None:
        out["usage"] = usage
    return out


def without_nulls(value: Any) -> Any:
    """`value` with null-valued keys left out: a reader's `.get` sees no difference."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def mismatches(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Ids of the streamed rows whose `response` is not what their `raw_stream` adds up to."""
    return [
        str(row.get("id"))
        for row in rows
        if row.get("raw_stream")
        and without_nulls(assemble(row["raw_stream"])) != without_nulls(row["response"])
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=Path)
    path = parser.parse_args(argv).rows
    raw = path.read_bytes()
    text = gzip.decompress(raw).decode() if path.suffix == ".gz" else raw.decode()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    bad = mismatches(rows)
    streamed = sum(1 for r in rows if r.get("raw_stream"))
    print(f"{streamed - len(bad)} of {streamed} streamed rows are their stream's assembly")
    for row_id in bad:
        print(f"  differs: {row_id}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
