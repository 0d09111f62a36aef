"""Split check: the target confirms that a record's ids are the split the engine sampled.

A record proven by text + profile + billing (`text_proven`) holds the canonical encoding of
the returned text. An engine that sampled a non-canonical split of the same length returned
the same text and the same count, so nothing before extraction can tell (docs/resolve.md,
"Split check"). The target can: `kimi_pipe.core.splits.search_splits` asks it, under the
sampling the request sent, which other splits of the text the sampler could have drawn, and
this module turns the answer into the record's evidence:

* no other path the sampler could draw (the usual case under a `top_p` < 1 nucleus): the
  record keeps its rung, with note `split_checked`;
* other paths, one of them at posterior >= `resolve.min_posterior`: `target_resolved` on
  that path's ids (the record's own, or the other split's), note `split_resolved`;
* otherwise (no path reaches the threshold, the search hit its limits, or the record's own
  ids are impossible under the sampling and no other split fits): `unresolved`, with issue
  `split_ambiguous` or `target_disagrees`.
With `resolve.billing_splits`, a record whose bill no reading fits goes through the same
search at the billed length: one flagged only for `billing_mismatch` (its own text's splits),
or one whose candidates have no option, only readings (their splits; the flags they account
for are settled with the one chosen). Off by default: such a bill is as often a stack's change
to the text, which no split of the wrong text may explain away (docs/resolve.md).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from kimi_pipe.core.evidence import TARGET_RESOLVED, TEXT_PROVEN, UNRESOLVED, evidence_of
from kimi_pipe.core.issue_codes import (  # what each means: there
    SPLIT_AMBIGUOUS,
    SPLIT_CHECKED,
    SPLIT_RESOLVED,
    TARGET_DISAGREES,
    Code,
)
from kimi_pipe.core.splits import (
    NextTokenScorer,
    SplitPath,
    SplitSearch,
    Vocabulary,
    first_steps,
    search_splits,
)
from kimi_pipe.core.token_record import TokenRecord
from kimi_pipe.extraction.resolve import (
    ResolveSettings,
    blocking_issues,
    cache_argument,
    covered_issues,
    decide,
)
from kimi_pipe.extraction.sampler import Sampling, sampler_log_table

ISSUES = (SPLIT_AMBIGUOUS, TARGET_DISAGREES)


class HFNextTokenScorer:
    """`core.splits.NextTokenScorer` on a transformers causal LM.

    The first call (the record's own ids) keeps its KV cache; every later call (a branch of
    the search, which shares the record's ids up to where it leaves them) runs on a copy of
    that cache cut back to the shared prefix, so the prompt and the record's ids before the
    branch are never computed again. Positions run `chunk_tokens` at a time, and only the
    wanted ids are kept of each row's table: memory stays bounded on long records and large
    vocabularies."""

    def __init__(self, model: Any, sampling: Sampling, chunk_tokens: int = 256) -> None:
        self.model = model
        self.sampling = sampling
        self.device = next(model.parameters()).device
        self.chunk_tokens = chunk_tokens
        self.tokens = 0  # forward work (positions run), for the cost report
        self._cache: Any = None
        self._cached_ids: list[int] = []  # the ids whose keys and values the cache holds
        self._cache_arg = cache_argument(model)

    @torch.inference_mode()
    def logprobs_along(
        self, ids: Sequence[int], start: int, wanted: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        from transformers import DynamicCache  # optional dep

        if not wanted:
            return []
        if start < 1 or len(wanted) > len(ids) - start + 1:
            raise ValueError(f"logprobs_along: start {start}, {len(wanted)} rows, {len(ids)} ids")
        ids = list(ids)
        first_row = start - 1  # the position whose logits predict ids[start]
        reuse = min(_shared_prefix(self._cached_ids, ids), first_row) if self._cache else 0
        if reuse > 0:
            cache = copy.deepcopy(self._cache)
            if reuse < len(self._cached_ids):
                cache.crop(reuse - len(self._cached_ids))  # a negative count: drop from the end
        else:
            cache = DynamicCache()
        pos = reuse
        if first_row > pos:  # context the rows need, no logits kept
            self._run(ids[pos:first_row], cache, logits=False)
            pos = first_row
        rows: list[list[float]] = []
        end = first_row + len(wanted)
        while pos < end:
            stop = min(end, pos + self.chunk_tokens)
            table = sampler_log_table(self._run(ids[pos:stop], cache, logits=True), self.sampling)
            for r in range(stop - pos):
                rows.append(table[r, list(wanted[pos - first_row + r])].tolist())
            pos = stop
        if self._cache is None:
            self._cache, self._cached_ids = cache, ids[:pos]
        return rows

    def _run(self, ids: Sequence[int], cache: Any, *, logits: bool) -> torch.Tensor:
        batch = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        keep = len(ids) if logits else 1
        out = self.model(
            input_ids=batch, **{self._cache_arg: cache}, use_cache=True, logits_to_keep=keep
        )
        self.tokens += len(ids)
        return out.logits[0]


def _shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def vocabulary_of(tokenizer: Any) -> Vocabulary:
    """The search's view of a project tokenizer (`core.tokenizers.Tokenizer`)."""
    longest = max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))
    return Vocabulary(
        tokenizer.token_bytes, tokenizer.id_of_bytes, longest, size=tokenizer.vocab_size
    )


