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
not (`why_open`) and is never resolved as a closed one (an open set whose doubts all lie after
the reasoning's text still proves the ids every reading shares: `shared_by_unlisted`, which
core/prefix.py cuts at). One whose only doubt is whitespace a stack dropped (GAP_DOUBTS) is
listed whole, with its readings short of the bill as `gaps` (core/gaps.py): every sequence
it leaves out is one of them with whitespace put back, so the target can bound them
(extraction/gap_bounds.py). One option in a closed set is a proof: the
record becomes `text_proven` (note `single_candidate`). Two or more are left to the target
model (extraction/resolve.py). Schema: the `candidates` field in docs/design.md.

Argument edges of several calls multiply (two calls of 20 readings each: 400 sequences), so past
MAX_EDGE_READINGS combinations (or where the listed set would hold more options than the target
scores, MAX_LISTED_OPTIONS: one call's edges times a tail's readings) they are not listed: each
option carries one choice point per call instead (`ChoicePoint`: the ids of the call's
arguments between their two markers, and every same-count reading of their edges as an id
span of the same length there). The option then stands for every combination;
extraction/resolve.py weighs them point by point.

Why about 1,100 lines: the enumerations of every ambiguity class build on one another (a tail
and an argument edge in the same answer multiply, and the choice points stand in for their
product), and each is proven against the same stack models (tests/test_closed_sets.py);
apart, the product of two classes would have no home.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kimi_pipe.core.formats import Marker, Piece
from kimi_pipe.core.issue_codes import CLASS_OF_CODE, Code
from kimi_pipe.core.issue_codes import SINGLE_CANDIDATE as SINGLE_CANDIDATE  # tests' name
from kimi_pipe.core.models import Model
from kimi_pipe.core.prompt_proof import PromptReadings
from kimi_pipe.core.reconstruction import (
    ERRORS,
    LENGTH_REASONS,
    AnswerFields,
    Reconstruction,
    answer_fields,
    argument_edge_readings,
    coercion_readings_of,
    output_pieces,
    reconstruct,
    undo_serving,
)
from kimi_pipe.core.serving import UNKNOWN, ServingProfile
from kimi_pipe.core.token_record import (
    CandidateGap,
    CandidateOption,
    CandidatePoint,
    CandidateSet,
)

# Flag code -> ambiguity class this module enumerates (CLASS_OF_CODE, core/issue_codes.py).
ENUMERABLE = frozenset(CLASS_OF_CODE)
# The note a record proven by a one-member closed set carries instead of its flag:
# SINGLE_CANDIDATE (core/issue_codes.py).
# A stripped tail: whitespace after the reasoning's last character. At the same token count
# only carriage returns and newlines can hide (they join a final punctuation's BPE chunk,
# `[^\s\p{L}\p{N}]+[\r\n]*`); any other whitespace starts a chunk of its own (one id more).
TAIL_ALPHABET = ("\n", "\r")
MAX_TAIL_CHARS = 16  # newline runs listed at most (open sets, and the search bound's cap)
MAX_TAIL_NODES = 1024  # search budget; reaching it leaves the set open (never guessed closed)
MAX_EDGE_READINGS = 64  # argument-edge readings of one answer enumerated; more leave it open
MAX_OPEN_OPTIONS = 16  # options an open set lists before the rest are skipped
# Whole options extraction's target scores by default (resolve.max_options): a closed set
# listing more is enumerated again with its arguments' edges as choice points.
MAX_LISTED_OPTIONS = 64
# Gaps a bounded open set keeps at most (extraction runs one forward for each); more leave it
# unbounded.
MAX_GAPS = 256
# Readings kept for the split check miss the bill by at most this many ids: as many as the
# departures its search follows (core/splits.py, `max_departures`).
READING_DISTANCE = 3
NO_OPTION_FITS = "no reading fits the bill at its canonical split"
# Reasons an open set gives whose unlisted readings differ from the listed ones only at or
# after the reasoning's tail: whitespace the stack dropped (the reasoning's tail, a
# whitespace-only content before tool calls, the arguments' edges: tests/
# test_dropped_whitespace.py) and arguments a coercion rewrote. Such a set proves the ids
# before the reasoning's last lone space (`_shared_by_unlisted`, core/prefix.py). Not here:
# billing tolerance, no bill, a whitespace-only reasoning, a search cut short.
TAIL_ONLY_DOUBTS = frozenset(
    {
        "a reading short of the bill: the stack may have dropped whitespace",
        "billing leaves room for stripped whitespace other than newlines",
        "the stack may have stripped other whitespace around the arguments",
        "a coerced value may have had another spelling (a number, boolean or nested value), "
        "or too many to list",
        "too many readings of the coerced arguments to list",
        "billing leaves room for whitespace stripped from the arguments",
    }
)

# Reasons whose unlisted sequences are exactly a short reading with whitespace put back at its
# text pieces' edges (core/gaps.py): such a set lists those readings as gaps, and the target
# bounds what they stand for. The other TAIL_ONLY_DOUBTS leave values or spellings unlisted.
GAP_DOUBTS = frozenset(
    {
        "a reading short of the bill: the stack may have dropped whitespace",
        "billing leaves room for stripped whitespace other than newlines",
        "billing leaves room for whitespace stripped from the arguments",
    }
)


@dataclass(frozen=True)
class Gap:
    """A reading short of the bill, standing for itself with whitespace at its pieces' edges
    (core/gaps.py): each such sequence has the reading's ids up to `start` at least."""

    output_ids: list[int]
    start: int
    open_end: bool
    section_start: int | None  # where its tool-call section opens (core/gaps.py)
    label: str

    def to_record(self) -> CandidateGap:
        return {
            "output_ids": self.output_ids,
            "start": self.start,
            "open_end": self.open_end,
            "section_start": self.section_start,
            "label": self.label,
        }


# Per call, the coercion texts of as many ids as its own that ride on its choice point.
Spellings = list[list[str]]


