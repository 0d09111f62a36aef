"""Exact output ids from one provider answer (pure: no IO, no globals).

The provider returns text split into fields; the model emitted one token stream. This
module puts the fields back into the model's declarative output format and encodes
them, then checks the result against the provider's own billing.

Why one file of about 600 lines: `reconstruct` and the field rules it applies (answer
fields, tool-call ids, argument types, undoing the serving profile) are the steps of one pure
function, reviewed together against the golden snapshots; the closed candidate sets live in
candidates.py and the engine's own ids in logprobs.py.
"""

from __future__ import annotations

import fnmatch
import itertools
import unicodedata
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kimi_pipe.core.answer_checks import same_model
from kimi_pipe.core.coercion import CoercionReadings, coercion_readings
from kimi_pipe.core.formats import Marker, Piece, split_markers
from kimi_pipe.core.issue_codes import (
    LENGTH_AMBIGUOUS,
    OTHER_MODEL,
    RAW_MARKERS_IN_REASONING,
    RECONSTRUCTION_ERRORS,
    RECONSTRUCTION_NOTES,
    THINK_OPEN_AS_TEXT,
    TOOL_ARGUMENT_TYPES_BILLED,
    Code,
)
from kimi_pipe.core.models import Model
from kimi_pipe.core.prompt_proof import (
    PromptReading,
    PromptReadings,
    prompt_readings,
    prove_prompt,
)
from kimi_pipe.core.prompt_render import (
    PromptError,
    content_and_tool_calls,
    message_text,
    reasoning_details_text,
)
from kimi_pipe.core.serving import UNKNOWN, UNKNOWN_PROFILE, ServingProfile
from kimi_pipe.core.token_record import TokenIds

# Issue codes (core/issue_codes.py). Errors make `ok` false; notes are listed, `ok` kept.
ERRORS = RECONSTRUCTION_ERRORS
NOTES = RECONSTRUCTION_NOTES
LENGTH_REASONS = frozenset({"length", "max_tokens", "max_output_tokens"})


@dataclass
class Reconstruction:
    ok: bool
    issues: list[str]
    prompt_ids: list[int]
    output_ids: list[int]
    loss_mask: list[int]
    completion_tokens_reported: int | None
    completion_tokens_reconstructed: int
    details: dict[str, Any] = field(default_factory=dict)
    # Every reading of the prompt the bill was weighed against (candidate options reuse them).
    prompt_readings: PromptReadings | None = None

    def to_record(self) -> TokenIds:
        return {
            "ok": self.ok,
            "issues": list(self.issues),
            "prompt_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "loss_mask": self.loss_mask,
            "completion_tokens_reported": self.completion_tokens_reported,
            "completion_tokens_reconstructed": self.completion_tokens_reconstructed,
        }


@dataclass(frozen=True)
class AnswerFields:
    """The parts of one chat-completion choice that carry model output."""

    reasoning: str
    reasoning_source: str | None  # which field it came from, None when absent
    content: str
    tool_calls: Sequence[Mapping[str, Any]]
    finish_reason: str | None
    error: Any


def _field(obj: Mapping[str, Any], key: str) -> Any:
    """A key of a message/choice, also where LiteLLM moved it (provider_specific_fields)."""
    value = obj.get(key)
    if value is None:
        extra = obj.get("provider_specific_fields")
        if extra is not None and isinstance(extra, Mapping):
            value = extra.get(key)
    return value


def _reasoning(message: Mapping[str, Any]) -> tuple[str, str | None]:
    """reasoning, else reasoning_content, else the text blocks of reasoning_details."""
    present: str | None = None
    for key in ("reasoning", "reasoning_content"):
        value = _field(message, key)
        if isinstance(value, str):
            if value:
                return value, key
            present = present or key
    details = _field(message, "reasoning_details")
    if isinstance(details, list) and details:
        text = reasoning_details_text(details)
        if text:
            return text, "reasoning_details"
        present = present or "reasoning_details"
    return "", present


def answer_fields(response: Any) -> AnswerFields | None:
    """Read the first choice; None when the response has no usable message."""
    # (dict, Mapping): the same answer as Mapping alone, with JSON's own dict answered before
    # the ABC's registry lookup (these checks run several times for every answer).
    if not isinstance(response, (dict, Mapping)):
        return None
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], (dict, Mapping)):
        return None
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, (dict, Mapping)):
        return None
    reasoning, source = _reasoning(message)
    try:
        content = message_text(message.get("content"))
    except PromptError:
        return None
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        return None
    finish = _field(choice, "native_finish_reason") or choice.get("finish_reason")
    error = response.get("error") or choice.get("error")
    return AnswerFields(
        reasoning=reasoning,
        reasoning_source=source,
        content=content,
        tool_calls=[c for c in calls if isinstance(c, (dict, Mapping))] if calls else [],
        finish_reason=finish if isinstance(finish, str) else None,
        error=error,
    )


