"""Closed candidate sets for answers the text alone cannot prove (pure: no IO).

Some flags mean "two or more id sequences fit this answer": a stack may have stripped a
newline from the reasoning's tail at the same token count, a space beside a marker may be the
model's or the stack's, a streaming parser may have moved an argument's leading space into the
content. For those, `enumerate_candidates` lists every id sequence consistent with
  - the returned text,
  - every transformation the serving profile allows (an `unknown` field: any of its choices
    in core/serving.CHOICES that the flag concerns), and
  - the billed `completion_tokens` (each option is rebuilt by `reconstruct` and must pass the
    same billing check a proven record passes).
A set is `closed` when the enumeration is complete under those rules; otherwise it says why
not (`why_open`) and must never be resolved. One option in a closed set is a proof: the
record becomes `text_proven` (note `single_candidate`). Two or more are left to the target
model (extraction/resolve.py). Schema: the `candidates` field in docs/design.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kimi_pipe.core.models import Model
from kimi_pipe.core.reconstruction import (
    ERRORS,
    LENGTH_REASONS,
    AnswerFields,
    Reconstruction,
    answer_fields,
    reconstruct,
    undo_serving,
)
from kimi_pipe.core.serving import UNKNOWN, ServingProfile

# Flag code -> ambiguity class this module enumerates.
CLASS_OF_CODE = {
    "reasoning_tail_unverifiable": "reasoning_tail",
    "leading_space_after_marker": "marker_space",
    "space_before_tool_section": "tool_section_space",
}
ENUMERABLE = frozenset(CLASS_OF_CODE)
# The note a record proven by a one-member closed set carries instead of its flag.
SINGLE_CANDIDATE = "single_candidate"
# A stripped tail: whitespace after the reasoning's last character. At the same token count
# only carriage returns and newlines can hide (they join a final punctuation's BPE chunk,
# `[^\s\p{L}\p{N}]+[\r\n]*`); any other whitespace starts a chunk of its own (one id more).
TAIL_ALPHABET = ("\n", "\r")
MAX_TAIL_CHARS = 16  # longer newline runs after punctuation are not one token of any vocab here
MAX_TAIL_NODES = 512  # search budget; reaching it leaves the set open (never guessed closed)


@dataclass(frozen=True)
class Option:
    output_ids: list[int]
    loss_mask: list[int]
    label: str

    def to_record(self) -> dict[str, Any]:
        return {"output_ids": self.output_ids, "loss_mask": self.loss_mask, "label": self.label}


@dataclass(frozen=True)
class Candidates:
    closed: bool
    why_open: str | None
    classes: list[str]
    diverge_at: int | None
    options: list[Option]

    def to_record(self) -> dict[str, Any]:
        return {
            "closed": self.closed,
            "why_open": self.why_open,
            "classes": list(self.classes),
            "diverge_at": self.diverge_at,
            "options": [o.to_record() for o in self.options],
        }

    @property
    def proves(self) -> bool:
        """A closed set of exactly one option: the ids are proven."""
        return self.closed and len(self.options) == 1


def _errors(codes: Sequence[str]) -> set[str]:
    return {c for c in codes if c in ERRORS}


def _closed_reasoning(answer: AnswerFields) -> bool:
    truncated = answer.finish_reason in LENGTH_REASONS
    return bool(answer.reasoning) and (bool(answer.content or answer.tool_calls) or not truncated)


def enumerate_candidates(
    model: Model,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    response: Any,
    rec: Reconstruction,
    *,
    profile: ServingProfile,
    billing_tolerance: int = 0,
) -> Candidates | None:
    """Every id sequence the answer may stand for, or None when its flags are not of a class
    this module enumerates (or nothing fits)."""
    errors = _errors(rec.issues)
    if not errors or not rec.prompt_ids:
        return None
    answer = answer_fields(response)
    if answer is None:
        return None
    covered = errors & ENUMERABLE
    reported = rec.completion_tokens_reported
    # A letter-ended tail whose stripped newline billing saw: billing_mismatch, one id short.
    tail_billing = (
        "billing_mismatch" in errors
        and profile.reasoning_tail in ("stripped", UNKNOWN)
        and reported is not None
        and reported > rec.completion_tokens_reconstructed
    )
    if tail_billing:
        covered = covered | {"billing_mismatch"}
    if errors - covered or (not covered - {"billing_mismatch"} and not tail_billing):
        return None
    enum_tail = "reasoning_tail_unverifiable" in covered or tail_billing
    spacings = (
        ["none", "spaces"] if "leading_space_after_marker" in covered else [profile.marker_spacing]
    )
    moves = [False, True] if "space_before_tool_section" in covered else [False]
    classes = sorted(
        {CLASS_OF_CODE[c] for c in covered if c in CLASS_OF_CODE}
        | ({"reasoning_tail"} if enum_tail else set())
    )

    why_open: list[str] = []
    if billing_tolerance:
        why_open.append(f"billing tolerance {billing_tolerance}: billing cannot bound the options")
    options: list[Option] = []
    seen: set[tuple[int, ...]] = set()
    for spacing in spacings:
        hypothesis = replace(
            profile,
            marker_spacing=spacing,
            reasoning_tail="stripped" if enum_tail else profile.reasoning_tail,
        )
        scratch: list[str] = []
        undone = undo_serving(model, hypothesis, answer, scratch)
        if "marker_spacing_mismatch" in scratch:
            continue  # a stack that spaces every marker cannot have written this answer
        for move in moves:
            moved = _move_space_to_arguments(undone) if move else undone
            if moved is None:
                continue
            base = _build(model, messages, tools, response, moved, hypothesis, billing_tolerance)
            tails = [""]
            if enum_tail and _closed_reasoning(moved) and reported is not None:
                missing = reported - base.completion_tokens_reconstructed
                tails, complete = _newline_tails(
                    model, moved.reasoning, missing - billing_tolerance, missing + billing_tolerance
                )
                if not complete:
                    why_open.append("the stripped tail's search budget ran out")
                if missing + billing_tolerance > 0:
                    why_open.append(
                        "billing leaves room for stripped whitespace other than newlines"
                    )
            for tail in tails:
                variant = replace(moved, reasoning=moved.reasoning + tail) if tail else moved
                rebuilt = (
                    base
                    if not tail
                    else _build(
                        model, messages, tools, response, variant, hypothesis, billing_tolerance
                    )
                )
                if _errors(rebuilt.issues) - {"space_before_tool_section"}:
                    continue
                if "space_before_tool_section" in _errors(rebuilt.issues) and (
                    "space_before_tool_section" not in covered
                ):
                    continue
                key = tuple(rebuilt.output_ids)
                if key in seen:
                    continue
                seen.add(key)
                options.append(
                    Option(
                        rebuilt.output_ids,
                        rebuilt.loss_mask,
                        _label(spacing if len(spacings) > 1 else None, move, tail),
                    )
                )
    if not options:
        return None
    return Candidates(
        closed=not why_open,
        why_open="; ".join(dict.fromkeys(why_open)) or None,
        classes=classes,
        diverge_at=_diverge_at([o.output_ids for o in options]),
        options=options,
    )


def _build(
    model: Model,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    response: Any,
    answer: AnswerFields,
    hypothesis: ServingProfile,
    billing_tolerance: int,
) -> Reconstruction:
    """Reconstruct an answer whose serving changes were already undone under `hypothesis`:
    its fields are taken as the model's text (no marker spacing, tail kept)."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.reasoning_source is not None:
        message["reasoning"] = answer.reasoning
    if answer.tool_calls:
        message["tool_calls"] = [dict(c) for c in answer.tool_calls]
    usage = response.get("usage") if isinstance(response, Mapping) else None
    plain = {
        "choices": [{"index": 0, "message": message, "finish_reason": answer.finish_reason}],
        "usage": usage,
    }
    as_text = replace(hypothesis, marker_spacing="none", reasoning_tail="kept")
    return reconstruct(
        model, messages, tools, plain, billing_tolerance=billing_tolerance, serving=as_text
    )


