"""Which flagged records extraction's target resolution takes (pure: no IO, no engine).

A record goes to the target when its one ambiguity is a closed candidate set
(core/candidates.py), or an open one bounded by its gaps (core/gaps.py), of at most
`resolve.max_options` options, and nothing else blocks it.
Extraction asks before it scores (extraction/records_pass.py); the report and the yield
benchmarks ask the same question, so what they count as reaching training, and the routing by
exact tokens per dollar built on it, is what extraction will take.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kimi_pipe.core.issue_codes import CLASS_OF_CODE, LOGPROB_NOTES, TARGET_UNRESOLVED, Code
from kimi_pipe.core.issue_codes import RECONSTRUCTION_NOTES as NOTES

# A stripped tail that billing saw shows as billing_mismatch, which the tail's options cover.
_TAIL_CLASSES = frozenset({"reasoning_tail"})


def covered_codes(candidates: Mapping[str, Any]) -> frozenset[str]:
    """Error codes a candidate set accounts for (its classes', core/issue_codes.CLASS_OF_CODE)."""
    classes = set(candidates.get("classes") or [])
    codes = {code for code, cls in CLASS_OF_CODE.items() if cls in classes}
    if classes & _TAIL_CLASSES:
        codes.add(Code.BILLING_MISMATCH)
    return frozenset(codes)


def blocking_issues(codes: Sequence[str]) -> set[str]:
    """The codes that make a record unusable (notes do not; an unknown code does)."""
    return {c for c in codes if c not in NOTES and c not in LOGPROB_NOTES}


def resolvable(record: Mapping[str, Any], *, max_options: int | None = None) -> str | None:
    """Why the record cannot go to the target (None: it can). `max_options`: the most options
    the target scores (resolve.max_options); None: any number."""
    if record.get("ok"):
        return "already_ok"
    cands = record.get("candidates")
    if not isinstance(cands, Mapping):
        return "no_candidates"
    if cands.get("closed") is not True and not gaps_fit(cands.get("gaps")):
        return "open_set"  # unless bounded: its gaps stand for every unlisted sequence
    options = cands.get("options")
    if not isinstance(options, list) or not options:
        return "no_options"
    if len(options) < 2 and not (isinstance(options[0], Mapping) and options[0].get("points")):
        return "no_options"
    if max_options is not None and len(options) > max_options:
        return "too_many_options"
    diverge = cands.get("diverge_at")
    if not isinstance(diverge, int) or diverge < 0:
        return "no_diverge_at"
    for opt in options:
        ids = opt.get("output_ids") if isinstance(opt, Mapping) else None
        mask = opt.get("loss_mask") if isinstance(opt, Mapping) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
            return "bad_option"
        if not isinstance(mask, list) or len(ids) < diverge:
            return "bad_option"
        if len(mask) not in (len(ids), len(record.get("prompt_ids") or []) + len(ids)):
            return "bad_option"
        if opt.get("points") is not None and not points_fit(opt["points"], ids):
            return "bad_option"
    if len({tuple(o["output_ids"]) for o in options}) != len(options):
        return "duplicate_options"
    rest = blocking_issues(record.get("issues") or []) - covered_codes(cands) - {TARGET_UNRESOLVED}
    if rest:
        return "other_issues"  # only a record whose one ambiguity is this set may be resolved
    return None


def gaps_fit(gaps: Any) -> bool:
    """A bounded open set's gaps (core/candidates.Gap) are well formed: each a reading with
    its start inside it."""
    if not isinstance(gaps, list) or not gaps:
        return False
    for gap in gaps:
        ids = gap.get("output_ids") if isinstance(gap, Mapping) else None
        start = gap.get("start") if isinstance(gap, Mapping) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
            return False
        if not isinstance(start, int) or not 0 <= start <= len(ids):
            return False
        if not isinstance(gap.get("open_end"), bool):
            return False
        section = gap.get("section_start")
        if section is not None and not (isinstance(section, int) and 0 <= section < len(ids)):
            return False
    return True


def points_fit(points: Any, ids: Sequence[int]) -> bool:
    """An option's choice points (core/candidates.ChoicePoint) are well formed: in order, apart,
    inside the option, each alternative as long as the span it replaces, the option's own ids
    first, no two alike."""
    if not isinstance(points, list) or not points:
        return False
    end = 0
    for point in points:
        at = point.get("at") if isinstance(point, Mapping) else None
        alternatives = point.get("alternatives") if isinstance(point, Mapping) else None
        if not isinstance(at, int) or at < end or not isinstance(alternatives, list):
            return False
        if not alternatives or not all(
            isinstance(a, list) and all(isinstance(t, int) and t >= 0 for t in a)
            for a in alternatives
        ):
            return False
        n = len(alternatives[0])
        if not n or at + n > len(ids) or any(len(a) != n for a in alternatives):
            return False
        if list(ids[at : at + n]) != alternatives[0]:
            return False
        if len({tuple(a) for a in alternatives}) != len(alternatives):
            return False
        end = at + n
    return True
