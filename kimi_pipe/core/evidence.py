"""The evidence ladder: how strongly a token record's ids are proven (pure, no IO).

Every record carries `evidence`, one rung of:
  engine_ids       the engine's own tokens (whole-output logprobs, confirmed against text+billing)
  text_proven      text + serving profile + billed completion_tokens prove the ids
  target_resolved  chosen among a closed candidate set by the target model (extraction)
  prefix_proven    flagged, but every reading of its closed candidate set shares the ids up
                   to a first differing position: that prefix is proven and only it is used
                   (`prefix` says where and why it was cut; core/prefix.py)
  posterior_sampled  NOT exact, opt-in (`resolve.posterior_sampled`): the target left the
                   closed set unresolved and one option was DRAWN from its posterior under
                   the request's sampling (`posterior_sample` says which, at what posterior,
                   with which seed; core/posterior.py). Its ids are a sample of what the
                   target would answer, not the ones bought; it keeps its issues.
  unresolved       flagged; `issues` says why
`ok` keeps its meaning: `ok` is true exactly when the rung is engine_ids or text_proven (or
target_resolved after extraction rewrote the record); never for posterior_sampled. Which
rungs reach training files is a policy (`export.accept`, `extract.accept`), by default the
three proven ones and the proven prefixes (a cut answer, as a `truncated` one is); a
posterior_sampled record is taken whole only where the policy names it, and otherwise
counts as its proven prefix where it has one (that part is exact) and is left out where not.
Schema: LADDER section of docs/design.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kimi_pipe.core.issue_codes import (  # the rungs' names: one home for every code
    ENGINE_IDS,
    NEVER_USABLE,
    POSTERIOR_SAMPLED,
    PREFIX_PROVEN,
    TARGET_RESOLVED,
    TEXT_PROVEN,
    TRUNCATED,
    UNRESOLVED,
)

LADDER = (  # strongest first
    ENGINE_IDS,
    TEXT_PROVEN,
    TARGET_RESOLVED,
    PREFIX_PROVEN,
    POSTERIOR_SAMPLED,
    UNRESOLVED,
)
# The rungs whose ids are the ones bought (all or a proven prefix); never posterior_sampled.
EXACT_RUNGS: tuple[str, ...] = (ENGINE_IDS, TEXT_PROVEN, TARGET_RESOLVED, PREFIX_PROVEN)
DEFAULT_ACCEPT: tuple[str, ...] = EXACT_RUNGS

# A note (not an error) that a rung keeps: the answer was cut by max_tokens, its ids proven.
CUT_NOTE = TRUNCATED
# Codes that keep a record out of training files whatever the policy (NEVER_USABLE, above).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")


def evidence_of(record: Mapping[str, Any]) -> str:
    """The record's rung: its `evidence` field, else derived from `ok` and its id sources
    (records written before the ladder existed)."""
    rung = record.get("evidence")
    if isinstance(rung, str) and rung in LADDER:
        return rung
    if not record.get("ok"):
        return UNRESOLVED
    return ENGINE_IDS if whole_engine_ids(record) else TEXT_PROVEN


def whole_engine_ids(record: Mapping[str, Any]) -> bool:
    """Logprobs covered the whole output and agreed with the text (ids confirmed or the
    engine's own split kept)."""
    logprobs = record.get("logprobs")
    if not isinstance(logprobs, Mapping) or logprobs.get("coverage") != "whole":
        return False
    if "mismatch" in logprobs or "invalid" in logprobs:
        return False
    sources = record.get("id_sources") or []
    return any(
        isinstance(s, Sequence) and len(s) == 3 and s[2] in ("confirmed", "engine") for s in sources
    )


def parse_accept(value: Any, key: str = "export.accept") -> tuple[str, ...]:
    """A config's list of accepted rungs, checked; None/empty means the default."""
    if value is None:
        return DEFAULT_ACCEPT
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        return DEFAULT_ACCEPT
    bad = [str(v) for v in items if v not in LADDER]
    if bad:
        raise ValueError(f"{key}: unknown rung(s) {bad}; expected some of {list(LADDER)}")
    return tuple(str(v) for v in items)


def usable(record: Mapping[str, Any], accept: Iterable[str] = DEFAULT_ACCEPT) -> bool:
    """Whether a record's ids may reach training files under the policy `accept`. A record
    whose last id is unrecoverable (`partial_character`) never does."""
    if record.get("error") or not record.get("output_ids"):
        return False
    if NEVER_USABLE & set(record.get("issues") or ()):
        return False
    rung = evidence_of(record)
    if rung in set(accept):
        return True
    # A drawn record the policy does not take whole: its proven prefix, if any, is exact.
    return rung == POSTERIOR_SAMPLED and PREFIX_PROVEN in set(accept) and has_prefix(record)


def has_prefix(record: Mapping[str, Any]) -> bool:
    """The record carries a proven prefix (core/prefix.py checks it against its readings)."""
    prefix = record.get("prefix")
    return isinstance(prefix, Mapping) and isinstance(prefix.get("prefix_tokens"), int)


def taken_whole(record: Mapping[str, Any], accept: Iterable[str]) -> bool:
    """Whether a usable record reaches training whole under `accept` (else: its prefix)."""
    rung = evidence_of(record)
    return rung != PREFIX_PROVEN and (rung != POSTERIOR_SAMPLED or rung in set(accept))


def sampling_of(request: Any) -> dict[str, Any]:
    """What the request actually sent for sampling (None: the provider's default). Reads the
    stored `request` ({"params": {...}}) or a flat params mapping."""
    params: Any = request
    if isinstance(request, Mapping) and isinstance(request.get("params"), Mapping):
        params = request["params"]
    if not isinstance(params, Mapping):
        params = {}
    out = {"temperature": params.get("temperature"), "top_p": params.get("top_p")}
    for key in SAMPLING_KEYS[2:]:
        if params.get(key) is not None:
            out[key] = params[key]
    return out


def ladder_counts(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Records per rung (answered records only), in ladder order."""
    counts = dict.fromkeys(LADDER, 0)
    for record in records:
        if record.get("error"):
            continue
        counts[evidence_of(record)] += 1
    return counts