def output_pieces(
    model: Model,
    answer: AnswerFields,
    issues: list[str],
    call_index_offset: int = 0,
    profile: ServingProfile = UNKNOWN_PROFILE,
    tools: Sequence[Mapping[str, Any]] | None = None,
    think_end: bool = True,
    reasoning_markers: bool = False,
) -> tuple[list[Piece], bool]:
    """The model's output stream as pieces; also whether the end-of-turn was appended.
    `think_end=False`: the model closed its turn inside the reasoning (no think-end).
    `reasoning_markers`: marker text in the reasoning read as the markers' ids."""
    out = model.format.output
    truncated = answer.finish_reason in LENGTH_REASONS
    reasoning, content = answer.reasoning, answer.content
    pieces: list[Piece] = []

    if out.reasoning is not None:
        reasoning_cut = False
        # An empty reasoning field with the think-end in content: the provider did not split.
        if not reasoning and out.think_end and out.think_end in content:
            reasoning, content = content.split(out.think_end, 1)
            issues.append(Code.REASONING_FROM_CONTENT)
        elif answer.reasoning_source is None and truncated and not answer.tool_calls:
            # No reasoning field and no think-end: a provider that leaves reasoning in
            # content was cut before the model closed its reasoning.
            reasoning, content, reasoning_cut = content, "", True
        elif truncated and not content and not answer.tool_calls:
            reasoning_cut = True  # cut inside the reasoning: no think-end was emitted
        if answer.reasoning_source == "reasoning_details":
            issues.append(Code.REASONING_FROM_DETAILS)
        if out.reasoning_strip:
            reasoning = reasoning.strip(out.reasoning_strip)
        if reasoning_cut:
            return ([reasoning] if reasoning else []), False
        if not think_end:
            return [reasoning, *out.end.render()], True
        # The template's own whitespace around the think-end: kept by some providers inside
        # the fields, stripped by others; the reasoning template adds it back either way.
        reasoning = _remove_once(reasoning, out.reasoning_trim_suffix, suffix=True)
        content = _remove_once(content, out.content_trim_prefix, suffix=False)
        # A model that writes its tool-call section before the think-end leaves the section's
        # markers as text in the reasoning (K2-Thinking and K2.5 on some providers); a model
        # may also write their names as plain characters. The bill tells which (reconstruct).
        reasoning_pieces: list[Piece] = [reasoning]
        if reasoning_markers:
            reasoning_pieces = split_markers(reasoning, out.content_markers)
            issues.append(RAW_MARKERS_IN_REASONING)
        pieces += out.reasoning.render(reasoning=reasoning_pieces)

    if out.content_strip:
        content = content.strip(out.content_strip)
    if answer.tool_calls and out.tool_calls_after_content:
        # The separator follows content with text only; whitespace-only content is kept whole.
        before = _remove_once(content, out.tool_calls_after_content, suffix=True)
        if before.strip():
            content = before
    content_pieces = split_markers(content, out.content_markers)
    if _has_marker(content_pieces):
        issues.append(Code.RAW_MARKERS_IN_CONTENT)
    ids: list[str] = []
    if answer.tool_calls:
        ids = _tool_call_ids(model, profile, answer.tool_calls, call_index_offset, tools, issues)
        _check_argument_types(profile, answer.tool_calls, tools, issues)
    section, not_json = content_and_tool_calls(out, content_pieces, answer.tool_calls, ids)
    if not_json:
        issues.append(Code.TOOL_ARGUMENTS_NOT_JSON)
    pieces += section

    if truncated:
        return pieces, False
    pieces += out.end.render()
    return pieces, True


def _has_marker(pieces: Sequence[Piece]) -> bool:
    if len(pieces) == 1:
        return isinstance(pieces[0], Marker)  # the common case: one text, no generator
    return any(isinstance(p, Marker) for p in pieces)


def _remove_once(text: str, part: str, *, suffix: bool) -> str:
    if not part:
        return text
    return text.removesuffix(part) if suffix else text.removeprefix(part)


