"""The proven prefix of a flagged record (the `prefix_proven` rung; pure, no IO).

A record flagged only for an ambiguity its CLOSED candidate set accounts for is one of the
set's readings. Where every reading holds the same ids up to a first differing position,
those ids are proven whichever reading is the truth, and attention is causal: the target's
hidden states over them are the ones it computed. The record keeps its ids as returned; its
`prefix` says how many output ids are proven and why the rest is cut, and `training_ids`
is what readers that build training rows take (ids and loss mask cut there, like a
`truncated` answer: no end-of-turn).

Conservative on purpose (docs/design.md, "Proven prefixes"):
  - an OPEN set is not cut: a reading it does not list may differ anywhere its class touches
    the text, so no prefix is proven. The one exception: a set whose every doubt lies at or
    after the reasoning's tail (core/candidates.TAIL_ONLY_DOUBTS: whitespace a stack dropped
    there, in a whitespace-only content or at the arguments' edges, arguments a coercion
    rewrote) stores `shared_by_unlisted`, the ids every reading shares, listed or not, under
    every marker-spacing hypothesis; the cut is never past it;
  - every listed reading counts: the options and the readings a few ids off the bill
    (`short_readings`, `long_readings`), whose other splits may fit the bill;
  - any code the set does not account for (an answer check, a partial character, an
    unknown code) keeps the record unresolved whole;
  - a prefix of no id, or with no loss token, is not a prefix worth keeping.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kimi_pipe.core.candidates import TAIL_ONLY_DOUBTS
from kimi_pipe.core.evidence import (
    DEFAULT_ACCEPT,
    NEVER_USABLE,
    POSTERIOR_SAMPLED,
    PREFIX_PROVEN,
    UNRESOLVED,
    evidence_of,
    has_prefix,
    taken_whole,
)
from kimi_pipe.core.issue_codes import CLASS_OF_CODE, TARGET_UNRESOLVED
from kimi_pipe.core.resolvability import blocking_issues, covered_codes
from kimi_pipe.core.token_record import TokenRecord

# TARGET_UNRESOLVED: the target's scoring left the set unresolved, a verdict on the set, not
# another ambiguity.
RULE = "closed set: ids every listed reading shares"
OPEN_RULE = "open set, doubts only after the reasoning's text: ids every reading shares"


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and t >= 0 for t in value):
        return value
    return None


def _readings(record: Mapping[str, Any]) -> list[list[int]] | None:
    """Every listed reading's output ids (None: one is malformed)."""
    cands = record.get("candidates") or {}
    out: list[list[int]] = []
    for key, group in (
        ("options", cands.get("options")),
        ("short", record.get("short_readings")),
        ("long", record.get("long_readings")),
    ):
        if group is None and key != "options":
            continue
        if not isinstance(group, list):
            return None
        for option in group:
            ids = _ids(option.get("output_ids")) if isinstance(option, Mapping) else None
            if ids is None:
                return None
            out.append(ids)
    return out


def common_length(sequences: Sequence[Sequence[int]]) -> int:
    """How many leading ids every sequence shares."""
    if not sequences:
        return 0
    n = 0
    for column in zip(*sequences, strict=False):
        if len(set(column)) > 1:
            break
        n += 1
    return n


def _option_mask(option: Mapping[str, Any], prompt_len: int) -> list[int] | None:
    """An option's loss mask over its output ids (options store output-only or full masks)."""
    mask, ids = option.get("loss_mask"), option.get("output_ids") or []
    if not isinstance(mask, list):
        return None
    if len(mask) == len(ids):
        return list(mask)
    if len(mask) == prompt_len + len(ids):
        return list(mask[prompt_len:])
    return None


