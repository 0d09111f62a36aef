"""The sampler's own probabilities: what an engine could draw under the request's sampling.

Target resolution and the split check both ask "how likely was it that the provider's engine
drew this token?". The answer is the sampler's, not the raw softmax: logits / temperature, then
top_k, then the top_p nucleus, then min_p, renormalised over what is kept (vLLM and SGLang
apply them in this order). A token outside what the sampler could draw has probability 0
(log -inf): an option holding it is impossible, not merely unlikely.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kimi_pipe.extraction.slack import GREEDY_SLACK, NUCLEUS_SLACK

ROW_CHUNK = 256  # rows of [T, vocab] float64 worked on at once (memory on big vocabularies)


@dataclass(frozen=True)
class Sampling:
    """What the request sent. temperature 0 = greedy; top_p 1 / top_k None = no cut."""

    temperature: float
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    slack: float = NUCLEUS_SLACK  # mass past top_p (and share below min_p) still kept
    greedy_slack: float = GREEDY_SLACK  # relative gap below the top logit still drawable

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p < 1:
            raise ValueError(f"bad sampling {self}")
        if not 0 <= self.slack < 1 or not 0 <= self.greedy_slack < 1:
            raise ValueError(f"bad slack {self.slack} / {self.greedy_slack}")

    @classmethod
    def from_record(
        cls,
        sampling: Mapping[str, Any] | None,
        default_temperature: float | None = None,
        slack: float = NUCLEUS_SLACK,
        greedy_slack: float = GREEDY_SLACK,
    ) -> Sampling | None:
        """The record's `sampling`; None when its temperature is unknown (provider default
        and no `resolve.default_temperature`). A missing top_p counts as 1: it never makes
        an option impossible, so not knowing it can only lower the posterior's sharpness."""
        sampling = sampling or {}
        temperature = sampling.get("temperature")
        if temperature is None:
            temperature = default_temperature
        if temperature is None:
            return None
        top_p = sampling.get("top_p")
        top_k = sampling.get("top_k")
        return cls(
            float(temperature),
            1.0 if top_p is None else float(top_p),
            int(top_k) if top_k not in (None, 0, -1) else None,
            float(sampling.get("min_p") or 0.0),
            slack,
            greedy_slack,
        )


def logsumexp(values: Sequence[float]) -> float:
    """log(sum(exp(v))) over the finite values; -inf where none is (nothing could be drawn)."""
    finite = [v for v in values if v > -math.inf]
    if not finite:
        return -math.inf
    top = max(finite)
    return top + math.log(sum(math.exp(v - top) for v in finite))


def sampled_logprobs(
    logits: torch.Tensor, targets: Sequence[int], sampling: Sampling
) -> list[float]:
    """log P(target_t) at each row t of `logits` [T, V] under the sampler (T = len(targets)).

    Order as vLLM and SGLang apply them: temperature, top_k, top_p; renormalised over what is
    kept. -inf where the token is outside what the sampler could draw."""
    logits = logits.double()
    out: list[float] = []
    for row, target in zip(logits, targets, strict=True):
        if sampling.temperature == 0:
            # Greedy: only the argmax (any of a tie) can come out.
            best = row.max()
            edge = best - sampling.greedy_slack * max(abs(float(best)), 1.0)
            out.append(0.0 if row[target] >= edge else -math.inf)
            continue
        scaled = row / sampling.temperature
        if sampling.top_k is not None and sampling.top_k < scaled.numel():
            kth = torch.topk(scaled, sampling.top_k).values[-1]
            if scaled[target] < kth:
                out.append(-math.inf)
                continue
            scaled = torch.where(scaled >= kth, scaled, torch.full_like(scaled, -math.inf))
        probs = torch.softmax(scaled, dim=-1)
        p_target = probs[target]
        kept = probs
        if sampling.top_p < 1.0:
            # The nucleus: tokens whose higher-ranked mass is still below top_p (at least one).
            ordered = torch.sort(probs, descending=True).values
            before = torch.cumsum(ordered, 0) - ordered
            kept = ordered[before < sampling.top_p]
            if probs[probs > p_target].sum() >= sampling.top_p + sampling.slack:
                out.append(-math.inf)
                continue
        if sampling.min_p > 0:
            # min_p keeps tokens with at least min_p x the top probability (SGLang's order:
            # after top_k and top_p).
            floor = sampling.min_p * probs.max()
            if p_target < floor * (1 - sampling.slack):
                out.append(-math.inf)
                continue
            kept = kept[kept >= floor]
        out.append(float(torch.log(p_target) - torch.log(kept.sum())))
    return out


def sampler_log_table(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """log P(token) for every token of every row [T, V] under the sampler (-inf where it
    cannot draw the token): the table form of `sampled_logprobs`, same order
    (temperature, top_k, top_p, min_p) and the same slack at the nucleus edge."""
    parts = []
    for chunk in logits.double().split(ROW_CHUNK):
        parts.append(_table(chunk, sampling))
    return torch.cat(parts) if parts else logits.double()


def _table(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    neg = torch.full_like(logits, -math.inf)
    if sampling.temperature == 0:
        best = logits.max(dim=-1, keepdim=True).values
        edge = best - sampling.greedy_slack * best.abs().clamp(min=1.0)
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
        n_keep = (before < sampling.top_p + sampling.slack).sum(dim=-1, keepdim=True)
        cutoff = ordered.gather(-1, (n_keep - 1).clamp(min=0))
        keep = keep & (probs >= cutoff)
        norm = torch.where(before < sampling.top_p, ordered, 0.0).sum(dim=-1, keepdim=True)
        if sampling.min_p > 0:
            floor = sampling.min_p * probs.max(dim=-1, keepdim=True).values
            keep = keep & (probs >= floor * (1 - sampling.slack))
            norm = torch.where((before < sampling.top_p) & (ordered >= floor), ordered, 0.0).sum(
                dim=-1, keepdim=True
            )
    elif sampling.min_p > 0:
        floor = sampling.min_p * probs.max(dim=-1, keepdim=True).values
        keep = keep & (probs >= floor * (1 - sampling.slack))
        norm = torch.where(probs >= floor, probs, 0.0).sum(dim=-1, keepdim=True)
    return torch.where(keep, torch.log(probs) - torch.log(norm), neg)