class LazyVocabulary:
    """`vocabulary_of(load())`, built on first use: loading a tokenizer and indexing its
    vocabulary costs seconds, which an extract run whose records need no split check (no
    sampling recorded, or checked before) should not pay."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load
        self._vocab: Vocabulary | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not a Vocabulary attribute (copy, pickle probes)
            raise AttributeError(name)
        if self._vocab is None:
            self._vocab = vocabulary_of(self._load())
        return getattr(self._vocab, name)


def checkable(record: Mapping[str, Any], billing_splits: bool = False) -> str | None:
    """Why the record is not split-checked (None: it is). `billing_splits`
    (`resolve.billing_splits`): also a record whose bill no reading fits."""
    if record.get("split_check"):
        return "checked_before"
    if not isinstance(record.get("output_ids"), list) or not record.get("prompt_ids"):
        return "no_ids"
    rung = evidence_of(record)
    if record.get("ok") and rung in (TEXT_PROVEN, TARGET_RESOLVED):
        return None
    issues = set(record.get("issues") or [])
    billed = isinstance(record.get("completion_tokens_reported"), int)
    if not record.get("ok") and issues == {Code.BILLING_MISMATCH} and not record.get("candidates"):
        if not billed:
            return "other_issues"
        return None if billing_splits else "billing_splits_off"  # a split may fit the bill
    cands = record.get("candidates")
    if (
        not record.get("ok")
        and billed
        and isinstance(cands, Mapping)
        and not cands.get("options")
        and (record.get("short_readings") or record.get("long_readings"))
        and not blocking_issues(list(issues)) - covered_issues(cands)
    ):
        # No reading fits the bill at its canonical split: search their splits.
        return None if billing_splits else "billing_splits_off"
    return "rung" if record.get("ok") else "other_issues"


def next_token_scorer(model: Any, sampling: Any) -> Any:
    """The target's next-token scorer under `sampling`: a serving engine's target
    (sglang.scoring.SGLangTarget) brings its own, else transformers' forward."""
    own_scorer = getattr(model, "next_token_scorer", None)
    return own_scorer(sampling) if own_scorer is not None else HFNextTokenScorer(model, sampling)


def check_record(
    record: Mapping[str, Any],
    model: Any,
    vocab: Vocabulary,
    settings: ResolveSettings,
    model_name: str,
) -> tuple[TokenRecord | None, int]:
    """The record after its split check (None: the request's temperature is unknown), and
    the forward tokens it cost."""
    sampling = settings.sampling_of(record)
    if sampling is None:
        return None, 0
    scorer = next_token_scorer(model, sampling)
    output = list(record["output_ids"])
    billed = record.get("completion_tokens_reported")
    if not isinstance(billed, int) or billed < 0:
        billed = None
    search = search_splits(record["prompt_ids"], output, billed, vocab, scorer)
    neighbours, limits = neighbour_readings(
        record, search, billed, vocab, scorer, settings.near_reading_branches
    )
    out = apply_split_check(record, search, settings, model_name, sampling, neighbours, limits)
    return out, scorer.tokens


# Branch forwards shared by all of one record's short and long readings (search_splits' own
# limit is per reading; a record may carry a reading per whitespace token of the vocabulary).
# The default of `resolve.near_reading_branches`.
NEAR_READINGS_BRANCHES: int = ResolveSettings.near_reading_branches


@dataclass(frozen=True)
class Reading:
    """A whole output the engine may have drawn instead of the record's: its ids, mask
    (prompt + output) and the sampler's log-probability of it."""

    output_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprob: float
    # "option" (a candidate the target ranked), "short_reading" or "long_reading" (its split)
    source: str