def _tool_call_ids(
    model: Model,
    profile: ServingProfile,
    calls: Sequence[Mapping[str, Any]],
    offset: int,
    tools: Sequence[Mapping[str, Any]] | None,
    issues: list[str],
) -> list[str]:
    """The ids the model wrote. The model numbers its calls `offset + position` (offset: the
    calls earlier in the conversation). An id in the model's pattern is kept when the profile
    says who numbered it; a foreign id is rebuilt; an index that no declared rule explains
    is flagged, never trusted."""
    out = model.format.output
    ids: list[str] = []
    for position, call in enumerate(calls):
        call_id = call.get("id")
        expected = offset + position
        if out.tool_call_id_pattern is None:
            ids.append(str(call_id or ""))
            continue
        if isinstance(call_id, str) and out.tool_call_id_pattern.match(call_id):
            ids.append(_model_index(profile, call_id, expected, offset, issues))
            continue
        name = _declared_name(
            profile, (call.get("function") or {}).get("name") or "", tools, issues
        )
        ids.append(out.tool_call_id.format(name=name, index=expected))
        issues.append(Code.TOOL_CALL_IDS_REBUILT)
        if offset:
            # Rebuilt with the conversation counter; the model may have counted from 0 again.
            issues.append(Code.TOOL_INDEX_UNVERIFIABLE)
    return ids


def _model_index(
    profile: ServingProfile, call_id: str, expected: int, offset: int, issues: list[str]
) -> str:
    head, _, index_text = call_id.rpartition(":")
    index = int(index_text)
    rule = profile.tool_call_ids
    if rule == "model":
        return call_id  # the model's own text, whatever it counted
    if offset and rule in ("conversation", "per_answer", "foreign", UNKNOWN):
        # A stack that numbers the calls itself wrote this index (or may have, `unknown`):
        # after earlier calls the model's own index is its counter or 0 again, not in the text.
        issues.append(Code.TOOL_INDEX_UNVERIFIABLE)
    if rule == "double_count":
        index -= offset  # SGLang 0.5.14 added the history count to the model's own index
    elif rule == "per_answer":
        index += offset
    if index != expected:
        issues.append(Code.TOOL_INDEX_UNTRUSTED)
        return call_id
    if f"{head}:{index}" != call_id:
        issues.append(Code.TOOL_INDEX_REPAIRED)
    return f"{head}:{index}"


def _declared_names(tools: Sequence[Mapping[str, Any]] | None) -> list[str]:
    names = []
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


def _declared_name(
    profile: ServingProfile,
    name: str,
    tools: Sequence[Mapping[str, Any]] | None,
    issues: list[str],
) -> str:
    """The name to rebuild an id from: a name the request does not declare may have been cut
    by the stack (web.search -> search); repaired only when the profile says so and exactly
    one declared name fits."""
    declared = _declared_names(tools)
    if not declared or name in declared:
        return name
    if profile.tool_names == "last_dot_part":
        fits = [d for d in declared if d.rsplit(".", 1)[-1] == name]
        if len(fits) == 1:
            issues.append(Code.TOOL_NAME_REPAIRED)
            return fits[0]
    issues.append(Code.TOOL_NAME_NOT_DECLARED)
    return name


def _check_argument_types(
    profile: ServingProfile,
    calls: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    issues: list[str],
) -> None:
    """A stack that coerces values to the schema ("30" -> 30) leaves valid JSON: where a call's
    arguments may be such a stack's rewrite (core/coercion.py), the model may have written
    other text. Flag unless the profile says arguments are verbatim."""
    if profile.argument_types == "verbatim" or not tools:
        return
    if any(readings is not None for readings in coercion_readings_of(calls, tools)):
        issues.append(Code.TOOL_ARGUMENTS_MAYBE_COERCED)


def coercion_readings_of(
    calls: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[CoercionReadings | None]:
    """Per call, in order: the texts a coercing stack may have turned into its arguments
    (core/coercion.py), None where it cannot have changed them."""
    schemas: dict[Any, Any] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping):
            schemas[function.get("name")] = (function.get("parameters") or {}).get("properties")
    out: list[CoercionReadings | None] = []
    for call in calls:
        function = call.get("function") or {}
        properties = schemas.get(function.get("name"))
        arguments = function.get("arguments")
        if not isinstance(properties, Mapping) or not isinstance(arguments, str):
            out.append(None)
        else:
            out.append(coercion_readings(arguments, properties))
    return out


def _types_billed(
    model: Model,
    answer: AnswerFields,
    tools: Sequence[Mapping[str, Any]] | None,
    tolerance: int,
) -> bool:
    """The bill fits the arguments as returned, and every other text a coercing stack may
    have turned into them (any combination across the calls) misses it by at least two ids
    more than the tolerance (the other ambiguities a record may carry move the count by at
    most one): so the model wrote the arguments as they are."""
    count = model.tokenizer.encode_ordinary
    changed: set[int] = set()  # count differences of the combinations that read a call anew
    for readings in coercion_readings_of(answer.tool_calls, tools):
        if readings is None:
            continue
        if not readings.complete:
            return False  # an unlisted spelling may fit the bill
        returned = len(count(readings.texts[0]))
        deltas = [len(count(text)) - returned for text in readings.texts[1:]]
        changed = {s + d for s in changed for d in [0, *deltas]} | set(deltas)
    return all(abs(d) >= 2 + tolerance for d in changed)


