"""The token record: one JSON object a line, what every stage after reconstruction reads.

Typed as `TypedDict`s, not classes: a record is the very dict that is written to JSONL (same
keys, same order, byte for byte), so the types cost nothing at run time and change nothing
on disk. `TokenIds` is the reconstruct contract (README, "The `reconstruct` contract");
`TokenRecord` adds what the evidence ladder, generate and extraction write beside it. A
record read back from a file is whatever the line holds: `record_problem` says whether it
carries usable ids before a reader trusts them.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class CandidatePoint(TypedDict):
    """One place in an option where a few same-length id spans fit equally (core/candidates.py,
    `ChoicePoint`): `alternatives[0]` is the option's own ids at `at`."""

    at: int
    alternatives: list[list[int]]
    labels: list[str]


class TokenIds(TypedDict):
    """The ids of one answer and how far they are proven (`Reconstruction.to_record`)."""

    ok: bool
    issues: list[str]  # issue codes: errors make `ok` false, notes do not
    prompt_ids: list[int]
    output_ids: list[int]
    loss_mask: list[int]  # over prompt_ids + output_ids
    completion_tokens_reported: int | None  # usage.completion_tokens, or null
    completion_tokens_reconstructed: int


class CandidateOption(TypedDict):
    """One reading of an ambiguous answer (core/candidates.py)."""

    output_ids: list[int]
    loss_mask: list[int]
    label: str
    # Choice points: the option stands for every combination of their alternatives.
    points: NotRequired[list[CandidatePoint]]


class CandidateGap(TypedDict):
    """A reading short of the bill, standing for itself with whitespace put back at its text
    pieces' edges (core/gaps.py): unlisted, bounded by the target (extraction/gap_bounds.py)."""

    output_ids: list[int]
    start: int  # every sequence of the gap has these ids up to here
    open_end: bool  # the answer may go on after the reading's last id
    section_start: int | None  # the tool-call section's opening marker (core/gaps.py)
    label: str


class ProvenAgainst(TypedDict):
    """The profile a closed set (or a one-member proof) was built under, and every behaviour
    of every field it admits (core/serving.admitted_stacks)."""

    profile: str
    stacks: dict[str, list[str]]


class CandidateSet(TypedDict, total=False):
    """The readings an unresolved record may be (core/candidates.py)."""

    closed: bool
    why_open: str | None
    classes: list[str]
    diverge_at: int | None
    options: list[CandidateOption]
    proven_against: ProvenAgainst  # closed sets only
    shared_by_unlisted: int  # open sets whose doubts lie after the reasoning's text only
    # An open set whose every unlisted sequence one of these readings stands for: the target
    # weighs them with the options (extraction/gap_bounds.py).
    gaps: list[CandidateGap]


class TokenRecord(TokenIds, total=False):
    """A stored token record: the contract's keys, then what each writer adds."""

    id: Any  # the sample id (a string); null for a line that could not be read
    # The evidence ladder (core/evidence.py, core/candidates.py).
    # engine_ids | text_proven | target_resolved | prefix_proven | posterior_sampled | unresolved
    evidence: str
    # prefix_proven: {"prefix_tokens", "cut_by", "codes", "of_tokens", "rule"} (core/prefix.py)
    prefix: dict[str, Any]
    # posterior_sampled (drawn, not bought): {"option", "posterior", "posteriors", "options",
    # "seed", "rng_seed", "model", "rule"} (core/posterior.py)
    posterior_sample: dict[str, Any]
    sampling: dict[str, Any] | None
    candidates: CandidateSet
    proven_against: ProvenAgainst  # a one-member closed set: what it was proven against
    # Readings a few ids short of the bill: their longer splits fit it too (the split check).
    short_readings: list[CandidateOption]
    # Readings a few ids over the bill: their shorter splits fit it too.
    long_readings: list[CandidateOption]
    notes: list[str]
    # The engine's own ids (core/logprobs.py).
    id_sources: list[Any]
    logprobs: dict[str, Any]
    # The serving profile generate fitted (serving=auto) and the probe that chose it.
    serving_profile: str | None
    serving_probe: Any
    # Extraction's rewrites (extraction/resolve.py, extraction/split_check.py).
    resolution: dict[str, Any]
    split_check: dict[str, Any]
    prefix_split_check: dict[str, Any]  # a prefix the target did not confirm: its numbers
    # generate's purchase.
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    request: dict[str, Any] | None
    response: dict[str, Any] | None
    usage: dict[str, Any] | None
    cost: float
    provider: str | None
    latency_s: float | None
    attempts: int
    error: dict[str, Any] | None  # {"class", "message", "status"}: no ids, ok false
    reconstruction_error: str


def record_problem(record: Any) -> str | None:
    """Why a record read from a file carries no usable ids (None when it does): not an
    object, no id, no id lists, a loss mask of another length, an id that is no token."""
    if not isinstance(record, dict):
        return "not_an_object"
    if record.get("id") is None:
        return "no_id"
    prompt, output = record.get("prompt_ids"), record.get("output_ids")
    mask = record.get("loss_mask")
    if not isinstance(prompt, list) or not isinstance(output, list) or not isinstance(mask, list):
        return "no_ids"
    if not prompt and not output:
        return "no_ids"
    if len(mask) != len(prompt) + len(output):
        return "loss_mask_length"
    if not all(isinstance(t, int) and t >= 0 for t in prompt + output):
        return "bad_token_id"
    return None
