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
A record flagged only for `billing_mismatch` (the canonical encoding has another length than
the engine's) goes through the same search at the billed length: a non-canonical split of
another length is found and resolved the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kimi_pipe.core.evidence import TARGET_RESOLVED, TEXT_PROVEN, UNRESOLVED, evidence_of
from kimi_pipe.core.splits import SplitSearch, Vocabulary, search_splits
from kimi_pipe.extraction.resolve import (
    GREEDY_SLACK,
    NUCLEUS_SLACK,
    ResolveSettings,
    Sampling,
    decide,
)

SPLIT_CHECKED = "split_checked"  # note: no other split was possible under the sampling
SPLIT_RESOLVED = "split_resolved"  # note: the target chose among splits (posterior stated)
SPLIT_AMBIGUOUS = "split_ambiguous"  # issue: another split is too likely, or not enumerable
TARGET_DISAGREES = "target_disagrees"  # issue: the ids are impossible under the sampling
ISSUES = (SPLIT_AMBIGUOUS, TARGET_DISAGREES)
ROW_CHUNK = 256  # rows of [T, vocab] float64 worked on at once (memory on big vocabularies)


def sampler_log_table(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """log P(token) for every token of every row [T, V] under the sampler (-inf where it
    cannot draw the token): the table form of `resolve.sampled_logprobs`, same order
    (temperature, top_k, top_p, min_p) and the same slack at the nucleus edge."""
    parts = []
    for chunk in logits.double().split(ROW_CHUNK):
        parts.append(_table(chunk, sampling))
    return torch.cat(parts) if parts else logits.double()


def _table(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    neg = torch.full_like(logits, -math.inf)
    if sampling.temperature == 0:
        best = logits.max(dim=-1, keepdim=True).values
        edge = best - GREEDY_SLACK * best.abs().clamp(min=1.0)
        return torch.where(logits >= edge, torch.zeros_like(logits), neg)
    scaled = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[:, -1:]
        scaled = torch.where(scaled >= kth, scaled, neg)
    probs = torch.softmax(scaled, dim=-1)
    keep = probs > 0
    norm = probs.sum(dim=-1, keepdim=True)
    if sampling.top_p < 1.0:
        ordered = torch.sort(probs, dim=-1, descending=True).values
        before = torch.cumsum(ordered, dim=-1) - ordered
        # Kept: a token whose strictly higher-ranked mass is below top_p (+ slack); ties of
        # the last kept value stay with it. Normalised over the nucleus proper, as the
        # per-token form does.
        n_keep = (before < sampling.top_p + NUCLEUS_SLACK).sum(dim=-1, keepdim=True)
        cutoff = ordered.gather(-1, (n_keep - 1).clamp(min=0))
        keep = keep & (probs >= cutoff)
        norm = torch.where(before < sampling.top_p, ordered, 0.0).sum(dim=-1, keepdim=True)
        if sampling.min_p > 0:
            floor = sampling.min_p * probs.max(dim=-1, keepdim=True).values
            keep = keep & (probs >= floor * (1 - NUCLEUS_SLACK))
            norm = torch.where((before < sampling.top_p) & (ordered >= floor), ordered, 0.0).sum(
                dim=-1, keepdim=True
            )
    elif sampling.min_p > 0:
        floor = sampling.min_p * probs.max(dim=-1, keepdim=True).values
        keep = keep & (probs >= floor * (1 - NUCLEUS_SLACK))
        norm = torch.where(probs >= floor, probs, 0.0).sum(dim=-1, keepdim=True)
    return torch.where(keep, torch.log(probs) - torch.log(norm), neg)


class HFNextTokenScorer:
    """`core.splits.NextTokenScorer` on a transformers causal LM: one plain forward per call."""

    def __init__(self, model: Any, sampling: Sampling) -> None:
        self.model = model
        self.sampling = sampling
        self.device = next(model.parameters()).device
        self.tokens = 0  # forward work, for the cost report

    @torch.inference_mode()
    def logprobs_along(
        self, ids: Sequence[int], start: int, wanted: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        if not wanted:
            return []
        if start < 1 or len(wanted) > len(ids) - start + 1:
            raise ValueError(f"logprobs_along: start {start}, {len(wanted)} rows, {len(ids)} ids")
        batch = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        keep = len(ids) - start + 1  # rows from the one predicting ids[start] to the end
        logits = self.model(input_ids=batch, use_cache=False, logits_to_keep=keep).logits[0]
        self.tokens += len(ids)
        table = sampler_log_table(logits[: len(wanted)], self.sampling)
        return [table[i, list(w)].tolist() for i, w in enumerate(wanted)]


def vocabulary_of(tokenizer: Any) -> Vocabulary:
    """The search's view of a project tokenizer (`core.tokenizers.Tokenizer`)."""
    longest = max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))
    return Vocabulary(tokenizer.token_bytes, tokenizer.id_of_bytes, longest)


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


def checkable(record: Mapping[str, Any]) -> str | None:
    """Why the record is not split-checked (None: it is)."""
    if record.get("split_check"):
        return "checked_before"
    if not isinstance(record.get("output_ids"), list) or not record.get("prompt_ids"):
        return "no_ids"
    rung = evidence_of(record)
    if record.get("ok") and rung in (TEXT_PROVEN, TARGET_RESOLVED):
        return None
    issues = set(record.get("issues") or [])
    if (
        not record.get("ok")
        and issues == {"billing_mismatch"}
        and not record.get("candidates")
        and isinstance(record.get("completion_tokens_reported"), int)
    ):
        return None  # a split of another length may be what the engine drew
    return "rung" if record.get("ok") else "other_issues"


def check_record(
    record: Mapping[str, Any],
    model: Any,
    vocab: Vocabulary,
    settings: ResolveSettings,
    model_name: str,
) -> tuple[dict[str, Any] | None, int]:
    """The record after its split check (None: the request's temperature is unknown), and
    the forward tokens it cost."""
    sampling = Sampling.from_record(record.get("sampling"), settings.default_temperature)
    if sampling is None:
        return None, 0
    scorer = HFNextTokenScorer(model, sampling)
    output = list(record["output_ids"])
    billed = record.get("completion_tokens_reported")
    if not isinstance(billed, int) or billed < 0:
        billed = None
    search = search_splits(record["prompt_ids"], output, billed, vocab, scorer)
    return apply_split_check(record, search, settings, model_name, sampling), scorer.tokens


def apply_split_check(
    record: Mapping[str, Any],
    search: SplitSearch,
    settings: ResolveSettings,
    model_name: str,
    sampling: Sampling,
) -> dict[str, Any]:
    """Pure: the record with its `split_check` numbers and the rung they support."""
    out = dict(record)
    output = list(record["output_ids"])
    options = search.options(output)
    facts: dict[str, Any] = {
        "model": model_name,
        "min_posterior": settings.min_posterior,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        **({"top_k": sampling.top_k} if sampling.top_k is not None else {}),
        "paths": len(options),
        "suspect_positions": search.suspects,
        "branches_scored": search.branches,
        "pruned": search.pruned,
        "approximate": search.pruned > 0,
        "closed": search.closed,
    }
    if search.limits:
        facts["limits"] = sorted(set(search.limits))
    own_possible = search.record_fits_billing and search.record_logprob > -math.inf
    if search.closed and own_possible and not search.others:
        out["split_check"] = {**facts, "chosen": "record", "posterior": 1.0}
        out["notes"] = _add(record.get("notes"), SPLIT_CHECKED)
        return out
    numbers = decide([o.logprob for o in options], settings.min_posterior) if options else None
    if numbers is not None:
        facts["posterior"] = numbers["posterior"]
        facts["margin"] = numbers["margin"]
    if not search.closed or numbers is None or not numbers["resolved"]:
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
        **({} if own else {"diverge_at": chosen.diverge_at, "window": chosen.window}),
    }
    if not own:
        out["output_ids"] = list(chosen.output_ids)
        out["loss_mask"] = _mask_for(record, chosen.diverge_at, chosen.window, chosen.output_ids)
        out["completion_tokens_reconstructed"] = len(chosen.output_ids)
    out["issues"] = [c for c in (record.get("issues") or []) if c != "billing_mismatch"]
    notes = [*(record.get("notes") or []), SPLIT_RESOLVED]
    if "billing_mismatch" in (record.get("issues") or []):
        notes.append("billing_mismatch")
    out["notes"] = list(dict.fromkeys(notes))
    out["ok"] = True
    out["evidence"] = TARGET_RESOLVED
    return out


def _add(codes: Any, code: str) -> list[str]:
    return list(dict.fromkeys([*(codes or []), code]))


def _mask_for(record: Mapping[str, Any], at: int, window: int, new_ids: Sequence[int]) -> list[int]:
    """The loss mask for ids where `window` record ids from output index `at` became the
    branch's: the branch takes the mask value of the id it starts at."""
    mask = list(record["loss_mask"])
    prompt_len = len(record.get("prompt_ids") or [])
    if len(mask) != prompt_len + len(record["output_ids"]):
        raise ValueError(f"record {record.get('id')!r}: loss_mask does not cover prompt + output")
    branch = len(new_ids) - (len(record["output_ids"]) - window)
    start = prompt_len + at
    return mask[:start] + [mask[start]] * branch + mask[start + window :]