@dataclass(frozen=True)
class ChoicePoint:
    """Ids `at` .. `at + n` of an option may be any of `alternatives` (each n long, the
    option's own first): the readings of one call's argument edges, factored out of the set."""

    at: int
    alternatives: list[list[int]]
    labels: list[str]

    def to_record(self) -> CandidatePoint:
        return {"at": self.at, "alternatives": self.alternatives, "labels": self.labels}


@dataclass(frozen=True)
class Option:
    output_ids: list[int]
    loss_mask: list[int]
    label: str
    points: list[ChoicePoint] = field(default_factory=list)

    def to_record(self) -> CandidateOption:
        out: CandidateOption = {
            "output_ids": self.output_ids,
            "loss_mask": self.loss_mask,
            "label": self.label,
        }
        if self.points:
            out["points"] = [p.to_record() for p in self.points]
        return out


@dataclass(frozen=True)
class Candidates:
    closed: bool
    why_open: str | None
    classes: list[str]
    diverge_at: int | None
    options: list[Option]
    # Readings whose canonical ids are up to READING_DISTANCE short of the bill: a
    # non-canonical split of one of them (longer) fits the bill as well as the options do;
    # the split check weighs them (`short_readings`).
    short: list[Option] = field(default_factory=list)
    # Readings up to READING_DISTANCE over it: BPE's canonical split is not always the
    # shortest, so a shorter split of one of them fits the bill too (`long_readings`).
    long: list[Option] = field(default_factory=list)
    # An open set whose only doubts lie at or after the reasoning's tail: the leading output
    # ids every reading shares, listed or not (`_shared_by_unlisted`); None otherwise.
    shared_by_unlisted: int | None = None
    # An open set whose only doubts are GAP_DOUBTS, listed whole: the short readings that
    # stand for every unlisted sequence (None: not bounded so).
    gaps: list[Gap] | None = None

    def to_record(self) -> CandidateSet:
        out: CandidateSet = {
            "closed": self.closed,
            "why_open": self.why_open,
            "classes": list(self.classes),
            "diverge_at": self.diverge_at,
            "options": [o.to_record() for o in self.options],
        }
        if self.shared_by_unlisted is not None:
            out["shared_by_unlisted"] = self.shared_by_unlisted
        if self.gaps is not None:
            out["gaps"] = [g.to_record() for g in self.gaps]
        return out

    @property
    def keeps_readings(self) -> bool:
        """The readings are worth the split check's search: the set is closed, or no option
        fits the bill and nothing else leaves it open."""
        return self.closed or (not self.options and self.why_open == NO_OPTION_FITS)

    @property
    def proves(self) -> bool:
        """A closed set of exactly one option and no choice point: the ids are proven."""
        return self.closed and len(self.options) == 1 and not self.options[0].points


def _enough_for_open(why_open: Sequence[str], options: Sequence[Option]) -> bool:
    """An open set is never resolved and keeps no readings: once it is known to be open,
    MAX_OPEN_OPTIONS options show what it holds and the rest are not built. One whose doubts
    are all GAP_DOUBTS is listed whole, up to what the target scores (it may be bounded)."""
    if why_open and not set(why_open) <= GAP_DOUBTS:
        return len(options) >= MAX_OPEN_OPTIONS
    return bool(why_open) and len(options) > MAX_LISTED_OPTIONS


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
    enumerate_with = functools.partial(
        _enumerate, model, messages, tools, response, rec, profile, billing_tolerance
    )
    found = enumerate_with(factor_edges=False)
    if (
        found is not None
        and (found.closed or set((found.why_open or "").split("; ")) <= GAP_DOUBTS)
        and len(found.options) > MAX_LISTED_OPTIONS
        and Code.TOOL_ARGUMENTS_EDGES_UNVERIFIABLE in rec.issues
        and not any(o.points for o in found.options)
    ):
        # More whole sequences than extraction's target scores (resolve.max_options): the
        # arguments' edges as choice points stand for the same sequences in fewer options.
        factored = enumerate_with(factor_edges=True)
        if (
            factored is not None
            and (factored.closed or factored.gaps is not None)
            and len(factored.options) < len(found.options)
        ):
            return factored
    return found


