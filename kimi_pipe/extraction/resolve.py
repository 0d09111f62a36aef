"""Target resolution: the target model chooses among a record's CLOSED candidate set (or a
bounded open one: its gaps' bounds join every option's rivals, extraction/gap_bounds.py).

Where the returned text leaves a few possible id sequences (a stripped whitespace tail, a
marker space that may be the stack's, ...), reconstruction lists them all in the record's
`candidates` (docs/LADDER schema, `kimi_pipe.core.candidates`). Extraction runs the target
anyway, so before capturing states it scores each option under the sampling the request sent:

* one forward over the shared prefix (prompt + output ids before `diverge_at`), keeping its
  KV cache; then each option's suffix is run on that cache (cropped back after each), so
  the prefix is computed once, not once per option;
* each sampled token's probability is the sampler's: logits / temperature, then top_k, then
  the top_p nucleus, renormalised. A token outside the nucleus (or top_k) has probability 0:
  that option is impossible, not merely unlikely (`resolution.impossible`);
* posterior = exp(logp_i) / sum_j exp(logp_j) over the options. At or above
  `resolve.min_posterior` the record is rewritten with the chosen ids (`evidence:
  target_resolved`, `ok: true`); below it stays unresolved with the numbers and issue
  `target_unresolved`.

The records file is rewritten whole (tmp + fsync + rename, under the run directory's lock),
so every reader sees resolved records without knowing about resolution, and a kill leaves
either the old file or the new one, never a torn mix (docs/resolve.md).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from kimi_pipe.core.evidence import UNRESOLVED as UNRESOLVED
from kimi_pipe.core.issue_codes import RESOLVED_BY_TARGET, TARGET_UNRESOLVED
from kimi_pipe.core.issue_codes import TARGET_RESOLVED as TARGET_RESOLVED  # one home
from kimi_pipe.core.prefix import with_prefix

# The gate to the target, pure (the report asks it too): resolve's public names.
from kimi_pipe.core.resolvability import blocking_issues as blocking_issues
from kimi_pipe.core.resolvability import covered_codes as covered_issues
from kimi_pipe.core.resolvability import resolvable as resolvable
from kimi_pipe.core.token_record import TokenRecord
from kimi_pipe.extraction.resolve_settings import ResolveSettings as ResolveSettings
from kimi_pipe.extraction.sampler import (  # noqa: F401  (re-exported: resolve's public names)
    Sampling,
    sampled_logprobs,
    sampler_log_table,
)
from kimi_pipe.store.atomic import write_bytes
from kimi_pipe.store.layout import LOCK
from kimi_pipe.store.run_lock import run_dir_lock

log = logging.getLogger("kimi_pipe.resolve")

# TARGET_UNRESOLVED: scored, but no option reached resolve.min_posterior (core/issue_codes.py)
RESOLVED_NOTE = RESOLVED_BY_TARGET
# The run directory's lock (store/run_lock.py): generate holds it.
LOCK_FILE = LOCK


# --------------------------------------------------------------------------- scoring


class SuffixScorer(Protocol):
    """What a backend offers resolution: per option, log P(suffix | prefix) under sampling."""

    model_name: str

    def score_suffixes(
        self, prefix: Sequence[int], suffixes: Sequence[Sequence[int]], sampling: Sampling
    ) -> list[float]: ...


class HFSuffixScorer:
    """transformers: one cached forward over the prefix; the options' suffixes then run on it
    (one batch per suffix length, each row on the same prefix cache).

    An option whose token the sampler could not draw is dropped at that token: its score is
    -inf whatever follows, so its remaining suffix is never run (`pruned`). Under a `top_p`
    nucleus most options of a large set (every whitespace token of a vocabulary, say) die at
    their first token, after the prefix forward alone. Suffixes run `chunk_tokens` positions
    at a time, which bounds the [options, positions, vocabulary] logits held at once."""

    def __init__(
        self,
        model: Any,
        model_name: str,
        device: torch.device | None = None,
        chunk_tokens: int = 256,
    ) -> None:
        self.model = model
        self.model_name = model_name
        self.device = device or next(model.parameters()).device
        self.chunk_tokens = chunk_tokens
        self.prefix_tokens = 0  # work done, for the cost report
        self.suffix_tokens = 0
        self.pruned = 0  # options dropped at a token the sampler could not draw
        self._cache_arg = cache_argument(model)

    @torch.inference_mode()
    def score_suffixes(
        self, prefix: Sequence[int], suffixes: Sequence[Sequence[int]], sampling: Sampling
    ) -> list[float]:
        from transformers import DynamicCache  # optional dep

        if not prefix:
            raise ValueError("target resolution needs a non-empty prefix (the prompt)")
        ids = torch.tensor([list(prefix)], dtype=torch.long, device=self.device)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids, **{self._cache_arg: cache}, use_cache=True, logits_to_keep=1
        )
        first = sampler_log_table(out.logits[0, -1:], sampling)[0]  # each suffix's first token
        self.prefix_tokens += len(prefix)
        scores = [0.0] * len(suffixes)  # an empty suffix adds nothing
        by_length: dict[int, list[int]] = {}
        for i, suffix in enumerate(suffixes):
            if not suffix:
                continue
            scores[i] = float(first[suffix[0]])
            if scores[i] == -math.inf:
                self.pruned += 1
            elif len(suffix) > 1:
                by_length.setdefault(len(suffix), []).append(i)
        for length, rows in by_length.items():
            # Options of one length run together, one row each, on copies of the prefix cache.
            group = copy.deepcopy(cache) if len(by_length) > 1 else cache
            group.batch_repeat_interleave(len(rows))
            fed = 0  # suffix tokens run so far; row t of a chunk predicts suffix[fed + t + 1]
            while rows and fed < length - 1:
                stop = min(length - 1, fed + self.chunk_tokens)
                step = torch.tensor(
                    [list(suffixes[i][fed:stop]) for i in rows],
                    dtype=torch.long,
                    device=self.device,
                )
                logits = self.model(
                    input_ids=step, **{self._cache_arg: group}, use_cache=True
                ).logits
                self.suffix_tokens += len(rows) * (stop - fed)
                alive = []
                for r, i in enumerate(rows):
                    wanted = torch.tensor(suffixes[i][fed + 1 : stop + 1], device=logits.device)
                    table = sampler_log_table(logits[r], sampling)
                    scores[i] += float(table.gather(1, wanted[:, None]).sum())
                    if scores[i] > -math.inf:
                        alive.append(r)
                if len(alive) < len(rows):
                    self.pruned += len(rows) - len(alive)
                    rows = [rows[r] for r in alive]
                    if rows:
                        group.batch_select_indices(torch.tensor(alive, device=self.device))
                fed = stop
        return scores


def cache_argument(model: Any) -> str:
    """The name `model.forward` takes its KV cache by: `cache` in transformers 5.2x,
    `past_key_values` in earlier 5.x (5.8.1, which SGLang's venv pins). A wrong name is
    swallowed by **kwargs, and every suffix would then run without its prefix."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes no KV cache argument")