def neighbour_readings(
    record: Mapping[str, Any],
    search: SplitSearch,
    billed: int | None,
    vocab: Vocabulary,
    scorer: NextTokenScorer,
    branches: int = NEAR_READINGS_BRANCHES,
) -> tuple[list[Reading], list[str]]:
    """Every path of the answer's other readings that the sampler could have drawn at the
    billed length, and the limits that leave them open. `branches`: the forwards all of
    them may spend together (`resolve.near_reading_branches`).

    A record whose ids billing chose among readings (a candidate set: hidden whitespace, a
    marker space) was chosen under "the split is canonical". Its other readings escape that:
    the set's other options, the `short_readings` (canonical ids shorter than the bill: a
    split of one, longer, fits it) and the `long_readings` (longer: BPE's canonical split is
    not always the shortest). Each is searched like the record's own text (its canonical ids
    and every split of them within the search's departures), within one shared budget; a
    reading no split of which the sampler could draw is dismissed first, from the record's
    own next-token distributions (`_drawable_readings`: one forward for all of them)."""
    readings: list[Reading] = []
    limits: list[str] = []
    resolution = record.get("resolution")
    options = (record.get("candidates") or {}).get("options") or []
    own = tuple(record["output_ids"])
    kept: list[tuple[str, Mapping[str, Any]]] = []
    if isinstance(resolution, Mapping) and resolution.get("chosen") is not None:
        kept += [("option", o) for o in options]
    kept += [("short_reading", r) for r in record.get("short_readings") or []]
    kept += [("long_reading", r) for r in record.get("long_readings") or []]
    unique: dict[tuple[int, ...], tuple[str, Mapping[str, Any]]] = {}
    for source, reading in kept:
        key = tuple(reading["output_ids"])
        if key != own:
            unique.setdefault(key, (source, reading))
    near = list(unique.values())
    drawable = _drawable_readings(record, search, [r for _, r in near], vocab, scorer)
    budget = branches
    for (source, reading), may in zip(near, drawable, strict=True):
        if not may:
            continue
        if budget <= 0:
            # A vocabulary-wide set of hidden strings can make every reading branch at the
            # gap: the search stays bounded, and the record, not closed, is not trusted.
            limits.append(f"more than {branches} branches over near readings")
            break
        ids = list(reading["output_ids"])
        found = search_splits(record["prompt_ids"], ids, billed, vocab, scorer, max_branches=budget)
        budget -= found.branches + 1  # + its own forward
        limits.extend(found.limits)
        base = {**record, "output_ids": ids, "loss_mask": _full_mask(record, reading)}
        for path in found.options(ids):
            if path.logprob == -math.inf:
                continue
            mask = base["loss_mask"] if path.output_ids == tuple(ids) else _path_mask(base, path)
            readings.append(Reading(path.output_ids, tuple(mask), path.logprob, source))
    return readings, limits


def _drawable_readings(
    record: Mapping[str, Any],
    search: SplitSearch,
    readings: Sequence[Mapping[str, Any]],
    vocab: Vocabulary,
    scorer: NextTokenScorer,
) -> list[bool]:
    """For each reading, False only when no split of it can have been drawn, decided from the
    record's own next-token distributions (no forward of the reading's own): the record's
    search found no drawable departure from its ids before the texts differ, so a split of the
    reading follows them up to there, and there no token that spells the reading's bytes
    across the first differing byte is drawable. One forward over the record answers every
    reading: a vocabulary-wide set of readings costs one pass, not a search each."""
    out = list(record["output_ids"])
    verdicts: list[bool | None] = []
    steps_of: list[dict[int, list[int]]] = []
    wanted: dict[int, set[int]] = {}
    for reading in readings:
        first = first_steps(out, list(reading["output_ids"]), vocab)
        if first is None or any(k < first.shared for k in search.suspect_at):
            verdicts.append(True)  # a split may leave the record's ids earlier: search it
            steps_of.append({})
            continue
        at = dict(first.steps)
        verdicts.append(None if at else False)
        steps_of.append(at)
        for j, tokens in at.items():
            wanted.setdefault(j, set()).update(tokens)
    if not wanted:
        return [bool(v) for v in verdicts]
    last = max(wanted)
    columns = [[out[j], *sorted(wanted.get(j, ()))] for j in range(last + 1)]
    prompt = list(record["prompt_ids"])
    rows = scorer.logprobs_along(prompt + out, len(prompt), columns)
    drawable = [
        {t for t, lp in zip(col[1:], row[1:], strict=True) if lp > -math.inf}
        for col, row in zip(columns, rows, strict=True)
    ]
    reachable = [True]  # reachable[j]: the record's ids before j drawable
    for row in rows:
        reachable.append(reachable[-1] and row[0] > -math.inf)
    result = []
    for verdict, at in zip(verdicts, steps_of, strict=True):
        if verdict is not None:
            result.append(verdict)
            continue
        result.append(any(reachable[j] and drawable[j] & set(tokens) for j, tokens in at.items()))
    return result


def _full_mask(record: Mapping[str, Any], option: Mapping[str, Any]) -> list[int]:
    """An option's mask over prompt + output (options may carry the output part only)."""
    mask = list(option["loss_mask"])
    prompt_len = len(record.get("prompt_ids") or [])
    if len(mask) == len(option["output_ids"]):
        mask = list(record["loss_mask"][:prompt_len]) + mask
    return mask