def _enumerate(
    model: Model,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    response: Any,
    rec: Reconstruction,
    profile: ServingProfile,
    billing_tolerance: int,
    *,
    factor_edges: bool,
) -> Candidates | None:
    errors = _errors(rec.issues)
    if not errors or not rec.prompt_ids:
        return None
    answer = answer_fields(response)
    if answer is None:
        return None
    # The readings the bill was weighed against: each option weighs them again with its length.
    prompt: Sequence[int] | PromptReadings = rec.prompt_readings or rec.prompt_ids
    covered = errors & ENUMERABLE
    reported = rec.completion_tokens_reported
    # A letter-ended tail whose stripped newline billing saw: billing_mismatch, one id short.
    tail_billing = (
        Code.BILLING_MISMATCH in errors
        and profile.reasoning_tail in ("stripped", UNKNOWN)
        and reported is not None
        and reported > rec.completion_tokens_reconstructed
    )
    if tail_billing or (covered and Code.BILLING_MISMATCH in errors):
        # Every option is rebuilt and billed on its own: the count decides among them.
        covered = covered | {Code.BILLING_MISMATCH}
    if errors - covered or (not covered - {Code.BILLING_MISMATCH} and not tail_billing):
        return None
    enum_tail = Code.REASONING_TAIL_UNVERIFIABLE in covered or tail_billing
    spacings = (
        ["none", "spaces", "leading"]
        if Code.LEADING_SPACE_AFTER_MARKER in covered
        else [profile.marker_spacing]
    )
    moves = [0, 1, 2] if Code.SPACE_BEFORE_TOOL_SECTION in covered else [0]
    classes = sorted(
        {CLASS_OF_CODE[c] for c in covered if c in CLASS_OF_CODE}
        | ({"reasoning_tail"} if enum_tail else set())
    )

    why_open: list[str] = []
    if Code.SPACE_BEFORE_TOOL_SECTION in covered:
        # Seen in SGLang 0.5.14's corpus: the stack that moves the leading space also strips
        # the arguments' trailing one, and the same count can hide other whitespace there.
        why_open.append("the stack may have stripped other whitespace around the arguments")
    if billing_tolerance:
        why_open.append(f"billing tolerance {billing_tolerance}: billing cannot bound the options")
    enum_edges = Code.TOOL_ARGUMENTS_EDGES_UNVERIFIABLE in covered
    enum_coercion = Code.TOOL_ARGUMENTS_MAYBE_COERCED in covered
    enum_missing = Code.TOOL_TURN_MARKER_MISSING in covered
    # Whitespace a stack drops, which billing saw: a stripped reasoning tail (the profile's
    # say), and with tool calls, under any profile, a whitespace-only content before them and
    # the arguments' trimmed edges (docs/serving_profiles.md: not declared, billing sees it).
    may_drop_whitespace = profile.reasoning_tail in ("stripped", UNKNOWN) or bool(answer.tool_calls)
    if enum_edges and Code.BILLING_MISMATCH in covered:
        # Whitespace that costs ids may have been stripped from the arguments too: only the
        # readings at the same count are listed.
        why_open.append("billing leaves room for whitespace stripped from the arguments")
    options: list[Option] = []
    seen: set[tuple[int, ...]] = set()
    short: dict[tuple[int, ...], Option] = {}
    long: dict[tuple[int, ...], Option] = {}
    # Readings short of the bill by whitespace a stack may have dropped, keyed by their ids:
    # each stands for what the listed readings at the bill do not hold (a `Gap`).
    short_of_bill: dict[tuple[int, ...], tuple[Reconstruction, AnswerFields, str]] = {}
    cut = False  # the listing stopped before its end (`_enough_for_open`)
    for spacing in spacings:
        if _enough_for_open(why_open, options):
            cut = True
            break
        hypothesis = _hypothesis(profile, spacing, enum_tail, enum_coercion)
        scratch: list[str] = []
        undone = undo_serving(model, hypothesis, answer, scratch)
        if Code.MARKER_SPACING_MISMATCH in scratch:
            continue  # a stack that spaces every marker cannot have written this answer
        if enum_tail and answer.reasoning_source is not None and not undone.reasoning.strip():
            # Nothing left to anchor a stripped tail: the whole reasoning may have been
            # whitespace, of any length billing allows.
            why_open.append("the stack may have stripped a whitespace-only reasoning")
        no_spellings: Spellings = [[] for _ in undone.tool_calls]
        coerced_readings: list[tuple[AnswerFields, str, Spellings]] = [(undone, "", no_spellings)]
        if enum_coercion:
            coerced_readings, complete = _coercion_assignments(undone, tools)
            if not complete:
                why_open.append(
                    "a coerced value may have had another spelling (a number, boolean or "
                    "nested value), or too many to list"
                )
        branches: list[tuple[AnswerFields, str, int, EdgeReadings | None, Spellings]] = []
        factored = False  # the edges as choice points of each option, not listed
        for coerced, coercion, _ in coerced_readings:
            edge_sets = _edge_assignments(model, coerced) if enum_edges else [None]
            if edge_sets is None or (factor_edges and enum_edges):
                factored, edge_sets = True, [None]
            branches += [(coerced, coercion, m, e, no_spellings) for m in moves for e in edge_sets]
        if factored or len(branches) > MAX_EDGE_READINGS * len(moves):
            # Coercion readings times edge readings, or edges of several calls: too many to
            # rebuild one by one, so each option carries its calls' edges as choice points,
            # and with them the spellings a coercion leaves at the same count.
            factored = True
            if enum_coercion and enum_edges:
                coerced_readings, _ = _coercion_assignments(undone, tools, merge_with=model)
            branches = [
                (c, label, m, None, spellings)
                for c, label, spellings in coerced_readings
                for m in moves
            ]
            if len(branches) > MAX_EDGE_READINGS * len(moves):
                why_open.append("too many readings of the coerced arguments to list")
                branches = [(undone, "", m, None, no_spellings) for m in moves]
        for coerced, coercion, move, edges, spellings in branches:
            if _enough_for_open(why_open, options):
                cut = True
                break
            moved = _move_space_to_arguments(coerced, trailing=move == 2) if move else coerced
            if moved is None:
                continue
            unedged = moved
            if edges is not None:
                moved = _with_edges(moved, edges)
            base = _build(
                model, messages, tools, response, moved, hypothesis, billing_tolerance, prompt
            )
            short_of_it = (
                reported is not None
                and base.completion_tokens_reconstructed < reported - billing_tolerance
            )
            if may_drop_whitespace and short_of_it:
                # vLLM 0.33 drops a whitespace-only reasoning or content and trims arguments
                # (a coercion rewrites them whole): ids billing saw and the text lost, at any
                # of those places, which the listed readings at the bill do not hold.
                why_open.append(
                    "a reading short of the bill: the stack may have dropped whitespace"
                )
            if short_of_it:
                # A gap (every reading short of the bill: a stripped tail's too) is a whole
                # reading without restored edges (edges are its whitespace): one per spelling
                # that rides on a choice point, too.
                what = _label(spacing if len(spacings) > 1 else None, move, "", None, coercion)
                for spelled, spelling in _spelled(unedged, spellings):
                    plain = (
                        base
                        if edges is None and not spelling
                        else _build(
                            model, messages, tools, response, spelled, hypothesis, 0, prompt
                        )
                    )
                    named = "; ".join(p for p in (spelling, what) if p)
                    short_of_bill.setdefault(tuple(plain.output_ids), (plain, spelled, named))
            near_tails = [""]
            tails = [""]
            rebuild = _TailBuilds(model, messages, tools, response, moved, hypothesis, prompt, base)
            if enum_tail and _closed_reasoning(moved):
                if reported is None:
                    why_open.append("no billed completion_tokens to bound the stripped tail")
                    missing = 1  # list the likeliest tails only, as an open set
                else:
                    missing = reported - base.completion_tokens_reconstructed
                high = missing + billing_tolerance
                if high > 0:
                    # Any whitespace may hide behind extra ids: list newline runs, leave open.
                    why_open.append(
                        "billing leaves room for stripped whitespace other than newlines"
                    )
                    low = missing - billing_tolerance
                    tails = _runs_that_fit(model, moved.reasoning, low, high)
                else:
                    tails, complete = _newline_tails(
                        model, moved.reasoning, missing - billing_tolerance, high
                    )
                    if not complete:
                        why_open.append("the stripped tail's search budget ran out")
                if reported is not None and not billing_tolerance:
                    near_tails = _near_tails(model, moved.reasoning)
            for tail in near_tails:
                # Readings whose canonical ids miss the bill by a few ids: a non-canonical
                # split of one (the split check follows up to as many departures) may fit it.
                rebuilt = rebuild(tail, 0)
                off = rebuilt.completion_tokens_reconstructed - (reported or 0)
                if (
                    reported is not None
                    and _errors(rebuilt.issues) == {Code.BILLING_MISMATCH}
                    and 0 < abs(off) <= READING_DISTANCE
                ):
                    (short if off < 0 else long).setdefault(
                        tuple(rebuilt.output_ids),
                        Option(
                            rebuilt.output_ids,
                            rebuilt.loss_mask,
                            _label(
                                spacing if len(spacings) > 1 else None, move, tail, edges, coercion
                            ),
                        ),
                    )
            for tail in tails:
                rebuilt = rebuild(tail, billing_tolerance)
                if (
                    _errors(rebuilt.issues)
                    - {Code.SPACE_BEFORE_TOOL_SECTION}
                    - ({Code.TOOL_ARGUMENTS_EDGES_UNVERIFIABLE} if enum_edges else set())
                    - ({Code.TOOL_ARGUMENTS_MAYBE_COERCED} if enum_coercion else set())
                    - ({Code.TOOL_TURN_MARKER_MISSING} if enum_missing else set())
                ):
                    continue
                if Code.SPACE_BEFORE_TOOL_SECTION in _errors(rebuilt.issues) and (
                    Code.SPACE_BEFORE_TOOL_SECTION not in covered
                ):
                    continue
                if tuple(rebuilt.output_ids) in seen:
                    continue
                points: list[ChoicePoint] = []
                if factored and enum_edges:
                    found = _edge_points(model, moved, rebuilt.output_ids, spellings)
                    if found is None:
                        why_open.append("an argument's ids could not be told apart in the output")
                    points = found or []
                label = _label(spacing if len(spacings) > 1 else None, move, tail, edges, coercion)
                readings = [(rebuilt.output_ids, rebuilt.loss_mask, label, points)]
                if Code.TOOL_TURN_MARKER_MISSING in rebuilt.issues:
                    readings = _missing_marker_readings(model, moved, rebuilt, label, points)
                for ids, mask, what, at_points in readings:
                    if tuple(ids) not in seen:
                        seen.add(tuple(ids))
                        options.append(Option(ids, mask, what, at_points))
    if not options:
        if why_open or not (short or long):
            return None
        # No reading fits the bill at its canonical split: the engine drew another split of
        # one, or the stack changed the text beyond the profile. Nothing for the target to
        # choose among; the split check may search the readings (resolve.billing_splits).
        return Candidates(
            closed=False,
            why_open=NO_OPTION_FITS,
            classes=classes,
            diverge_at=None,
            options=[],
            short=list(short.values()),
            long=list(long.values()),
        )
    diverge = _diverge_at([o.output_ids for o in options])
    starts = [p.at for o in options for p in o.points]
    if starts:
        # Nothing at or after a choice point is shared by every reading.
        diverge = min(starts) if diverge is None else min(diverge, *starts)
    shared = None
    if why_open and set(why_open) <= TAIL_ONLY_DOUBTS:
        hypotheses = [_hypothesis(profile, s, enum_tail, enum_coercion) for s in spacings]
        shared = _shared_by_unlisted(model, answer, hypotheses, tools, prompt, response, options)
    gaps = None
    if why_open and set(why_open) <= GAP_DOUBTS and not cut:
        gaps = _gaps(model, short_of_bill.values(), enum_missing, seen)
    return Candidates(
        closed=not why_open,
        why_open="; ".join(dict.fromkeys(why_open)) or None,
        classes=classes,
        diverge_at=diverge,
        options=options,
        short=[o for key, o in short.items() if key not in seen],
        long=[o for key, o in long.items() if key not in seen],
        shared_by_unlisted=shared,
        gaps=gaps,
    )


