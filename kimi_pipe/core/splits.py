"""Every split of a record's text that the target's sampler could have drawn (pure: no IO).

Re-encoding a returned text gives its canonical ids. An engine samples token by token, and
at temperature > 0 it sometimes draws a *non-canonical* split of the same text (`" Pant"` +
`"om"` where BPE gives one token). Where the split has another length, billing sees it; at
the same length, text + billing cannot. The target model can: the extract stage runs it over
every record anyway, and under the sampling the request sent (its `top_p` nucleus, `top_k`,
temperature 0) most other splits are *impossible*, not merely unlikely.

`search_splits` walks every path of ordinary tokens that spells the record's text, the same
way a sampler would: it leaves the record's ids only where the target gives another token
that matches the text a non-zero probability, follows that branch token by token while the
sampler could still draw it, and completes it where it meets the record's ids again at the
billed length. What it returns is a closed set of paths (the record's own and the others)
with their log-probabilities, or says why it is not closed (`limits`). Two simplifications,
both stated in `SplitSearch`:

* a branch that met the record's ids again follows them to the end (a second, independent
  departure later is the product of two rare draws and is not enumerated);
* under `top_p` = 1 nothing is impossible, so a branch whose first tokens are `min_ratio`
  times less likely than the record's own over the same bytes is not followed; the search
  counts them (`pruned`) and its posterior is then approximate.

Scoring is the caller's (`NextTokenScorer`): this module only decides what to ask.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class NextTokenScorer(Protocol):
    """The sampler's log-probabilities along a sequence, from one forward of the target."""

    def logprobs_along(
        self, ids: Sequence[int], start: int, wanted: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """For each i < len(wanted): log P(w | ids[:start + i]) under the request's sampling,
        for every w in wanted[i] (-inf where the sampler could not draw w). `wanted` may be
        one longer than ids[start:] (the last entry asks for the token after the end)."""
        ...


@dataclass(frozen=True)
class Vocabulary:
    """What the search needs of a tokenizer: bytes of an id, id of bytes (ordinary only)."""

    token_bytes: Callable[[int], bytes]
    id_of_bytes: Callable[[bytes], int | None]
    max_token_bytes: int

    def ordinary(self, token_id: int) -> bool:
        return self.id_of_bytes(self.token_bytes(token_id)) == token_id

    def matching(self, data: bytes, offset: int) -> list[int]:
        """Every ordinary id whose bytes are `data[offset:offset + n]` for some n >= 1."""
        found = []
        for n in range(1, min(self.max_token_bytes, len(data) - offset) + 1):
            token_id = self.id_of_bytes(data[offset : offset + n])
            if token_id is not None:
                found.append(token_id)
        return found


@dataclass(frozen=True)
class SplitPath:
    output_ids: tuple[int, ...]
    logprob: float
    diverge_at: int  # first output index where it leaves the record's ids
    window: int = 0  # record ids replaced by the branch (from diverge_at)


@dataclass
class SplitSearch:
    """The closed set of paths, or the limits that left it open."""

    record_logprob: float  # the record's own ids; -inf: the sampler could not have drawn them
    record_fits_billing: bool
    others: list[SplitPath] = field(default_factory=list)
    suspects: int = 0  # positions where another matching token had non-zero probability
    suspect_at: list[int] = field(default_factory=list)  # those output positions
    branches: int = 0  # branch nodes scored (one forward each)
    pruned: int = 0  # branches not followed under top_p = 1 (approximate posterior)
    limits: list[str] = field(default_factory=list)  # why the set is not closed

    @property
    def closed(self) -> bool:
        return not self.limits

    def options(self, record_ids: Sequence[int]) -> list[SplitPath]:
        """Every path billing allows: the record's own (when its length fits) and the others."""
        own = [SplitPath(tuple(record_ids), self.record_logprob, len(record_ids))]
        return (own if self.record_fits_billing else []) + self.others


def _segments(ids: Sequence[int], vocab: Vocabulary) -> list[tuple[int, int]]:
    """[start, end) runs of ordinary ids (special ids are fixed: text never becomes them)."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, token_id in enumerate(ids):
        if vocab.ordinary(token_id):
            if start is None:
                start = i
        elif start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(ids)))
    return runs


def search_splits(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    billed: int | None,
    vocab: Vocabulary,
    scorer: NextTokenScorer,
    *,
    max_window: int = 8,
    max_branches: int = 256,
    min_ratio: float = 1e-9,
) -> SplitSearch:
    """Every path of ordinary tokens that spells `output_ids`' text, has `billed` tokens and
    that the sampler could have drawn (see the module doc for the two simplifications).
    `billed` None: the count is unknown, so a branch may end at any length."""
    prompt = list(prompt_ids)
    out = list(output_ids)
    segments = _segments(out, vocab)
    wanted: list[list[int]] = [[t] for t in out]
    # output index -> (segment bytes, its tokens' offsets in it, segment start and end index,
    # fewest tokens that can spell the segment's bytes from each offset)
    data_of: dict[int, tuple[bytes, list[int], int, int, list[int]]] = {}
    for seg_start, seg_end in segments:
        pieces = [vocab.token_bytes(t) for t in out[seg_start:seg_end]]
        data = b"".join(pieces)
        offsets = [0]
        for piece in pieces:
            offsets.append(offsets[-1] + len(piece))
        fewest = _fewest_tokens(data, vocab)
        for k in range(seg_start, seg_end):
            data_of[k] = (data, offsets, seg_start, seg_end, fewest)
            others = [t for t in vocab.matching(data, offsets[k - seg_start]) if t != out[k]]
            wanted[k].extend(others)
    rows = scorer.logprobs_along(prompt + out, len(prompt), wanted) if out else []
    own = [row[0] for row in rows]
    record_logprob = sum(own) if all(lp > -math.inf for lp in own) else -math.inf
    search = SplitSearch(record_logprob, billed is None or len(out) == billed)
    before = [0.0]  # log P of the record's first k ids (prefix sums; -inf once impossible)
    for lp in own:
        before.append(before[-1] + lp)
    log_ratio = math.log(min_ratio)

    for k in sorted(data_of):
        if before[k] == -math.inf:
            break  # the record's own prefix is impossible here: nothing after it is reachable
        data, offsets, seg_start, seg_end, fewest = data_of[k]
        alive = [
            (t, lp) for t, lp in zip(wanted[k][1:], rows[k][1:], strict=True) if lp > -math.inf
        ]
        if not alive:
            continue
        search.suspects += 1
        search.suspect_at.append(k)
        # Depth-first over the branch's tokens: (branch ids, bytes offset reached, log P).
        stack = [([t], offsets[k - seg_start] + len(vocab.token_bytes(t)), lp) for t, lp in alive]
        while stack:
            branch, reached, lp_branch = stack.pop()
            rel = _first_at_or_after(offsets, reached)
            covered = before[seg_start + rel] - before[k]  # the record's own ids over those bytes
            if own_fits(covered, lp_branch, log_ratio):
                search.pruned += 1
                continue
            if offsets[rel] == reached:  # back on one of the record's token boundaries
                j = seg_start + rel
                if billed is None or k + len(branch) + (len(out) - j) == billed:
                    tail = out[j:]
                    ids = prompt + out[:k] + branch + tail
                    at = len(prompt) + k + len(branch)
                    scored = scorer.logprobs_along(ids, at, [[t] for t in tail]) if tail else []
                    search.branches += 1
                    lp_tail = sum(r[0] for r in scored)
                    total = before[k] + lp_branch + lp_tail
                    if total > -math.inf:
                        path = tuple(out[:k] + branch + tail)
                        search.others.append(SplitPath(path, total, k, j - k))
                    continue
            if reached >= len(data):
                continue  # the segment ends with the wrong count: billing rules it out
            if billed is not None:
                # Ids left for the rest of the segment at the billed length; a branch that
                # cannot spell the rest in so few can never come back to it.
                room = billed - (k + len(branch)) - (len(out) - seg_end)
                if fewest[reached] > room:
                    continue
            if len(branch) >= max_window:
                search.limits.append(f"branch longer than {max_window} ids at output {k}")
                continue
            if search.branches >= max_branches:
                search.limits.append(f"more than {max_branches} branches")
                return search
            nexts = vocab.matching(data, reached)
            if offsets[rel] == reached:
                # Back on the record's ids at the wrong length: going on with them would need a
                # second departure to come back to the billed length (not enumerated).
                nexts = [t for t in nexts if t != out[seg_start + rel]]
            if not nexts:
                continue
            ids = prompt + out[:k] + branch
            next_lps = scorer.logprobs_along(ids, len(ids), [nexts])[0]
            search.branches += 1
            for t, lp in zip(nexts, next_lps, strict=True):
                if lp > -math.inf:
                    stack.append(
                        ([*branch, t], reached + len(vocab.token_bytes(t)), lp_branch + lp)
                    )
    return search


@dataclass(frozen=True)
class FirstSteps:
    """`first_steps`' answer: (record position, tokens) pairs, and how many of the record's
    positions start before the first differing byte (a departure there is the record's own)."""

    steps: list[tuple[int, list[int]]]
    shared: int


def first_steps(
    record_ids: Sequence[int], reading_ids: Sequence[int], vocab: Vocabulary
) -> FirstSteps | None:
    """How a split of another reading can first leave the record's ids, when it follows them up
    to the text's first difference: every (record position j, tokens) such that the record's
    ids before j spell the shared text and each token, starting there, spells the reading's
    bytes across its first differing byte; and how many record positions start before that
    byte (a split that departs from the record's ids at one of them does so with a token the
    record's own search scored, since it matches the shared text). None
    when the difference is not inside ordinary text of both (the caller then searches)."""
    rec_bytes = [vocab.token_bytes(t) for t in record_ids]
    alt_bytes = [vocab.token_bytes(t) for t in reading_ids]
    rec_data, alt_data = b"".join(rec_bytes), b"".join(alt_bytes)
    g = next(
        (i for i, (x, y) in enumerate(zip(rec_data, alt_data, strict=False)) if x != y),
        min(len(rec_data), len(alt_data)),
    )
    if g >= len(rec_data) or g >= len(alt_data):
        return None  # one text is a prefix of the other: no byte to step across

    def covering(pieces: list[bytes], ids: Sequence[int]) -> tuple[int, int, int] | None:
        """(start byte, end byte) of the ordinary run holding byte g, and its token index."""
        offset, lo = 0, 0
        for i, (piece, token_id) in enumerate(zip(pieces, ids, strict=True)):
            if not vocab.ordinary(token_id):
                if offset <= g < offset + len(piece):
                    return None
                lo = offset + len(piece)
            elif offset <= g < offset + len(piece):
                hi = offset
                for later, later_id in zip(pieces[i:], ids[i:], strict=True):
                    if not vocab.ordinary(later_id):
                        break
                    hi += len(later)
                return lo, hi, i
            offset += len(piece)
        return None

    alt_run = covering(alt_bytes, reading_ids)
    if alt_run is None:
        return None  # the reading has a marker there: the caller searches
    alt_lo, alt_hi, _ = alt_run
    # The record's token holding byte g may be a marker (a hidden space before it): the split
    # still follows the record's ids before it.
    starts = [0]
    for piece in rec_bytes:
        starts.append(starts[-1] + len(piece))
    cover = max(i for i in range(len(rec_bytes)) if starts[i] <= g)
    steps: list[tuple[int, list[int]]] = []
    offset, shared = 0, 0
    for j, piece in enumerate(rec_bytes[: cover + 1]):
        shared += offset < g
        if alt_lo <= offset <= g and offset + vocab.max_token_bytes > g:
            tokens = [
                t
                for t in vocab.matching(alt_data[:alt_hi], offset)
                if offset + len(vocab.token_bytes(t)) > g
            ]
            if tokens:
                steps.append((j, tokens))
        offset += len(piece)
    return FirstSteps(steps, shared)


def own_fits(covered: float, branch: float, log_ratio: float) -> bool:
    """A branch min_ratio times less likely than the record's ids over at least its bytes is
    not followed (only reachable under top_p = 1, where nothing is impossible)."""
    return covered > -math.inf and branch - covered < log_ratio


def _first_at_or_after(offsets: Sequence[int], reached: int) -> int:
    for i, off in enumerate(offsets):
        if off >= reached:
            return i
    return len(offsets) - 1


def _fewest_tokens(data: bytes, vocab: Vocabulary) -> list[int]:
    """fewest[o]: the fewest ordinary tokens that spell data[o:] (len(data) + 1 entries)."""
    big = len(data) + 1
    fewest = [big] * (len(data) + 1)
    fewest[len(data)] = 0
    for o in range(len(data) - 1, -1, -1):
        for n in range(1, min(vocab.max_token_bytes, len(data) - o) + 1):
            if fewest[o + n] + 1 < fewest[o] and vocab.id_of_bytes(data[o : o + n]) is not None:
                fewest[o] = fewest[o + n] + 1
    return fewest