def full_sequence_logprobs(model: Any, ids: Sequence[int], start: int, sampling: Sampling) -> float:
    """Reference for tests and audits: the same sum from one plain forward over all of `ids`
    (tokens `start`.. scored), no cache."""
    with torch.inference_mode():
        device = next(model.parameters()).device
        logits = model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False).logits
    return sum(sampled_logprobs(logits[0, start - 1 : len(ids) - 1], list(ids[start:]), sampling))


# --------------------------------------------------------------------------- decision


def decide(
    logprobs: Sequence[float], min_posterior: float, unlisted: Sequence[float] = ()
) -> dict[str, Any]:
    """Posterior over the options from their log-probabilities; the numbers of `resolution`.
    `unlisted`: log upper bounds on what a bounded open set leaves unlisted
    (extraction/gap_bounds.py), rivals of every option: the posterior is then a lower bound."""
    if unlisted:
        return _with_unlisted(decide(logprobs, min_posterior), logprobs, unlisted, min_posterior)
    n = len(logprobs)
    impossible = [i for i, lp in enumerate(logprobs) if lp == -math.inf]
    order = sorted(range(n), key=lambda i: -logprobs[i])
    best = order[0]
    if logprobs[best] == -math.inf:
        return {
            "n": n, "chosen": None, "posterior": None, "margin": None,
            "impossible": impossible, "logprobs": [None] * n, "resolved": False,
        }  # fmt: skip
    top = logprobs[best]
    weights = [math.exp(lp - top) if lp != -math.inf else 0.0 for lp in logprobs]
    posterior = 1.0 / sum(weights)
    second = logprobs[order[1]] if n > 1 else -math.inf
    return {
        "n": n,
        "chosen": best,
        "posterior": posterior,
        # log-odds best vs second best (nats); null when the second is impossible (infinite)
        "margin": None if second == -math.inf else top - second,
        "impossible": impossible,
        "logprobs": [None if lp == -math.inf else lp for lp in logprobs],
        "resolved": posterior >= min_posterior,
    }