def _ends_mergeable(text: str) -> bool:
    """A newline after a final punctuation mark joins its BPE chunk (pat_str `[^\\s\\p{L}\\p{N}]+
    [\\r\\n]*`), often as one token of the same count: its loss is invisible in the billing.
    After a letter, digit or ideograph any whitespace is a chunk of its own (one token more)."""
    last = text[-1:]
    return bool(last) and not last.isspace() and unicodedata.category(last)[0] not in "LN"


# Whitespace the model may have written at an argument's edges that a stripping parser removes
# at no cost in ids. A leading run joins the first chunk only as its one optional prefix
# character (pat_str's ` ?` / `[^\r\n\p{L}\p{N}]?`), so every whitespace character is tried
# alone; a trailing run joins only a final punctuation chunk as carriage returns and newlines.
_EDGE_LEADS = tuple(c for c in map(chr, range(0x3001)) if c.isspace()) + ("  ", " \n", "\n ")
_EDGE_TRAILS = tuple(
    dict.fromkeys(
        ["".join(p) for n in range(1, 5) for p in itertools.product("\r\n", repeat=n)]
        + ["\n" * n for n in range(5, 17)]
        + ["\r\n" * n for n in range(3, 9)]
        + [" ", "\t", " \n", "\n "]
    )
)


