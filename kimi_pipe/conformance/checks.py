"""Conformance checks: one probe's answer -> {quirk: (verdict, evidence)}. Each check is
deterministic and reads only the answer and the probe (conf/probes/<model>.yaml); the battery,
the profile fitting and the verdicts per provider are in kimi_pipe/conformance/probe.py."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from kimi_pipe.core.issue_codes import Code

CLEAN, SEEN, UNKNOWN = "clean", "seen", "unknown"
NATIVE_ID = re.compile(r"^functions\.(?P<name>[^:\s]+):(?P<index>\d+)$")


Verdicts = dict[str, tuple[str, str]]


def message_of(record: Mapping[str, Any]) -> Mapping[str, Any]:
    resp = record.get("response")
    try:
        msg = resp["choices"][0]["message"]  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        return {}
    return msg if isinstance(msg, Mapping) else {}


def _reasoning(msg: Mapping[str, Any]) -> str:
    for key in ("reasoning", "reasoning_content"):
        if isinstance(msg.get(key), str) and msg[key]:
            return msg[key]
    extra = msg.get("provider_specific_fields") or {}
    for key in ("reasoning", "reasoning_content"):
        if isinstance(extra.get(key), str) and extra[key]:
            return extra[key]
    return ""


def tool_calls_of(msg: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    calls = msg.get("tool_calls") or []
    return [c for c in calls if isinstance(c, Mapping)] if isinstance(calls, list) else []


def _think_end(content: str, reasoning: str, expected: str) -> Verdicts:
    """An empty content with the expected answer inside the reasoning: </think> was lost."""
    if content.strip():
        return {"think_end_dropped": (CLEAN, "content is not empty")}
    if expected and expected in reasoning:
        return {"think_end_dropped": (SEEN, f"content empty, {expected!r} in the reasoning")}
    return {}


def check_answer(probe: Mapping[str, Any], record: Mapping[str, Any]) -> Verdicts:
    """Deterministic verdicts from one answered probe (logprobs used where present)."""
    if record.get("error") or not record.get("response"):
        return {}
    spec = probe["check"]
    kind = spec["kind"]
    msg = message_of(record)
    raw_content = msg.get("content")
    content: str = raw_content if isinstance(raw_content, str) else ""
    reasoning = _reasoning(msg)
    issues = set(record.get("issues") or [])
    out: Verdicts = {}
    if kind == "begins_with":
        word = str(spec["word"])
        if content.startswith(word):
            out["marker_spacing"] = (CLEAN, f"content starts with {word!r}")
        elif content[:1].isspace() and content.lstrip().startswith(word):
            out["marker_spacing"] = (SEEN, f"content starts with {content[: len(word) + 2]!r}")
        out |= _think_end(content, reasoning, word)
    elif kind == "ends_with_newline":
        line = str(spec["line"])
        if content.endswith(line + "\n"):
            out["content_whitespace_stripped"] = (CLEAN, "the newline after the line is kept")
        elif content.strip() == line:
            out["content_whitespace_stripped"] = (SEEN, f"content is {content!r}")
        out |= _think_end(content, reasoning, line)
    elif kind == "keeps_text":
        text, line = str(spec["text"]), str(spec["line"])
        answer = content or reasoning
        # The asked-for line with the marker text gone (whitespace runs compared as one).
        without = " ".join(line.replace(text, " ").split())
        if text in answer:
            out["marker_text_deleted"] = (CLEAN, f"{text!r} kept in the answer")
        elif without in " ".join(answer.split()):
            out["marker_text_deleted"] = (SEEN, f"answer without {text!r}: {answer[:60]!r}")
    elif kind == "reasoning_trailing_whitespace":
        out |= _reasoning_whitespace(reasoning, record, issues)
    elif kind in ("string_argument", "tool_index", "tool_name"):
        out |= _tool_checks(kind, spec, tool_calls_of(msg), issues)
    elif kind == "argument_edges":
        out |= _argument_edges(spec, tool_calls_of(msg), record)
    elif kind == "no_reasoning":
        out |= _no_reasoning(spec, content, reasoning, record, issues)
    lp = record.get("logprobs") or {}
    if lp.get("present") and "mismatch" in lp and kind == "begins_with" and not out:
        out["marker_spacing"] = (SEEN, "the engine's tokens differ from the text")
    return out


def _no_reasoning(
    spec: Mapping[str, Any],
    content: str,
    reasoning: str,
    record: Mapping[str, Any],
    issues: set[str],
) -> Verdicts:
    """A mode without thinking (the request switched reasoning off): no reasoning came back,
    no think-end in the content, and the bill counts no token the text lacks."""
    name = "thinking_switch_ignored"
    if reasoning.strip():
        return {name: (SEEN, f"reasoning came back: {reasoning[:40]!r}")}
    think_end = str(spec.get("think_end") or "")
    if think_end and think_end in content:
        return {name: (SEEN, f"the content holds {think_end!r}")}
    reported = record.get("completion_tokens_reported")
    rebuilt = record.get("completion_tokens_reconstructed")
    if isinstance(reported, int) and isinstance(rebuilt, int) and rebuilt < reported:
        return {name: (SEEN, f"billing counts {reported - rebuilt} token(s) the text lacks")}
    if not content.strip() or Code.BILLING_MISMATCH in issues:
        return {}
    return {name: (CLEAN, "no reasoning, and the bill equals the text")}


def _reasoning_whitespace(reasoning: str, record: Mapping[str, Any], issues: set[str]) -> Verdicts:
    name = "reasoning_whitespace_stripped"
    if not reasoning:
        return {}
    if reasoning[-1:].isspace():
        return {name: (CLEAN, "the reasoning ends with whitespace")}
    lp = record.get("logprobs") or {}
    mismatch = lp.get("mismatch") or {}
    if lp.get("present") and lp.get("coverage") == "whole" and mismatch:
        text = str(mismatch.get("engine_text") or "")
        if text[:1].isspace():
            return {name: (SEEN, f"the engine wrote {text!r} where the reasoning text ends")}
    reported = record.get("completion_tokens_reported")
    rebuilt = record.get("completion_tokens_reconstructed")
    if (
        Code.BILLING_MISMATCH in issues
        and isinstance(reported, int)
        and isinstance(rebuilt, int)
        and rebuilt < reported
    ):
        return {name: (SEEN, f"billing counts {reported - rebuilt} token(s) the text lacks")}
    return {}


def _argument_edges(
    spec: Mapping[str, Any], calls: list[Mapping[str, Any]], record: Mapping[str, Any]
) -> Verdicts:
    """Arguments asked to begin and end with a newline: kept, or gone (billing counts them)."""
    name = "argument_edges_stripped"
    call = next((c for c in calls if (c.get("function") or {}).get("name") == spec["tool"]), None)
    if call is None:
        return {}
    text = str((call.get("function") or {}).get("arguments") or "")
    if text and text != text.strip():
        return {name: (CLEAN, f"arguments {text[:12]!r}... keep their edge whitespace")}
    # The engine's tokens (logprobs) hold the arguments with whitespace the text lacks.
    for trim in (record.get("logprobs") or {}).get("stack_trims") or []:
        engine = str(trim.get("engine") or "")
        if trim.get("text") == text and engine != text and engine.strip() == text:
            return {name: (SEEN, f"the engine wrote {engine[:12]!r}... for {text[:12]!r}...")}
    reported = record.get("completion_tokens_reported")
    rebuilt = record.get("completion_tokens_reconstructed")
    if isinstance(reported, int) and isinstance(rebuilt, int) and rebuilt < reported:
        return {name: (SEEN, f"billing counts {reported - rebuilt} token(s) the arguments lack")}
    # No edge whitespace and nothing missing: the model did not do what was asked.
    return {}


def _tool_checks(
    kind: str, spec: Mapping[str, Any], calls: list[Mapping[str, Any]], issues: set[str]
) -> Verdicts:
    out: Verdicts = {}
    if not calls:
        return out
    fn_of = [(c.get("function") or {}) for c in calls]
    if kind == "tool_name":
        want = str(spec["name"])
        names = [str(f.get("name") or "") for f in fn_of]
        if want in names:
            out["dotted_name_truncated"] = (CLEAN, f"name {want!r} kept")
        elif want.rsplit(".", 1)[-1] in names:
            out["dotted_name_truncated"] = (SEEN, f"name {want!r} came back as {names}")
        return out
    call = next(
        (c for c, f in zip(calls, fn_of, strict=True) if f.get("name") == spec["tool"]), None
    )
    if call is None:
        return out
    if kind == "string_argument":
        try:
            args = json.loads((call.get("function") or {}).get("arguments") or "")
        except (TypeError, ValueError):
            return out
        value = args.get(spec["key"]) if isinstance(args, dict) else None
        text = str((call.get("function") or {}).get("arguments"))
        # The model writes JSON as its template does (", " and ": "); other spacing with a
        # token count or engine tokens that disagree is a server's re-serialisation.
        respaced = text != json.dumps(args, ensure_ascii=False)
        doubted = issues & {Code.BILLING_MISMATCH, Code.LOGPROB_MISMATCH}
        if value == spec["value"] and respaced and doubted:
            why = f"arguments {text!r} re-spaced ({', '.join(sorted(doubted))})"
            out["argument_reserialised"] = (SEEN, why)
        elif value == spec["value"]:
            out["argument_reserialised"] = (CLEAN, f"{spec['key']} is the string {value!r}")
        elif value is not None and not isinstance(value, str) and str(value) == spec["value"]:
            out["argument_reserialised"] = (SEEN, f"{spec['key']} came back as {value!r}")
    if kind == "tool_index":
        call_id = str(call.get("id") or "")
        match = NATIVE_ID.match(call_id.strip())
        if match is not None and call_id != call_id.strip():
            out["marker_spacing"] = (SEEN, f"tool-call id {call_id!r} has spaces around it")
        if match is None:
            out["foreign_tool_ids"] = (SEEN, f"id {call_id!r}")
        else:
            out["foreign_tool_ids"] = (CLEAN, f"id {call_id!r}")
            index = int(match["index"])
            verdict = CLEAN if index == int(spec["index"]) else SEEN
            out["tool_index_rule"] = (verdict, f"index {index}, the model counts {spec['index']}")
    return out