def _with_unlisted(
    numbers: dict[str, Any],
    logprobs: Sequence[float],
    unlisted: Sequence[float],
    min_posterior: float,
) -> dict[str, Any]:
    """`numbers` with the unlisted bounds among the chosen option's rivals."""
    out = {**numbers, "bound": "lower", "unlisted": len(unlisted)}
    best = numbers["chosen"]
    if best is None:
        return out
    top = logprobs[best]
    finite = [u for u in unlisted if u > -math.inf]
    out["posterior"] = 1.0 / (1.0 / numbers["posterior"] + sum(math.exp(u - top) for u in finite))
    strongest = max(finite, default=-math.inf)
    if strongest > -math.inf and (numbers["margin"] is None or top - strongest < numbers["margin"]):
        out["margin"] = top - strongest
    out["resolved"] = out["posterior"] >= min_posterior
    return out


@dataclass(frozen=True)
class _Chain:
    """One option walked through its choice points, the likeliest alternative taken at each."""

    logprob: float  # log P(the chain's whole output | prompt)
    choices: list[int]
    # log P of each sequence that leaves the chain at a point (its output up to that point's
    # end): an upper bound on the mass of every continuation of it.
    departures: list[float]


def _walk(
    prompt: list[int], option: Mapping[str, Any], scorer: SuffixScorer, sampling: Sampling
) -> _Chain:
    ids = list(option["output_ids"])
    total, end = 0.0, 0  # log P(ids[:end] | prompt)
    choices: list[int] = []
    departures: list[float] = []
    for point in option.get("points") or []:
        at, alternatives = point["at"], point["alternatives"]
        between = ids[end:at]
        scores = scorer.score_suffixes(
            prompt + ids[:end], [between + a for a in alternatives], sampling
        )
        best = max(range(len(scores)), key=lambda i: scores[i])
        departures += [total + lp for i, lp in enumerate(scores) if i != best and lp > -math.inf]
        total += scores[best]
        choices.append(best)
        if total == -math.inf:
            # No alternative can be drawn here: every sequence through this option is impossible.
            return _Chain(
                -math.inf, choices + [0] * (len(option["points"]) - len(choices)), departures
            )
        ids[at : at + len(alternatives[best])] = alternatives[best]
        end = at + len(alternatives[best])
    if end < len(ids):
        total += scorer.score_suffixes(prompt + ids[:end], [ids[end:]], sampling)[0]
    return _Chain(total, choices, departures)