def argument_edge_readings(model: Model, call: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(leading, trailing) whitespace the model may have written around this call's returned
    arguments at the same count of ids, ("", "") first; only ("", "") at an edge that already
    carries whitespace (a stack that strips left none there) or for non-string arguments."""
    function = call.get("function")
    arguments = function.get("arguments") if isinstance(function, Mapping) else None
    if not isinstance(arguments, str) or not arguments.strip():
        return [("", "")]
    count = model.tokenizer.encode_ordinary
    windows = _edge_windows(model, arguments)
    # Whitespace at one edge re-splits only that edge's window (see _edge_windows), so each
    # reading is counted on a few characters, not on the whole argument ~80 times; a window's
    # readings depend on its text alone, so arguments that begin or end alike share them.
    if windows:
        first, last = windows
        # An edge that still has whitespace was not stripped (a stack may strip one side only).
        leads = [""] + ([] if arguments[0].isspace() else list(_readings(model, first, lead=True)))
        trails = [""] + (
            [] if arguments[-1].isspace() else list(_readings(model, last, lead=False))
        )
        # Disjoint windows: neither edge adds an id, so no pairing of them does.
        return [(lead, trail) for lead in leads for trail in trails]
    # No two cuts: every reading is counted on the whole argument (~100 encodes), so the
    # readings are kept, as the windows' are; a candidate enumeration asks for each hypothesis.
    # One lookup, one store: another thread's clear in between cannot lose this one's readings.
    cache = _WHOLE_READINGS.setdefault(model.tokenizer, {})
    readings = cache.get(arguments)
    if readings is None:
        readings = _whole_readings(count, arguments)
        if len(cache) >= _WHOLE_READINGS_KEPT:
            cache.clear()  # a bound, not an LRU: one answer's hypotheses ask in a row
        cache[arguments] = readings
    return list(readings)


def _whole_readings(
    count: Callable[[str], list[int]], arguments: str
) -> tuple[tuple[str, str], ...]:
    base = len(count(arguments))
    leads = [""]
    if not arguments[0].isspace():
        leads += [w for w in _EDGE_LEADS if len(count(w + arguments)) == base]
    trails = [""]
    if not arguments[-1].isspace():
        trails += [w for w in _EDGE_TRAILS if len(count(arguments + w)) == base]
    return tuple(
        (lead, trail)
        for lead in leads
        for trail in trails
        if (lead, trail) == ("", "") or len(count(lead + arguments + trail)) == base
    )


def _edges_ambiguous(model: Model, call: Mapping[str, Any]) -> bool:
    """`len(argument_edge_readings(model, call)) > 1`, without building the pairs: with two
    windows, one edge's readings settle it (the trailing ones are not even looked up when a
    leading one exists). Every answer with a call asks this, flagged or not."""
    function = call.get("function")
    arguments = function.get("arguments") if isinstance(function, (dict, Mapping)) else None
    if not isinstance(arguments, str) or not arguments.strip():
        return False
    windows = _edge_windows(model, arguments)
    if windows is None:
        return len(argument_edge_readings(model, call)) > 1
    first, last = windows
    if not arguments[0].isspace() and _readings(model, first, lead=True):
        return True
    return not arguments[-1].isspace() and bool(_readings(model, last, lead=False))


def _is_safe_cut(text: str, i: int) -> bool:
    """GPT-style pre-tokenizer patterns (tiktoken's, byte-level BPE's) start a new piece at one
    space between two non-whitespace characters whatever surrounds it: a letter, digit or
    punctuation run stops at the space, no whitespace run reaches across it, and the piece
    there starts with it. Each side of such a cut encodes as it does in the whole text."""
    return 0 < i < len(text) - 1 and not text[i - 1].isspace() and not text[i + 1].isspace()


def _edge_windows(model: Model, arguments: str) -> tuple[str, str] | None:
    """The argument's first and last stretch, up to its first and from its last safe cut;
    None when there are no two cuts, or when the tokenizer's split is not known to honour the
    cuts (`splits_at_lone_spaces`) and the stretches' counts do not add up to the whole's.
    Under a GPT-style split a final punctuation run after a letter or digit is a piece of its
    own (no letter or digit piece takes punctuation after it), so it is the last stretch."""
    head = arguments.find(" ")
    while head != -1 and not _is_safe_cut(arguments, head):
        head = arguments.find(" ", head + 1)
    tail = arguments.rfind(" ")
    while tail > head and not _is_safe_cut(arguments, tail):
        tail = arguments.rfind(" ", 0, tail)
    if head == -1 or tail <= head:
        return None
    first, last = arguments[:head], arguments[tail:]
    if getattr(model.tokenizer, "splits_at_lone_spaces", False):
        run = _punctuation_run(last)
        before = last[-run - 1 : -run] if run else ""
        if run and before and unicodedata.category(before)[0] in "LN":
            last = last[-run:]
        return first, last
    count = model.tokenizer.encode_ordinary
    middle = len(count(arguments[head:tail]))
    if len(count(first)) + middle + len(count(last)) != len(count(arguments)):
        return None
    return first, last


def _punctuation_run(text: str) -> int:
    """The length of the text's final run of characters that are not whitespace, letters or
    digits."""
    run = 0
    for char in reversed(text):
        if char.isspace() or unicodedata.category(char)[0] in "LN":
            break
        run += 1
    return run


# Per tokenizer, the whitespace readings of each edge window seen: a pure function of the
# window's text, kept while the tokenizer lives (keyed by the tokenizer itself, not its id).
_WINDOW_READINGS: weakref.WeakKeyDictionary[Any, dict[tuple[str, bool], tuple[str, ...]]] = (
    weakref.WeakKeyDictionary()
)


# Per tokenizer, the readings of whole arguments that have no two safe cuts, at most
# _WHOLE_READINGS_KEPT of them (an argument may be long; a window is a few characters).
_WHOLE_READINGS: weakref.WeakKeyDictionary[Any, dict[str, tuple[tuple[str, str], ...]]] = (
    weakref.WeakKeyDictionary()
)
_WHOLE_READINGS_KEPT = 256


def _readings(model: Model, window: str, *, lead: bool) -> tuple[str, ...]:
    """The whitespace runs that keep the window's count, written before it (`lead`) or after."""
    cache = _WINDOW_READINGS.setdefault(model.tokenizer, {})
    key = (window, lead)
    if key not in cache:
        count = model.tokenizer.encode_ordinary
        base = len(count(window))
        if lead:
            cache[key] = tuple(w for w in _EDGE_LEADS if len(count(w + window)) == base)
        else:
            cache[key] = tuple(w for w in _EDGE_TRAILS if len(count(window + w)) == base)
    return cache[key]