def proven_prefix(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The record's `prefix` field ({"prefix_tokens", "cut_by", "codes", "of_tokens",
    "rule"}), or None when no prefix is proven (module docstring)."""
    if record.get("error") or record.get("ok"):
        return None
    cands = record.get("candidates")
    if not isinstance(cands, Mapping):
        return None
    unlisted = _shared_by_unlisted(cands)
    if cands.get("closed") is not True and unlisted is None:
        return None  # an open set proves no prefix (but for the exception above)
    options = cands.get("options")
    if not isinstance(options, list) or len(options) < 2:
        return None
    issues = [str(c) for c in record.get("issues") or []]
    if NEVER_USABLE & set(issues):
        return None
    covered = covered_codes(cands)
    if blocking_issues(issues) - covered - {TARGET_UNRESOLVED}:
        return None
    readings = _readings(record)
    if readings is None:
        return None
    k = common_length(readings)
    diverge = cands.get("diverge_at")
    if isinstance(diverge, int) and diverge >= 0:
        k = min(k, diverge)
    if unlisted is not None:
        k = min(k, unlisted)
    prompt_len = len(record.get("prompt_ids") or [])
    mask = _option_mask(options[0], prompt_len)
    if k <= 0 or mask is None or not any(mask[:k]):
        return None
    codes = [c for c in dict.fromkeys(issues) if c in covered and c in CLASS_OF_CODE]
    codes = codes or sorted(covered)
    reported = record.get("completion_tokens_reported")
    return {
        "prefix_tokens": k,
        # The ambiguity the cut is for; several classes in one set: `codes` names them all
        # (the options do not say which of them differs first).
        "cut_by": codes[0] if len(codes) == 1 else codes,
        "codes": codes,
        "of_tokens": reported if isinstance(reported, int) else None,
        "rule": RULE if unlisted is None else OPEN_RULE,
    }


def _shared_by_unlisted(cands: Mapping[str, Any]) -> int | None:
    """An open set's `shared_by_unlisted`, where every reason it gives is one that
    core/candidates.py proves it for (checked again here: a stored record is input)."""
    if cands.get("closed") is not False:
        return None
    shared, why = cands.get("shared_by_unlisted"), cands.get("why_open")
    if type(shared) is not int or shared < 0 or not isinstance(why, str):
        return None
    reasons = {part.strip() for part in why.split(";")}
    return shared if reasons <= TAIL_ONLY_DOUBTS else None


def with_prefix(record: TokenRecord) -> TokenRecord:
    """The record with its rung between `prefix_proven` and `unresolved` decided again: a
    `prefix` where one is proven, none (and `unresolved`) where not. Records of other rungs
    are returned as they are (a posterior_sampled one keeps the prefix it was drawn with)."""
    if record.get("evidence") == POSTERIOR_SAMPLED:
        return record
    if record.get("ok") or record.get("evidence") not in (PREFIX_PROVEN, UNRESOLVED, None):
        record.pop("prefix", None)
        return record
    prefix = proven_prefix(record)
    if prefix is None:
        record.pop("prefix", None)
        record["evidence"] = UNRESOLVED
    else:
        record["prefix"] = prefix
        record["evidence"] = PREFIX_PROVEN
    return record


def training_ids(
    record: Mapping[str, Any], accept: Sequence[str] = DEFAULT_ACCEPT
) -> tuple[list[int], list[int]]:
    """What reaches training from a record: (prompt + output ids, loss mask), cut at its
    proven prefix when it is `prefix_proven`, or `posterior_sampled` under a policy that does
    not name that rung (checked again against its readings: a prefix the readings do not
    share raises ValueError rather than reach a file)."""
    prompt = list(record.get("prompt_ids") or [])
    if taken_whole(record, accept):
        return prompt + list(record.get("output_ids") or []), list(record.get("loss_mask") or [])
    prefix = record.get("prefix") or {}
    k = prefix.get("prefix_tokens")
    proven = proven_prefix(record)
    if not isinstance(k, int) or proven is None or proven["prefix_tokens"] < k or k <= 0:
        raise ValueError(f"record {record.get('id')!r}: its prefix is not proven by its readings")
    option = record["candidates"]["options"][0]
    mask = _option_mask(option, len(prompt))
    assert mask is not None  # proven_prefix checked it
    prompt_mask = list(record.get("loss_mask") or [])[: len(prompt)]
    return prompt + list(option["output_ids"][:k]), prompt_mask + mask[:k]


def exact_output_tokens(record: Mapping[str, Any]) -> int:
    """Output ids of the record that are exact on its rung (the prefix of a prefix_proven
    record and of a posterior_sampled one that has one, every output id of a proven one,
    none of an unresolved one: drawn ids are never exact)."""
    rung = evidence_of(record)
    if rung == UNRESOLVED or record.get("error") or NEVER_USABLE & set(record.get("issues") or ()):
        return 0
    if rung == POSTERIOR_SAMPLED and not has_prefix(record):
        return 0
    if rung in (PREFIX_PROVEN, POSTERIOR_SAMPLED):
        prefix = record.get("prefix") or {}
        k = prefix.get("prefix_tokens")
        return k if isinstance(k, int) else 0
    return len(record.get("output_ids") or [])