def decide_points(
    prompt: list[int],
    options: Sequence[Mapping[str, Any]],
    scorer: SuffixScorer,
    sampling: Sampling,
    settings: ResolveSettings,
    unlisted: Sequence[float] = (),
) -> dict[str, Any]:
    """Options with choice points (core/candidates.ChoicePoint) stand for every combination of
    their alternatives, too many to score one by one. Each option is walked point by point,
    the likeliest alternative kept at each (`_walk`); every sequence that leaves the walk at a
    point is counted at its probability up to that point's end, which bounds the total of all
    its continuations (distinct continuations of one prefix are disjoint events). So
    `posterior` is a LOWER BOUND on the chosen sequence's posterior among all of them:
    resolved only when even the bound reaches resolve.min_posterior."""
    chains = [_walk(prompt, o, scorer, sampling) for o in options]
    logprobs = [c.logprob for c in chains]
    n = len(options)
    impossible = [i for i, lp in enumerate(logprobs) if lp == -math.inf]
    best = max(range(n), key=lambda i: logprobs[i])
    departures = [lp for c in chains for lp in c.departures]
    listed = {"n": n, "impossible": impossible, "bound": "lower", "departures": len(departures)}
    if logprobs[best] == -math.inf:
        return {
            **listed, "chosen": None, "choices": None, "posterior": None, "margin": None,
            "logprobs": [None] * n, "resolved": False,
        }  # fmt: skip
    rivals = [lp for i, lp in enumerate(logprobs) if i != best] + departures + list(unlisted)
    if unlisted:
        listed["unlisted"] = len(unlisted)  # bounds of a bounded open set's gaps
    top = logprobs[best]
    mass = 1.0 + sum(math.exp(lp - top) for lp in rivals if lp > -math.inf)
    second = max(rivals, default=-math.inf)
    posterior = 1.0 / mass
    return {
        **listed,
        "chosen": best,
        "choices": chains[best].choices,
        "posterior": posterior,
        "margin": None if second == -math.inf else top - second,
        "logprobs": [None if lp == -math.inf else lp for lp in logprobs],
        "resolved": posterior >= settings.min_posterior,
    }


def _prefix_logprob(
    scorer: SuffixScorer, record: Mapping[str, Any], prefix: Sequence[int], sampling: Sampling
) -> float:
    """log P(the options' shared output ids | prompt): `prefix` is prompt + those ids."""
    prompt = list(record.get("prompt_ids") or [])
    shared = list(prefix[len(prompt) :])
    return scorer.score_suffixes(prompt, [shared], sampling)[0] if shared else 0.0


def option_ids(option: Mapping[str, Any], choices: Sequence[int] | None) -> list[int]:
    """An option's ids with alternative `choices[k]` at its k-th choice point."""
    ids = list(option["output_ids"])
    for point, choice in zip(option.get("points") or [], choices or [], strict=True):
        chosen = point["alternatives"][choice]
        ids[point["at"] : point["at"] + len(chosen)] = chosen
    return ids


def apply_resolution(
    record: Mapping[str, Any], numbers: Mapping[str, Any], extra: Mapping[str, Any]
) -> TokenRecord:
    """The record after scoring (pure): rewritten with the chosen option when resolved, else
    kept unresolved with `resolution` and issue `target_unresolved` (LADDER.md)."""
    out = cast(TokenRecord, dict(record))
    out["resolution"] = {
        "method": "target",
        **extra,
        **{k: v for k, v in numbers.items() if k != "resolved"},
    }
    issues = [c for c in (record.get("issues") or []) if c != TARGET_UNRESOLVED]
    if not numbers["resolved"]:
        out["issues"] = [*issues, TARGET_UNRESOLVED]
        out["ok"] = False
        out["evidence"] = UNRESOLVED
        return with_prefix(out)  # the options' shared prefix stays proven (core/prefix.py)
    option = record["candidates"]["options"][numbers["chosen"]]
    covered = covered_issues(record["candidates"])
    moved = [c for c in issues if c in covered]
    out["issues"] = [c for c in issues if c not in covered]
    notes = list(record.get("notes") or [])
    out["notes"] = list(dict.fromkeys([*notes, RESOLVED_NOTE, *moved]))
    # Choice points: the alternative chosen at each (same lengths, so the mask holds).
    out["output_ids"] = option_ids(option, numbers.get("choices"))
    prompt_len = len(record.get("prompt_ids") or [])
    mask = list(option["loss_mask"])
    # An option's mask may cover the output only or, as a record's does, prompt + output.
    if len(mask) == len(option["output_ids"]):
        mask = list(record["loss_mask"][:prompt_len]) + mask
    if len(mask) != prompt_len + len(option["output_ids"]):
        raise ValueError(f"record {record.get('id')!r}: option loss_mask has the wrong length")
    out["loss_mask"] = mask
    out["completion_tokens_reconstructed"] = len(option["output_ids"])
    out["ok"] = True
    out["evidence"] = TARGET_RESOLVED
    out.pop("prefix", None)  # the whole answer is resolved now
    return out