def undo_serving(
    model: Model,
    profile: ServingProfile,
    answer: AnswerFields,
    issues: list[str],
) -> AnswerFields:
    """Undo what the declared profile makes invertible; flag what it cannot prove."""
    out = model.format.output
    if out.reasoning is None:
        return answer
    reasoning, content, source = answer.reasoning, answer.content, answer.reasoning_source
    calls = [dict(c) for c in answer.tool_calls] if answer.tool_calls else []
    truncated = answer.finish_reason in LENGTH_REASONS
    if source is None and out.think_end and out.think_end in content:
        reasoning, content = content.split(out.think_end, 1)
        source = "content"
        issues.append(Code.REASONING_FROM_CONTENT)
    opening = model.format.prompt.generation_open
    if opening is not None and reasoning.startswith(opening.source):
        # The generation prompt's end (`<think>`) as text: a stack that left it to the model
        # with no parser to take it out, or one that echoes the prompt's. Read as the marker;
        # both bills say whose it is (prove_prompt moves it to the output where the model's).
        reasoning = reasoning[len(opening.source) :]
        issues.append(THINK_OPEN_AS_TEXT)
    elif (
        opening is not None
        and source is None
        and truncated
        and not calls
        and content.startswith(opening.source)
    ):
        # The same, cut inside the reasoning: all of it is in the content (output_pieces).
        content = content[len(opening.source) :]
        issues.append(THINK_OPEN_AS_TEXT)
    spaced_ids = bool(calls) and any(
        (isinstance(c.get("id"), str) and c["id"].startswith(" "))
        or str((c.get("function") or {}).get("arguments") or "").startswith(" ")
        for c in calls
    )
    if profile.marker_spacing in ("spaces", "leading"):
        # `leading`: only the space after each marker arrives (the one before a marker is
        # dropped with the marker's own streaming delta).
        trailing = profile.marker_spacing == "spaces"
        changed = mismatch = False
        closed = bool(content or calls) or not truncated
        if source is not None:
            if reasoning.startswith(" "):
                reasoning, changed = reasoning[1:], True
            elif reasoning:
                mismatch = True
            if trailing and closed and reasoning:
                if reasoning.endswith(" "):
                    reasoning, changed = reasoning[:-1], True
                elif profile.reasoning_tail == "kept":
                    mismatch = True
        if content.startswith(" "):
            content, changed = content[1:], True
        elif content:
            mismatch = True
        if trailing and calls and content:
            if content.endswith(" "):
                content, changed = content[:-1], True
            else:
                mismatch = True
        for call in calls:
            if isinstance(call.get("id"), str) and call["id"] != call["id"].strip(" "):
                call["id"], changed = call["id"].strip(" "), True
            # Streaming parsers pass the argument text on raw, with the marker spaces.
            function = call.get("function")
            arguments = function.get("arguments") if isinstance(function, Mapping) else None
            if (
                trailing
                and isinstance(arguments, str)
                and arguments[:1] == " "
                and arguments[-1:] == " "
            ):
                call["function"] = {**function, "arguments": arguments[1:-1]}  # type: ignore[dict-item]
                changed = True
        if changed:
            issues.append(Code.MARKER_SPACES_REMOVED)
        if mismatch:
            issues.append(Code.MARKER_SPACING_MISMATCH)
    elif (
        profile.marker_spacing == UNKNOWN
        and out.marker_spacing_risk
        and (
            (source is not None and reasoning.startswith(" "))
            or content.startswith(" ")
            or spaced_ids
        )
    ):
        issues.append(Code.LEADING_SPACE_AFTER_MARKER)
    # Marker-delimited arguments (json_verbatim): any whitespace may have moved; elsewhere a
    # space (the content's own separator before the calls is the format's).
    verbatim_section = out.arguments == "json_verbatim"
    if calls and (content[-1:].isspace() if verbatim_section else content.endswith(" ")):
        # A streaming parser can move an argument's leading space, or the whitespace after the
        # section's begin marker, into the content (SGLang 0.5.14 and 0.5.23): ' {"' and '{"'
        # are one token each, so the billed length does not see it.
        issues.append(Code.SPACE_BEFORE_TOOL_SECTION)
    if (
        calls
        and out.arguments == "json_verbatim"
        and profile.argument_edges != "kept"
        and any(_edges_ambiguous(model, c) for c in calls)
    ):
        issues.append(Code.TOOL_ARGUMENTS_EDGES_UNVERIFIABLE)
    # Reasoning only: the model ended inside its reasoning, or a detokenizer dropped the
    # think-end and the reply is in the reasoning (same length). Only a stack that keeps the
    # marker lets the billed length decide (reconstruct).
    reasoning_only = reasoning and not content and not calls and not truncated
    if reasoning_only and out.think_end and profile.think_end != "kept":
        issues.append(Code.REASONING_WITHOUT_THINK_END)
    closed = bool(content or calls) or not truncated
    # Unknown stacks may strip it too (vLLM 0.33 does): flagged unless a profile says "kept".
    tail_unproven = profile.reasoning_tail in ("stripped", UNKNOWN)
    if tail_unproven and reasoning and closed and _ends_mergeable(reasoning):
        issues.append(Code.REASONING_TAIL_UNVERIFIABLE)
    if (
        reasoning is answer.reasoning
        and content is answer.content
        and source == answer.reasoning_source
        and answer.tool_calls == calls == []
    ):
        return answer  # nothing undone and no calls to copy: equal to the answer rebuilt
    # Built directly: dataclasses.replace re-reads the fields' metadata on every call.
    return AnswerFields(
        reasoning=reasoning,
        reasoning_source=source,
        content=content,
        tool_calls=calls,
        finish_reason=answer.finish_reason,
        error=answer.error,
    )