def _gaps(
    model: Model,
    readings: Any,
    enum_missing: bool,
    listed: set[tuple[int, ...]],
) -> list[Gap] | None:
    """The gaps of an open set whose doubts are all GAP_DOUBTS: each reading short of the bill
    (and, where the turn may be one marker short, each of its missing-marker readings), with
    the ids before its reasoning's last lone space as its start; None where one has no start
    proven so (its sequences may then differ anywhere: the set stays unbounded), or where
    there are more than MAX_GAPS."""
    end = list(model.constant_ids(model.format.output.end))
    kind, name = (model.format.output.tool_calls.parts or [("", "")])[0]
    opening = model.markers.get(name) if kind == "marker" else None
    gaps: dict[tuple[int, ...], Gap] = {}
    heads: dict[str, list[int] | None] = {}  # most gaps share their reasoning's text
    for rebuilt, answer, label in readings:
        variants = [(rebuilt.output_ids, label)]
        if enum_missing and answer.tool_calls and rebuilt.output_ids[-len(end) :] == end:
            cut_end = replace(
                rebuilt,
                output_ids=rebuilt.output_ids[: -len(end)],
                loss_mask=rebuilt.loss_mask[: -len(end)],
            )
            variants += [
                (ids, what)
                for ids, _, what, _ in _missing_marker_readings(model, answer, cut_end, label, [])
            ]
        for ids, what in variants:
            if tuple(ids) in listed or tuple(ids) in gaps:
                continue
            start = _gap_start(model, ids, heads)
            if start is None:
                return None
            open_end = not end or list(ids[-len(end) :]) != end
            section = _index(ids, opening, last=False)
            gaps[tuple(ids)] = Gap(list(ids), start, open_end, section, what)
            if len(gaps) > MAX_GAPS:
                return None
    return list(gaps.values())