def apply_split_check(
    record: Mapping[str, Any],
    search: SplitSearch,
    settings: ResolveSettings,
    model_name: str,
    sampling: Sampling,
    neighbours: Sequence[Reading] = (),
    neighbour_limits: Sequence[str] = (),
) -> TokenRecord:
    """Pure: the record with its `split_check` numbers and the rung they support.
    `neighbours`: whole readings beyond the splits of the record's own text
    (`neighbour_readings`), weighed with them."""
    out = cast(TokenRecord, dict(record))
    output = list(record["output_ids"])
    drawable = [n for n in neighbours if n.logprob > -math.inf]
    options = [
        Reading(
            path.output_ids,
            tuple(
                record["loss_mask"]
                if path.output_ids == tuple(output)
                else _path_mask(record, path)
            ),
            path.logprob,
            "split",
        )
        for path in search.options(output)
    ]
    ids_seen = {o.output_ids for o in options}
    for reading in drawable:  # the same ids reached from two readings count once
        if reading.output_ids not in ids_seen:
            ids_seen.add(reading.output_ids)
            options.append(reading)
    limits = sorted({*search.limits, *neighbour_limits})
    closed = not limits
    facts: dict[str, Any] = {
        "model": model_name,
        "min_posterior": settings.min_posterior,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "slack": {"nucleus": sampling.slack, "greedy": sampling.greedy_slack},
        **({"top_k": sampling.top_k} if sampling.top_k is not None else {}),
        "paths": len(options),
        "suspect_positions": search.suspects,
        "branches_scored": search.branches,
        "pruned": search.pruned,
        "approximate": search.pruned > 0,
        "closed": closed,
        **({"neighbours": len(drawable)} if neighbours else {}),
    }
    if limits:
        facts["limits"] = limits
    own_possible = search.record_fits_billing and search.record_logprob > -math.inf
    if closed and own_possible and not search.others and not drawable:
        out["split_check"] = {**facts, "chosen": "record", "posterior": 1.0}
        out["notes"] = _add(record.get("notes"), SPLIT_CHECKED)
        return out
    numbers = decide([o.logprob for o in options], settings.min_posterior) if options else None
    if numbers is not None:
        facts["posterior"] = numbers["posterior"]
        facts["margin"] = numbers["margin"]
    if not closed or numbers is None or not numbers["resolved"]:
        code = TARGET_DISAGREES if numbers is None or numbers["chosen"] is None else SPLIT_AMBIGUOUS
        out["split_check"] = {**facts, "chosen": None}
        out["ok"] = False
        out["evidence"] = UNRESOLVED
        out["issues"] = _add(record.get("issues"), code)
        return out
    chosen = options[numbers["chosen"]]
    own = chosen.output_ids == tuple(output)
    out["split_check"] = {
        **facts,
        "chosen": "record" if own else "other",
        **({} if own else {"chosen_from": chosen.source}),
    }
    if not own:
        out["output_ids"] = list(chosen.output_ids)
        out["loss_mask"] = list(chosen.loss_mask)
        out["completion_tokens_reconstructed"] = len(chosen.output_ids)
    # What the readings accounted for (a stripped tail, a marker space) is settled with them.
    cands = record.get("candidates")
    covered = covered_issues(cands) if isinstance(cands, Mapping) else frozenset()
    settled = covered | {Code.BILLING_MISMATCH}
    out["issues"] = [c for c in (record.get("issues") or []) if c not in settled]
    notes = [*(record.get("notes") or []), SPLIT_RESOLVED]
    if Code.BILLING_MISMATCH in (record.get("issues") or []):
        notes.append(Code.BILLING_MISMATCH)
    out["notes"] = list(dict.fromkeys(notes))
    out["ok"] = True
    out["evidence"] = TARGET_RESOLVED
    return out


def _add(codes: Any, code: str) -> list[str]:
    return list(dict.fromkeys([*(codes or []), code]))


def _path_mask(record: Mapping[str, Any], path: SplitPath) -> list[int]:
    """The loss mask of a path over prompt + output: the ids of each departure take the mask
    value of the record id it starts at."""
    mask = list(record["loss_mask"])
    prompt_len = len(record.get("prompt_ids") or [])
    if len(mask) != prompt_len + len(record["output_ids"]):
        raise ValueError(f"record {record.get('id')!r}: loss_mask does not cover prompt + output")
    out_mask, pos = mask[:prompt_len], 0
    for at, replaced, put in path.windows:
        out_mask += mask[prompt_len + pos : prompt_len + at] + [mask[prompt_len + at]] * put
        pos = at + replaced
    out_mask += mask[prompt_len + pos :]
    if len(out_mask) != prompt_len + len(path.output_ids):
        raise ValueError(f"record {record.get('id')!r}: a path's departures do not add up")
    return out_mask