def _calls_in_history(messages: Sequence[Mapping[str, Any]]) -> int:
    count = 0
    for m in messages:
        if isinstance(m, (dict, Mapping)) and m.get("role") == "assistant":
            count += len(m.get("tool_calls") or [])
    return count


def _usage_int(response: Any, key: str) -> int | None:
    usage = response.get("usage") if isinstance(response, (dict, Mapping)) else None
    if usage is None:
        return None
    value = usage.get(key) if isinstance(usage, (dict, Mapping)) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def reconstruct(
    model: Model,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    response: Any,
    *,
    billing_tolerance: int = 0,
    serving: ServingProfile | None = None,
    prompt: Sequence[int] | PromptReadings | None = None,
) -> Reconstruction:
    """Prompt ids, output ids, loss mask and issue codes for one sample. Never raises on
    bad data: a bad sample comes back with `ok: false` and its issue codes. `serving`: what
    the provider's stack does to text (default: unknown, every ambiguity flagged). `prompt`:
    the prompt's readings (or ids) when already rendered."""
    profile = serving or UNKNOWN_PROFILE
    issues: list[str] = []
    detail: dict[str, Any] = {}
    readings: PromptReadings | None
    if isinstance(prompt, PromptReadings):  # candidate options of one answer share them
        readings = prompt
    elif prompt is not None:
        readings = PromptReadings((PromptReading("given", list(prompt)),))
    else:
        try:
            readings = prompt_readings(model, messages, tools, profile)
        except (PromptError, AttributeError, TypeError, KeyError) as exc:
            readings = None
            issues.append(Code.BAD_PROMPT)
            detail = {"prompt_error": str(exc)}
    prompt_seen: list[int] = readings.template.ids if readings is not None else []
    if _other_model(model, response):
        issues.append(OTHER_MODEL)

    answer = answer_fields(response)
    reported = _usage_int(response, "completion_tokens")
    output: list[int] = []
    ended = False
    if answer is None:
        issues.append(Code.PROVIDER_ERROR if _is_error(response) else Code.MALFORMED_RESPONSE)
    else:
        if answer.error or answer.finish_reason == "error":
            issues.append(Code.PROVIDER_ERROR)
        if answer.finish_reason in LENGTH_REASONS:
            issues.append(Code.TRUNCATED)
            # A cut inside a multi-byte character reaches us as U+FFFD: the last id cannot be
            # recovered from text, and the length check cannot see it.
            if (answer.content or answer.reasoning).endswith("\ufffd"):
                issues.append(Code.PARTIAL_CHARACTER)
        try:
            offset = (
                _calls_in_history(messages)
                if model.format.output.tool_call_index == "conversation"
                else 0
            )
            answer = undo_serving(model, profile, answer, issues)
            pieces, ended = output_pieces(model, answer, issues, offset, profile, tools)
            output = model.encode(pieces)
            if reported is not None and abs(reported - len(output)) > billing_tolerance:
                # Marker names in the reasoning: the markers' ids where only they fit the bill
                # (a marker is one id, its name as characters several).
                marked, marked_ended = output_pieces(
                    model, answer, [], offset, profile, tools, reasoning_markers=True
                )
                as_ids = model.encode(marked)
                if as_ids != output and abs(reported - len(as_ids)) <= billing_tolerance:
                    pieces, ended, output = marked, marked_ended, as_ids
                    issues.append(RAW_MARKERS_IN_REASONING)
            lacks_think_end = _may_lack_think_end(model, profile, answer)
            if lacks_think_end and reported is not None:
                # The billed length decides between "...</think><end>" and "...<end>".
                if reported == len(output) - 1 and billing_tolerance == 0:
                    pieces, ended = output_pieces(
                        model, answer, [], offset, profile, tools, think_end=False
                    )
                    output = model.encode(pieces)
                    issues.append(Code.NO_THINK_END)
            elif lacks_think_end:
                issues.append(Code.REASONING_WITHOUT_THINK_END)
        except (AttributeError, TypeError, ValueError) as exc:  # e.g. a tool call not an object
            issues.append(Code.MALFORMED_RESPONSE)
            detail["response_error"] = f"{type(exc).__name__}: {exc}"
            pieces, ended, output = [], False, []
        if not (answer.reasoning or answer.content or answer.tool_calls) and not _truncated(answer):
            issues.append(Code.EMPTY_RESPONSE)
        billed_prompt = _usage_int(response, "prompt_tokens")
        if billed_prompt is None and readings is not None and len(readings.readings) > 1:
            # A stack may have rendered earlier turns its own way, and nothing billed says
            # which: the template's reading is kept for the reader, never called proven.
            issues.append(Code.PROMPT_NOT_BILLED)
        # Without a billed prompt count nothing is weighed: the template's reading stands
        # (prove_prompt's own first answer, without building it).
        if billed_prompt is not None and readings is not None and prompt_seen and output:
            # The bill proves the prompt and the prompt/output boundary together.
            end = _one_marker_short(model, answer, issues, output, ended)
            proof = prove_prompt(
                readings,
                billed_prompt=billed_prompt,
                billed_completion=reported,
                output_lengths=[len(output)] + ([len(output) - end] if end else []),
                tolerance=billing_tolerance,
            )
            prompt_seen = proof.ids
            issues += proof.issues
            if proof.output_reading and end:
                # One marker fewer than the reading, and the bill cannot say which: the output
                # without its end-of-turn stands for them (core/candidates.py lists each).
                output, ended = output[:-end], False
                issues.append(Code.TOOL_TURN_MARKER_MISSING)
            if proof.moved_to_output:
                # The model wrote the generation prompt's end: the output starts with it.
                output = proof.moved_to_output + output
            if proof.reading != readings.template.name:
                detail["prompt_reading"] = proof.reading
        if reported is None:
            issues.append(Code.NO_USAGE)
        elif abs(reported - len(output)) > billing_tolerance:
            issues.append(Code.BILLING_MISMATCH)
        elif Code.TOOL_ARGUMENTS_MAYBE_COERCED in issues and _types_billed(
            model, answer, tools, billing_tolerance
        ):
            issues.remove(Code.TOOL_ARGUMENTS_MAYBE_COERCED)
            issues.append(TOOL_ARGUMENT_TYPES_BILLED)

    mask_spec = model.format.loss_mask
    # One list of the output's value, the prompt's written over its head: fewer and smaller
    # allocations than joining two lists (this runs for every answer).
    loss_mask = [mask_spec.output] * (len(prompt_seen) + len(output))
    loss_mask[: len(prompt_seen)] = [mask_spec.prompt] * len(prompt_seen)
    if ended and output and mask_spec.end_token != mask_spec.output:
        end_len = len(model.constant_ids(model.format.output.end))
        loss_mask[len(loss_mask) - end_len :] = [mask_spec.end_token] * end_len
    issues = list(dict.fromkeys(issues))  # stable, no duplicates
    return Reconstruction(
        ok=ERRORS.isdisjoint(issues),
        issues=issues,
        # The record's own copy where the readings came from the caller (options share them).
        prompt_ids=list(prompt_seen) if isinstance(prompt, PromptReadings) else prompt_seen,
        output_ids=output,
        loss_mask=loss_mask,
        completion_tokens_reported=reported,
        completion_tokens_reconstructed=len(output),
        details=detail,
        prompt_readings=readings,
    )