def _gap_start(model: Model, ids: Sequence[int], heads: dict[str, list[int] | None]) -> int | None:
    """How many leading ids every sequence a short reading stands for shares with it: its
    markers before the first text, and that text's ids before its last lone space
    (`_head_of_text`, kept in `heads` by text). None where that is not shown."""
    markers = set(model.markers.values())
    first = next((i for i, t in enumerate(ids) if t not in markers), None)
    if first is None:
        return None
    stop = next((i for i in range(first, len(ids)) if ids[i] in markers), len(ids))
    text = model.tokenizer.decode(ids[first:stop])
    if text not in heads:
        heads[text] = _head_of_text(model, text, text)
    head = heads[text]
    if head is None or list(ids[first : first + len(head)]) != head:
        return None
    return first + len(head)


def _hypothesis(
    profile: ServingProfile, spacing: str, enum_tail: bool, enum_coercion: bool
) -> ServingProfile:
    """The profile one marker-spacing hypothesis rebuilds its readings under."""
    return replace(
        profile,
        marker_spacing=spacing,
        reasoning_tail="stripped" if enum_tail else profile.reasoning_tail,
        # Each coercion reading is rebuilt as the model's own text.
        argument_types="verbatim" if enum_coercion else profile.argument_types,
    )


def _shared_by_unlisted(
    model: Model,
    answer: AnswerFields,
    hypotheses: Sequence[ServingProfile],
    tools: Sequence[Mapping[str, Any]] | None,
    prompt: Sequence[int] | PromptReadings,
    response: Any,
    options: Sequence[Option],
) -> int | None:
    """How many leading output ids every reading of an open set shares, listed or not, when
    its only doubts lie at or after the reasoning's tail (TAIL_ONLY_DOUBTS); None when
    nothing is proven so. Every marker-spacing hypothesis counts (the enumeration stops
    listing once an open set has MAX_OPEN_OPTIONS options, so its `diverge_at` may not).

    Whitespace a stack dropped or a coercion rewrote sits after the reasoning's text (its
    tail, a whitespace-only content, the arguments); appended to the reasoning it joins at
    most the text after its last lone space: a tokenizer that splits at lone spaces
    (`splits_at_lone_spaces`) encodes the text before one as in the whole, whatever follows.
    Before the reasoning: the ids the bill moved from the prompt (`_output_lead`)."""
    lead = _output_lead(prompt, response)
    if lead is None or not model.tokenizer.splits_at_lone_spaces:
        return None
    first = options[0].output_ids
    bound: int | None = None
    for hypothesis in hypotheses:
        scratch: list[str] = []
        undone = undo_serving(model, hypothesis, answer, scratch)
        if Code.MARKER_SPACING_MISMATCH in scratch:
            continue  # no reading under it (the enumeration skips it too)
        as_text = replace(hypothesis, marker_spacing="none", reasoning_tail="kept")
        text = undo_serving(model, as_text, undone, [])  # as `_build`'s reconstruct does
        pieces, _ = output_pieces(model, text, [], 0, as_text, tools)
        head = _reasoning_head(model, pieces, text.reasoning)
        if head is None:
            return None
        reading = lead + head
        n = 0
        while n < min(len(first), len(reading)) and first[n] == reading[n]:
            n += 1
        bound = n if bound is None else min(bound, n)
    return bound


# Whitespace the proof of `_reasoning_head` is checked against, appended to the reasoning.
_CHECK_SUFFIXES = (" ", "\n", "\n\n", " \n", "\t", "  ", "\r\n", " \t \t")


def _reasoning_head(model: Model, pieces: Sequence[Piece], reasoning: str) -> list[int] | None:
    """The output ids up to the reasoning's last lone space (the markers before it, then its
    text's ids), which any whitespace appended to the reasoning leaves as they are; None
    where that is not shown (`_head_of_text`)."""
    ids: list[int] = []  # the markers before the output's first text
    joined = ""  # that text, up to the next marker
    for piece in pieces:
        if isinstance(piece, Marker):
            if joined:
                break
            ids.append(model.markers[piece.name])
        else:
            joined += piece
    head = _head_of_text(model, joined, reasoning)
    return None if head is None else ids + head


def _head_of_text(model: Model, joined: str, reasoning: str) -> list[int] | None:
    """The ids of `joined` (an output's first text) up to `reasoning`'s last lone space; None
    where that is not shown: no lone space, marker names in the reasoning (read as markers
    where the bill says so), the reasoning not found in the text."""
    core = reasoning.strip()
    if not core or any(name in reasoning for name in model.markers):
        return None
    cut = next(
        (
            i
            for i in range(len(core) - 2, 0, -1)
            if core[i] == " " and not core[i - 1].isspace() and not core[i + 1].isspace()
        ),
        None,
    )
    start = joined.find(core)
    if cut is None or start < 0:
        return None
    encode = model.tokenizer.encode_ordinary
    head = encode(joined[: start + cut])
    # The lone-space split, checked on this text: whole, and with whitespace appended.
    texts = [joined] + [joined[: start + len(core)] + s for s in _CHECK_SUFFIXES]
    if any(encode(t)[: len(head)] != head for t in texts):
        return None
    return head


