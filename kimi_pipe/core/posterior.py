"""The posterior rung (`posterior_sampled`; pure, no IO): one option DRAWN, not proven.

Target resolution scores every option of a record's closed candidate set under the
request's own sampling (extraction/resolve.py: `decide` over `sampled_logprobs`). Where no
option reaches `resolve.min_posterior` the record stays unresolved: the bought ids are not
known. With `resolve.posterior_sampled: true` such a record is given one option drawn from
that same posterior, with a seeded RNG (the seed from `resolve.posterior_seed` and the
record's id, so a rerun draws the same option). Over many records the drawn ids follow the
target's own posterior only as far as the set holds the truth: on the 500-answer
calibration 21 of 36 drawn options were the truth against 29.0 predicted, because 11 truths
were splits no option held (docs/yield.md). No record claims to be the one bought:

  - `evidence` becomes `posterior_sampled`, never `ok`; the record keeps its `issues`
    (target_unresolved and the codes of its set) and its proven `prefix`, if any;
  - `posterior_sample` states the drawn option, its posterior, every option's posterior,
    the seed and the rule;
  - no accept policy takes it whole unless it names `posterior_sampled` (core/evidence.py).

Only a record whose one ambiguity is its scored set is drawn: any other code (a prefix the
target's split check withdrew, an answer check, a partial character) keeps it unresolved.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any, cast

from kimi_pipe.core.evidence import (
    NEVER_USABLE,
    POSTERIOR_SAMPLED,
    PREFIX_PROVEN,
    UNRESOLVED,
    evidence_of,
)
from kimi_pipe.core.issue_codes import TARGET_UNRESOLVED
from kimi_pipe.core.token_record import TokenRecord

RULE = "drawn from the target's posterior over the closed set; not the ids bought"


def posteriors_of(logprobs: Sequence[float | None]) -> list[float] | None:
    """Each option's posterior from its log-probability (None: impossible), as `decide`
    computes the best one's; None when every option is impossible."""
    finite = [lp for lp in logprobs if lp is not None and lp != -math.inf]
    if not finite:
        return None
    top = max(finite)
    weights = [0.0 if lp is None or lp == -math.inf else math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


def draw_seed(record_id: Any, seed: int) -> int:
    """The RNG seed of one record's draw: from the setting's seed and the record's id only."""
    digest = hashlib.sha256(f"{int(seed)}\x00{record_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def draw(posteriors: Sequence[float], rng_seed: int) -> int:
    """The index of the option drawn (inverse CDF of one uniform from `random.Random`)."""
    u = random.Random(rng_seed).random()
    cumulative = 0.0
    last = max(i for i, p in enumerate(posteriors) if p > 0)
    for i, p in enumerate(posteriors):
        cumulative += p
        if p > 0 and u < cumulative:
            return i
    return last  # rounding: the cumulative sum ended a hair under 1


def drawable(record: Mapping[str, Any], blocking: set[str], covered: frozenset[str]) -> bool:
    """Whether the record is one target resolution left unresolved and nothing else: scored
    by the target (`resolution` with one log-probability per option, one possible), flagged
    `target_unresolved`, no blocking code beyond the ones its set covers."""
    if record.get("ok") or record.get("error"):
        return False
    if evidence_of(record) not in (UNRESOLVED, PREFIX_PROVEN):
        return False
    issues = set(record.get("issues") or ())
    if TARGET_UNRESOLVED not in issues or NEVER_USABLE & issues:
        return False
    if blocking - covered - {TARGET_UNRESOLVED}:
        return False
    cands = record.get("candidates")
    res = record.get("resolution")
    if not isinstance(cands, Mapping) or cands.get("closed") is not True:
        return False
    options = cands.get("options")
    if not isinstance(res, Mapping) or res.get("method") != "target":
        return False
    if not isinstance(options, list):
        return False
    if any(isinstance(o, Mapping) and o.get("points") for o in options):
        return False  # an option with choice points stands for many sequences: none is drawn
    logprobs = res.get("logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(options) or len(options) < 2:
        return False
    return posteriors_of(logprobs) is not None


def sample_posterior(
    record: Mapping[str, Any], seed: int, blocking: set[str], covered: frozenset[str]
) -> TokenRecord | None:
    """The record with one option drawn (module docstring), or None when it is not drawable
    (`drawable`). `blocking`: the record's blocking codes; `covered`: the codes its set
    accounts for (extraction/resolve.py computes both)."""
    if not drawable(record, blocking, covered):
        return None
    res = record["resolution"]
    options = record["candidates"]["options"]
    posteriors = posteriors_of(res["logprobs"])
    assert posteriors is not None
    rng_seed = draw_seed(record.get("id"), seed)
    chosen = draw(posteriors, rng_seed)
    option = options[chosen]
    prompt_len = len(record.get("prompt_ids") or [])
    mask = list(option["loss_mask"])
    if len(mask) == len(option["output_ids"]):
        mask = list(record.get("loss_mask") or [])[:prompt_len] + mask
    if len(mask) != prompt_len + len(option["output_ids"]):
        return None  # a malformed option is never drawn
    out = cast(TokenRecord, dict(record))
    out["output_ids"] = list(option["output_ids"])
    out["loss_mask"] = mask
    out["completion_tokens_reconstructed"] = len(option["output_ids"])
    out["ok"] = False
    out["evidence"] = POSTERIOR_SAMPLED
    out["posterior_sample"] = {
        "option": chosen,
        "posterior": posteriors[chosen],
        "posteriors": posteriors,
        "options": len(options),
        "seed": int(seed),
        "rng_seed": rng_seed,
        "model": res.get("model"),
        "rule": RULE,
    }
    return out
