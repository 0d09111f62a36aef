"""Target resolution and the split check through the engine: logits of chosen token rows
(`SGLangBackend.logits`), under a request's sampler, as the hf scorers compute them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kimi_pipe.extraction.resolve import Sampling, sampled_logprobs
from kimi_pipe.extraction.split_check import sampler_log_table


class EngineLogits(Protocol):
    """What the scorers need of the backend (`SGLangBackend.logits`)."""

    def logits(
        self,
        prefix: Sequence[int],
        continuations: Sequence[Sequence[int]],
        rows: Sequence[Sequence[int]],
    ) -> list[torch.Tensor]: ...


class SGLangTarget:
    """The engine as target resolution sees it: logits of token rows (`SGLangBackend.logits`)
    and, for the split check, a `core.splits.NextTokenScorer` under a request's sampling
    (extraction.split_check.check_record asks a target that has `next_token_scorer`)."""

    def __init__(self, backend: EngineLogits) -> None:
        self.backend = backend

    def next_token_scorer(self, sampling: Sampling) -> SGLangNextTokenScorer:
        return SGLangNextTokenScorer(self.backend, sampling)


class SGLangSuffixScorer:
    """`extraction.resolve.SuffixScorer` through the engine: the prefix's KV is computed once
    in SGLang's pool and every option's suffix is extended on it, in one batch (prefix
    sharing, as SGLang's radix cache does); the option's log-probability is the request's
    sampler (`resolve.sampled_logprobs`, as the hf scorer) over SGLang's logits."""

    def __init__(self, target: SGLangTarget, model_name: str) -> None:
        self.model = target  # the split check's target (records_pass._split_check_pass)
        self.model_name = model_name
        self.prefix_tokens = 0  # work done, for the cost report
        self.suffix_tokens = 0

    def score_suffixes(
        self, prefix: Sequence[int], suffixes: Sequence[Sequence[int]], sampling: Sampling
    ) -> list[float]:
        if not prefix:
            raise ValueError("target resolution needs a non-empty prefix (the prompt)")
        scored = [i for i, s in enumerate(suffixes) if s]  # an empty suffix adds nothing
        # The prefix's last token goes with each option: its row predicts the option's first
        # token, and the option's own tokens (less the last) predict the rest.
        conts = [[prefix[-1], *suffixes[i][:-1]] for i in scored]
        logits = self.model.backend.logits(
            list(prefix[:-1]), conts, [list(range(len(c))) for c in conts]
        )
        self.prefix_tokens += len(prefix) - 1
        self.suffix_tokens += sum(map(len, conts))
        scores = [0.0] * len(suffixes)
        for i, rows in zip(scored, logits, strict=True):
            scores[i] = sum(sampled_logprobs(rows, list(suffixes[i]), sampling))
        return scores


class SGLangNextTokenScorer:
    """`core.splits.NextTokenScorer` through the engine: one request over the ids, SGLang's
    logits of the rows asked for, the request's sampler (`split_check.sampler_log_table`)."""

    def __init__(self, backend: EngineLogits, sampling: Sampling) -> None:
        self.backend = backend
        self.sampling = sampling
        self.tokens = 0  # forward work, for the cost report

    def logprobs_along(
        self, ids: Sequence[int], start: int, wanted: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        if not wanted:
            return []
        # Row start - 1 predicts ids[start]; SGLangBackend.logits refuses rows past the ids.
        (logits,) = self.backend.logits(
            [], [list(ids)], [range(start - 1, start - 1 + len(wanted))]
        )
        self.tokens += len(ids)
        table = sampler_log_table(logits, self.sampling)
        return [table[i, list(w)].tolist() for i, w in enumerate(wanted)]