def _output_lead(prompt: Sequence[int] | PromptReadings, response: Any) -> list[int] | None:
    """The ids every reading's output starts with before its own pieces: the generation
    prompt's end the model wrote itself, where the billed prompt count moves it there
    (core/prompt_proof.prove_prompt, at no tolerance: every reading has the billed length).
    None when the prompt's readings that fit the bill disagree about it."""
    usage = response.get("usage") if isinstance(response, Mapping) else None
    billed = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
    if not isinstance(prompt, PromptReadings) or type(billed) is not int:
        return []  # no proof weighed the boundary: nothing moved
    opening = prompt.generation_open
    shifts = [len(opening)] if prompt.open_in_output else [0] + ([len(opening)] if opening else [])
    fits = {
        shift
        for reading in prompt.readings
        for shift in shifts
        if (not shift or tuple(reading.ids[-shift:]) == opening)
        and len(reading.ids) - shift == billed
    }
    if len(fits) > 1:
        return None
    return list(opening) if fits == {len(opening)} and opening else []


@dataclass
class _TailBuilds:
    """One hypothesis's answer rebuilt with a tail appended to its reasoning; a tail tried as
    a near reading and as an option (same tolerance) is built once. No tail: `base`."""

    model: Model
    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None
    response: Any
    answer: AnswerFields
    hypothesis: ServingProfile
    prompt: Sequence[int] | PromptReadings | None
    base: Reconstruction
    built: dict[tuple[str, int], Reconstruction] = field(default_factory=dict)

    def __call__(self, tail: str, tolerance: int) -> Reconstruction:
        if not tail:
            return self.base
        if (tail, tolerance) not in self.built:
            variant = replace(self.answer, reasoning=self.answer.reasoning + tail)
            self.built[(tail, tolerance)] = _build(
                self.model,
                self.messages,
                self.tools,
                self.response,
                variant,
                self.hypothesis,
                tolerance,
                self.prompt,
            )
        return self.built[(tail, tolerance)]


def _build(
    model: Model,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    response: Any,
    answer: AnswerFields,
    hypothesis: ServingProfile,
    billing_tolerance: int,
    prompt: Sequence[int] | PromptReadings | None = None,
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
        model,
        messages,
        tools,
        plain,
        billing_tolerance=billing_tolerance,
        serving=as_text,
        prompt=prompt,
    )


def _move_space_to_arguments(answer: AnswerFields, trailing: bool = False) -> AnswerFields | None:
    """SGLang 0.5.14 streaming: the first call's leading argument space arrives as the
    content's last character (`trailing`: and the arguments' trailing space was stripped).
    The reverse move, or None when the answer has no such space."""
    if not (answer.tool_calls and answer.content.endswith(" ")):
        return None
    calls = [dict(c) for c in answer.tool_calls]
    function = dict(calls[0].get("function") or {})
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return None
    function["arguments"] = " " + arguments + (" " if trailing else "")
    calls[0]["function"] = function
    return replace(answer, content=answer.content[:-1], tool_calls=calls)


# Keyed by the tokenizer object itself, held weakly: an entry goes with its tokenizer (an
# id() key could be reused by another tokenizer after the first was evicted and collected).
_JOINED_TAILS: weakref.WeakKeyDictionary[Any, tuple[str, ...] | None] = weakref.WeakKeyDictionary()


def _joined_tails(model: Model) -> tuple[str, ...] | None:
    """Every run of carriage returns/newlines that one vocabulary token joins to a character
    before it (Kimi K2.5: 11 runs, the longest `\\r\\n\\r\\n\\r\\n\\r\\n`). A tail that costs no id
    must sit in the token that ends the reasoning's last chunk, so it is one of these. None
    when the tokenizer cannot list its vocabulary (the search then tries every string)."""
    tokenizer = model.tokenizer
    try:
        return _JOINED_TAILS[tokenizer]
    except KeyError:
        pass
    except TypeError:  # a tokenizer that cannot be weakly referenced: listed each time
        return _list_joined_tails(tokenizer)
    tails = _JOINED_TAILS[tokenizer] = _list_joined_tails(tokenizer)
    return tails


def _list_joined_tails(tokenizer: Any) -> tuple[str, ...] | None:
    size = getattr(tokenizer, "vocab_size", None)
    if not isinstance(size, int):
        return None
    runs: set[str] = set()
    for token_id in range(size):
        data = tokenizer.token_bytes(token_id)
        head = data.rstrip(b"\r\n")
        if head and len(head) < len(data) and not head[-1:].isspace():
            runs.add(data[len(head) :].decode("ascii"))
    return tuple(sorted(runs, key=lambda t: (len(t), t)))


def _last_chunk(text: str) -> str:
    """The reasoning's trailing punctuation run (with the space a BPE chunk takes before it):
    the only chunk an appended newline joins. The whole text when it does not end so."""
    i = len(text)
    while i and not text[i - 1].isspace() and not text[i - 1].isalnum():
        i -= 1
    if i == len(text):
        return text
    if i and text[i - 1] == " ":
        i -= 1
    return text[i:]


def _newline_tails(model: Model, reasoning: str, low: int, high: int) -> tuple[list[str], bool]:
    """Every string of carriage returns and newlines that, appended to the reasoning, adds
    between `low` and `high` ids (`high` <= 0: the vocabulary's joined runs, see
    `_joined_tails`; otherwise every string up to MAX_TAIL_CHARS within the node budget);
    also whether the search was complete. Counts come from the last chunk only (BPE chunks are
    encoded apart); each option is rebuilt and billed in full afterwards."""
    chunk = _last_chunk(reasoning)
    base = len(model.encode([chunk]))
    joined = _joined_tails(model) if high <= 0 else None
    found: list[str] = [""] if low <= 0 <= high else []
    if joined is not None:
        for tail in joined:
            if low <= len(model.encode([chunk + tail])) - base <= high:
                found.append(tail)
        return found, True
    level = [""]
    nodes = 0
    for _length in range(MAX_TAIL_CHARS):
        level = [t + c for t in level for c in TAIL_ALPHABET]
        for tail in level:
            nodes += 1
            if nodes > MAX_TAIL_NODES:
                return found, False
            if low <= len(model.encode([chunk + tail])) - base <= high:
                found.append(tail)
    return found, True