def score_record(
    record: Mapping[str, Any],
    scorer: SuffixScorer,
    settings: ResolveSettings,
    *,
    unlisted: Sequence[float] | None = None,
) -> TokenRecord | None:
    """Score one resolvable record; the updated record, or None when it cannot be scored
    (no known temperature, too many options). A bounded open set needs `unlisted`, its gaps'
    bounds under the same sampling (extraction/gap_bounds.py)."""
    sampling = settings.sampling_of(record)
    if sampling is None:
        return None
    cands = record["candidates"]
    options = cands["options"]
    if len(options) > settings.max_options:
        return None
    if cands.get("closed") is not True and unlisted is None:
        raise ValueError(
            f"record {record.get('id')!r}: an open set is scored with its gaps' bounds"
        )
    rivals = list(unlisted or [])
    if any(o.get("points") for o in options):
        numbers = decide_points(
            list(record.get("prompt_ids") or []), options, scorer, sampling, settings, rivals
        )
    else:
        diverge = int(cands["diverge_at"])
        first = options[0]["output_ids"]
        prefix = list(record.get("prompt_ids") or []) + list(first[:diverge])
        suffixes = [list(o["output_ids"][diverge:]) for o in options]
        logprobs = scorer.score_suffixes(prefix, suffixes, sampling)
        # The suffixes' log-probabilities leave out the shared prefix the bounds include.
        shared = _prefix_logprob(scorer, record, prefix, sampling) if rivals else 0.0
        numbers = decide([lp + shared for lp in logprobs], settings.min_posterior, rivals)
    extra = {
        "model": scorer.model_name,
        "min_posterior": settings.min_posterior,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "slack": {"nucleus": sampling.slack, "greedy": sampling.greedy_slack},
        **({"top_k": sampling.top_k} if sampling.top_k is not None else {}),
        **({"min_p": sampling.min_p} if sampling.min_p else {}),
    }
    return apply_resolution(record, numbers, extra)


# --------------------------------------------------------------------------- records file


def _line_id(raw: bytes) -> tuple[str | None, dict[str, Any] | None]:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None, None
    if not isinstance(obj, dict) or obj.get("id") is None:
        return None, None
    return str(obj["id"]), obj


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw.rstrip(b"\n")).hexdigest()


@contextlib.contextmanager
def records_lock(records: Path, timeout_s: float) -> Iterator[None]:
    """The run directory's lock (store/run_lock.py; the one generate holds while it appends):
    a rewrite must not race an appender, whose writes would go to the replaced file. Waits
    for other extract shards (seconds); a generate still running makes it fail after
    `timeout_s`."""
    why = (
        f"target resolution rewrites {records.name} and must wait for it (rerun extract "
        "after it ends)"
    )
    with run_dir_lock(records.parent, timeout_s, why):
        yield


def rewrite_records(
    records: str | os.PathLike[str],
    updates: Mapping[str, tuple[str, TokenRecord]],
) -> int:
    """Replace the last line of each id in `updates` ({id: (digest of the line that was
    scored, new record)}) and write the file anew through store/atomic.py (tmp + fsync +
    rename + fsync of the directory; a link planted at the temporary name is refused).
    Every other byte is kept as it was (bad lines, a torn tail). A line that
    changed since it was scored is left alone. Returns the number of lines replaced.
    Call under `records_lock`."""
    path = Path(records)
    lines = path.read_bytes().splitlines(keepends=True)
    last: dict[str, int] = {}
    for i, raw in enumerate(lines):
        sid, _ = _line_id(raw)
        if sid is not None:
            last[sid] = i
    replaced = 0
    for sid, (digest, new) in updates.items():
        at = last.get(sid)
        if at is None or _digest(lines[at]) != digest:
            log.warning("%s: record %r changed since it was scored; left as it is", path, sid)
            continue
        text = json.dumps(new, ensure_ascii=False, separators=(",", ":"))
        lines[at] = text.encode("utf-8", "replace") + b"\n"
        replaced += 1
    if not replaced:
        return 0
    # Whole, or not at all: tmp + fsync + rename + fsync of the directory (store/atomic.py).
    write_bytes(
        path,
        b"".join(lines),
        suffix=".resolve.tmp",
        mode=path.stat().st_mode & 0o777,
    )
    return replaced