def _move_space_to_arguments(answer: AnswerFields) -> AnswerFields | None:
    """SGLang 0.5.14 streaming: the first call's leading argument space arrives as the
    content's last character. The reverse move, or None when the answer has no such space."""
    if not (answer.tool_calls and answer.content.endswith(" ")):
        return None
    calls = [dict(c) for c in answer.tool_calls]
    function = dict(calls[0].get("function") or {})
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return None
    function["arguments"] = " " + arguments
    calls[0]["function"] = function
    return replace(answer, content=answer.content[:-1], tool_calls=calls)


def _newline_tails(model: Model, reasoning: str, low: int, high: int) -> tuple[list[str], bool]:
    """Strings of carriage returns and newlines that, appended to the reasoning, add between
    `low` and `high` ids; also whether the search was complete. Appending a newline never
    removes an id from a chunk, so a branch that already adds more than `high` is cut."""
    base = len(model.encode([reasoning]))
    found: list[str] = []
    frontier = [""]
    nodes = 0
    while frontier:
        tail = frontier.pop(0)
        nodes += 1
        if nodes > MAX_TAIL_NODES:
            return sorted(found, key=lambda t: (len(t), t)), False
        added = len(model.encode([reasoning + tail])) - base if tail else 0
        if added > high:
            continue
        if added >= low:
            found.append(tail)
        if len(tail) < MAX_TAIL_CHARS:
            frontier += [tail + c for c in TAIL_ALPHABET]
        elif added <= high:
            return sorted(found, key=lambda t: (len(t), t)), False  # longer runs still fit
    return sorted(found, key=lambda t: (len(t), t)), True


def _label(spacing: str | None, move: bool, tail: str) -> str:
    parts = []
    if spacing == "spaces":
        parts.append("marker spaces removed (the stack's)")
    elif spacing == "none":
        parts.append("marker-side spaces kept (the model's)")
    if move:
        parts.append("content's last space moved into the first call's arguments")
    if tail:
        parts.append(f"reasoning tail {tail!r} restored")
    return "; ".join(parts) or "as returned"


def _diverge_at(sequences: Sequence[Sequence[int]]) -> int | None:
    if len(sequences) < 2:
        return None
    shortest = min(len(s) for s in sequences)
    for i in range(shortest):
        if len({s[i] for s in sequences}) > 1:
            return i
    return shortest