def _near_tails(model: Model, reasoning: str) -> list[str]:
    """The tails whose readings the split check weighs beside the options: none, every run the
    vocabulary joins to a character (`_joined_tails`) and every newline run up to
    MAX_TAIL_CHARS. Each costs a rebuild, so not every string of the tail alphabet."""
    runs = [""] + ["\n" * n for n in range(1, MAX_TAIL_CHARS + 1)]
    return list(dict.fromkeys(runs + list(_joined_tails(model) or ())))


def _runs_that_fit(model: Model, reasoning: str, low: int, high: int) -> list[str]:
    """Newline runs ("\n" ... "\n" * MAX_TAIL_CHARS) that add between `low` and `high` ids."""
    base = len(model.encode([reasoning]))
    fits = []
    for n in range(0, MAX_TAIL_CHARS + 1):
        added = len(model.encode([reasoning + "\n" * n])) - base
        if low <= added <= high:
            fits.append("\n" * n)
    return fits


EdgeReadings = tuple[tuple[str, str], ...]


def _edge_assignments(model: Model, answer: AnswerFields) -> list[EdgeReadings] | None:
    """Every combination of the calls' argument-edge readings (one (leading, trailing) pair per
    call), or None when there are more than MAX_EDGE_READINGS."""
    per_call = [argument_edge_readings(model, c) for c in answer.tool_calls]
    total = 1
    for readings in per_call:
        total *= len(readings)
    if total > MAX_EDGE_READINGS:
        return None
    return [tuple(combo) for combo in itertools.product(*per_call)]


def _edge_points(
    model: Model,
    answer: AnswerFields,
    output_ids: Sequence[int],
    spellings: Spellings | None = None,
) -> list[ChoicePoint] | None:
    """One choice point per call whose argument edges have several same-count readings (or
    whose `spellings` hold other texts of its count): where its arguments' ids stand alone
    between two markers (encoded on their own there, so any reading's ids can replace them),
    every reading's ids, of each spelling. None when a call's arguments are not found that
    way, or a reading's ids differ in length (never a guessed position)."""
    encode = model.tokenizer.encode_ordinary
    markers = set(model.markers.values())
    points: list[ChoicePoint] = []
    cursor = 0
    for n, call in enumerate(answer.tool_calls):
        texts: list[str | None] = [None]
        if spellings and n < len(spellings) and spellings[n]:
            texts = list(spellings[n])
        per_text = []
        for text in texts:
            spelled = call if text is None else _with_arguments(call, text)
            per_text.append((text, argument_edge_readings(model, spelled)))
        if sum(len(readings) for _, readings in per_text) < 2:
            continue
        arguments = call["function"]["arguments"]  # a string: argument_edge_readings said so
        own = encode(arguments)
        at = _isolated_span(output_ids, own, cursor, markers)
        if at is None:
            return None
        alternatives: dict[tuple[int, ...], str] = {}
        for text, readings in per_text:
            spelled_text = arguments if text is None else text
            written = _written(n, text) if text not in (None, arguments) else ""
            for lead, trail in readings:
                ids = tuple(encode(lead + spelled_text + trail))
                if len(ids) != len(own):
                    return None
                edged = (
                    f"call {n} arguments' edges {lead!r} / {trail!r} restored"
                    if lead or trail
                    else ""
                )
                label = "; ".join(p for p in (written, edged) if p)
                alternatives.setdefault(ids, label or "as returned")
        if len(alternatives) > 1:
            points.append(
                ChoicePoint(at, [list(ids) for ids in alternatives], list(alternatives.values()))
            )
        cursor = at + len(own)
    return points


def _spelled(answer: AnswerFields, spellings: Spellings) -> list[tuple[AnswerFields, str]]:
    """The answer with each combination of its calls' spellings (core/coercion.py's texts that
    ride on a choice point), labelled; the answer alone where none is another text."""
    groups = [
        [t for t in group if t != call["function"]["arguments"]]
        for call, group in zip(answer.tool_calls, spellings, strict=False)
    ]
    per_call: list[list[str | None]] = [[None, *group] for group in groups]
    out = []
    for combo in itertools.product(*per_call):
        calls, parts = [], []
        for n, (call, text) in enumerate(zip(answer.tool_calls, combo, strict=False)):
            if text is not None:
                call = _with_arguments(call, text)
                parts.append(_written(n, text))
            calls.append(call)
        calls += list(answer.tool_calls[len(combo) :])
        out.append((replace(answer, tool_calls=calls) if parts else answer, "; ".join(parts)))
    return out


def _isolated_span(
    ids: Sequence[int], span: Sequence[int], start: int, markers: set[int]
) -> int | None:
    """The first index >= start where `span` stands between two markers (or an end)."""
    n = len(span)
    if not n:
        return None
    for at in range(start, len(ids) - n + 1):
        if (
            ids[at : at + n] == list(span)
            and (at == 0 or ids[at - 1] in markers)
            and (at + n == len(ids) or ids[at + n] in markers)
        ):
            return at
    return None