def _one_marker_short(
    model: Model, answer: AnswerFields, issues: Sequence[str], output: list[int], ended: bool
) -> int | None:
    """A tool-call turn may lack one marker that no parser needs to read it (AtlasCloud bills
    all four of its recorded tool-call turns one id under the reading, docs/wild.md): the tool
    section written inside the reasoning (no think-end), the end-of-turn never generated after
    the section, a closing tool marker or the `<think>` the model was left not written. Their
    stand-in for the bill: the output without its end-of-turn, whose length this returns (the
    ids are cut only where the bill picks it); weighed only where nothing else in the answer
    can change its length (whitespace-only content may be the stack's own)."""
    if not (answer.tool_calls and ended) or LENGTH_AMBIGUOUS.intersection(issues):
        return None
    end = model.constant_ids(model.format.output.end)
    if not end or len(output) <= len(end) or tuple(output[-len(end) :]) != end:
        return None
    return len(end)


def _other_model(model: Model, response: Any) -> bool:
    """The answer names a model the model config does not declare (`model.served_names`:
    names or shell-style patterns, case-insensitive; a dated variant is the same model)."""
    answered = response.get("model") if isinstance(response, (dict, Mapping)) else None
    if not model.served_names or not isinstance(answered, str) or not answered:
        return False
    return not any(
        fnmatch.fnmatchcase(answered.lower(), name.lower())
        if "*" in name
        else same_model(answered, name)
        for name in model.served_names
    )


def _may_lack_think_end(model: Model, profile: ServingProfile, answer: AnswerFields) -> bool:
    """Reasoning only, ended normally, from a stack that keeps the think-end marker."""
    return (
        profile.think_end == "kept"
        and bool(answer.reasoning)
        and not answer.content
        and not answer.tool_calls
        and not _truncated(answer)
        and model.format.output.think_end is not None
    )


def _truncated(answer: AnswerFields) -> bool:
    return answer.finish_reason in LENGTH_REASONS


def _is_error(response: Any) -> bool:
    return isinstance(response, Mapping) and bool(response.get("error"))