def _coercion_assignments(
    answer: AnswerFields,
    tools: Sequence[Mapping[str, Any]] | None,
    merge_with: Model | None = None,
) -> tuple[list[tuple[AnswerFields, str, Spellings]], bool]:
    """Every combination of the calls' coercion readings (core/coercion.py), each with its
    label and each call's spellings (the text it holds, or with `merge_with` a model: every
    text of as many ids as the returned one, which ride on the call's choice point instead of
    being combinations of their own), and whether the list is complete (every call's readings
    are, and there are at most MAX_EDGE_READINGS combinations)."""
    per_call: list[list[tuple[str | None, str, list[str]]]] = []
    complete = True
    for n, readings in enumerate(coercion_readings_of(answer.tool_calls, tools)):
        if readings is None:
            per_call.append([(None, "", [])])
            continue
        complete = complete and readings.complete
        first, others = readings.texts[0], list(readings.texts[1:])
        group = [first]
        if merge_with is not None:
            count = len(merge_with.tokenizer.encode_ordinary(first))
            group += [t for t in others if len(merge_with.tokenizer.encode_ordinary(t)) == count]
            others = [t for t in others if t not in group]
        listed: list[tuple[str | None, str, list[str]]] = [(first, "", group)]
        listed += [(text, _written(n, text), [text]) for text in others]
        per_call.append(listed)
    total = 1
    for options in per_call:
        total *= len(options)
    if total > MAX_EDGE_READINGS:
        return [(answer, "", [[] for _ in answer.tool_calls])], False
    out = []
    for combo in itertools.product(*per_call):
        calls = []
        for call, (text, _, _) in zip(answer.tool_calls, combo, strict=True):
            calls.append(call if text is None else _with_arguments(call, text))
        label = "; ".join(part for _, part, _ in combo if part)
        out.append((replace(answer, tool_calls=calls), label, [group for _, _, group in combo]))
    return out, complete


def _with_edges(answer: AnswerFields, edges: EdgeReadings) -> AnswerFields:
    calls = []
    for call, (lead, trail) in zip(answer.tool_calls, edges, strict=True):
        function = call.get("function")
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        if isinstance(arguments, str) and (lead or trail):
            call = _with_arguments(call, lead + arguments + trail)
        calls.append(call)
    return replace(answer, tool_calls=calls)


def _with_arguments(call: Mapping[str, Any], text: str) -> Mapping[str, Any]:
    """The call with `text` as its arguments (itself where it has no function object)."""
    function = call.get("function")
    if not isinstance(function, Mapping):
        return call
    return {**call, "function": {**function, "arguments": text}}


def _written(n: int, text: str) -> str:
    """The label of call `n`'s arguments read as the model's `text` (a coercion reading)."""
    return f"call {n} arguments written {text!r}"


def _missing_marker_readings(
    model: Model,
    answer: AnswerFields,
    rebuilt: Reconstruction,
    label: str,
    points: Sequence[ChoicePoint],
) -> list[tuple[list[int], list[int], str, list[ChoicePoint]]]:
    """What a `tool_turn_marker_missing` reading stands for: the turn as the format writes it
    (its end-of-turn back), less one marker that no parser needs to read the answer, each in
    turn (vllm/parser/kimi_k2.py, vLLM 0.34: reasoning is the initial state, so a `<think>`
    never written looks the same; the tool-call section ends the reasoning; a call closes at the
    section's end, and the section at the answer's end). The bill cannot tell them apart; the
    target can. Each with its ids, loss mask, label and choice points moved with the ids."""
    output = model.format.output
    end = list(model.constant_ids(output.end))
    full = [*rebuilt.output_ids, *end]
    head = len(rebuilt.loss_mask) - len(rebuilt.output_ids)  # the prompt's part of the mask
    mask = [*rebuilt.loss_mask, *[model.format.loss_mask.end_token] * len(end)]
    spots: dict[int, tuple[int, str]] = {}  # where -> (how many ids, what is missing)
    opening = model.format.prompt.generation_open
    if opening is not None and Code.THINK_OPEN_BILLED_AS_OUTPUT in rebuilt.issues:
        spots[0] = (len(model.constant_ids(opening)), f"the model wrote no {opening.source}")
    if output.think_end is not None and not answer.content:
        at = _index(full, model.markers.get(output.think_end), last=False)
        if at is not None:
            what = f"tool-call section inside the reasoning (no {output.think_end})"
            spots.setdefault(at, (1, what))
    for template in (output.tool_call, output.tool_calls):
        kind, name = template.parts[-1] if template.parts else ("", "")
        at = _index(full, model.markers.get(name), last=True) if kind == "marker" else None
        if at is not None:
            spots.setdefault(at, (1, f"no {name} written"))
    spots.setdefault(
        len(full) - len(end),
        (len(end), f"generation stopped after the tool-call section (no {output.end.source})"),
    )
    readings = []
    for at, (n, what) in sorted(spots.items()):
        moved = [replace(p, at=p.at - n) if p.at > at else p for p in points]
        readings.append(
            (
                full[:at] + full[at + n :],
                mask[: head + at] + mask[head + at + n :],
                "; ".join(part for part in (what, label if label != "as returned" else "") if part),
                moved,
            )
        )
    return readings


def _index(ids: Sequence[int], token: int | None, *, last: bool) -> int | None:
    """The first (or last) index of `token` in `ids`; None when absent."""
    if token is None or token not in ids:
        return None
    return len(ids) - 1 - list(reversed(ids)).index(token) if last else list(ids).index(token)


def _label(
    spacing: str | None,
    move: int,
    tail: str,
    edges: EdgeReadings | None = None,
    coercion: str = "",
) -> str:
    parts = [coercion] if coercion else []
    if spacing == "spaces":
        parts.append("marker spaces removed (the stack's)")
    elif spacing == "leading":
        parts.append("the space after each marker removed (the stack's)")
    elif spacing == "none":
        parts.append("marker-side spaces kept (the model's)")
    if move:
        parts.append("content's last space moved into the first call's arguments")
    if move == 2:
        parts.append("the arguments' trailing space restored")
    if tail:
        parts.append(f"reasoning tail {tail!r} restored")
    for n, (lead, trail) in enumerate(edges or ()):
        if lead or trail:
            parts.append(f"call {n} arguments' edges {lead!r} / {trail!r} restored")
    return "; ".join(parts) or "as returned"


def _diverge_at(sequences: Sequence[Sequence[int]]) -> int | None:
    if len(sequences) < 2:
        return None
    shortest = min(len(s) for s in sequences)
    for i in range(shortest):
        if len({s[i] for s in sequences}) > 1:
            return i
    return shortest
