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
sampler could still draw it, and where it meets the record's ids again scores the rest in
the new context: a path at the billed length, and the place of a next departure (two
departures of one id each can turn a canonical encoding into a sampled one two ids shorter).
What it returns is a closed set of paths (the record's own and the others) with their
log-probabilities, or says why it is not closed (`limits`):

* more than `max_departures` departures: where a path that left the ids that often could
  still leave them once more, the set is not closed (never assumed away);
* a branch longer than `max_window` ids, or more than `max_branches` forwards;
* under `top_p` = 1 nothing is impossible, so a branch whose first tokens are `min_ratio`
  times less likely than the path's own over the same bytes is not followed; the search
  counts them (`pruned`) and its posterior is then approximate.

Scoring is the caller's (`NextTokenScorer`): this module only decides what to ask.
"""

from __future__ import annotations

import contextlib
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
    size: int = 0  # ids 0 .. size - 1; 0: not known (core/gaps.py needs it)

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
    # every departure: (record index it leaves at, record ids it replaces, ids it puts there);
    # none for the record's own ids
    windows: tuple[tuple[int, int, int], ...] = ()


@dataclass
class SplitSearch:
    """The closed set of paths, or the limits that left it open."""

    record_logprob: float  # the record's own ids; -inf: the sampler could not have drawn them
    record_fits_billing: bool
    others: list[SplitPath] = field(default_factory=list)
    suspects: int = 0  # positions where another matching token had non-zero probability
    suspect_at: list[int] = field(default_factory=list)  # those output positions
    branches: int = 0  # forwards run for branches and their tails
    pruned: int = 0  # branches not followed under top_p = 1 (approximate posterior)
    limits: list[str] = field(default_factory=list)  # why the set is not closed

    @property
    def closed(self) -> bool:
        return not self.limits

    def options(self, record_ids: Sequence[int]) -> list[SplitPath]:
        """Every path billing allows: the record's own (when its length fits) and the others."""
        own = [SplitPath(tuple(record_ids), self.record_logprob)]
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


@dataclass(frozen=True)
class _Segment:
    """One run of ordinary record ids: its bytes, its tokens' offsets in them, its index range
    and the fewest tokens that spell its bytes from each offset."""

    data: bytes
    offsets: list[int]
    start: int
    end: int
    fewest: list[int]


class _Exhausted(Exception):
    """The branch budget ran out (the search's limits say so)."""


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
    max_departures: int = 3,
) -> SplitSearch:
    """Every path of ordinary tokens that spells `output_ids`' text, has `billed` tokens and
    that the sampler could have drawn, up to `max_departures` departures from the record's
    ids (see the module doc). `billed` None: the count is unknown, so a path may end at any
    length."""
    prompt = list(prompt_ids)
    out = list(output_ids)
    n_out = len(out)
    segment_of: dict[int, _Segment] = {}
    for seg_start, seg_end in _segments(out, vocab):
        pieces = [vocab.token_bytes(t) for t in out[seg_start:seg_end]]
        data = b"".join(pieces)
        offsets = [0]
        for piece in pieces:
            offsets.append(offsets[-1] + len(piece))
        segment = _Segment(data, offsets, seg_start, seg_end, _fewest_tokens(data, vocab))
        for k in range(seg_start, seg_end):
            segment_of[k] = segment
    # Every other ordinary token spelling the text from a record position on (the same at
    # that position of any path that follows the record's ids there).
    alternatives = {
        k: [t for t in vocab.matching(s.data, s.offsets[k - s.start]) if t != out[k]]
        for k, s in segment_of.items()
    }
    # Fewest and most ids that can spell the record's text from the end of a segment on.
    after_min, after_max = [0] * (n_out + 1), [0] * (n_out + 1)
    for i in range(n_out - 1, -1, -1):
        s = segment_of.get(i)
        if s is None:
            after_min[i], after_max[i] = after_min[i + 1] + 1, after_max[i + 1] + 1
        elif i == s.start:
            after_min[i] = s.fewest[0] + after_min[s.end]
            after_max[i] = len(s.data) + after_max[s.end]
        else:
            after_min[i], after_max[i] = after_min[i + 1], after_max[i + 1]

    def wanted_from(j: int) -> list[list[int]]:
        return [[out[x], *alternatives.get(x, [])] for x in range(j, n_out)]

    rows = scorer.logprobs_along(prompt + out, len(prompt), wanted_from(0)) if out else []
    own = [row[0] for row in rows]
    record_logprob = sum(own) if all(lp > -math.inf for lp in own) else -math.inf
    search = SplitSearch(record_logprob, billed is None or n_out == billed)
    log_ratio = math.log(min_ratio)
    seen: set[tuple[int, ...]] = set()

    def prefix_sums(start: float, lps: Sequence[float]) -> list[float]:
        sums = [start]
        for lp in lps:
            sums.append(sums[-1] + lp)
        return sums

    def explore(
        path: list[int],
        shift: int,
        scan_from: int,
        before: list[float],
        tail_rows: list[list[float]],
        windows: tuple[tuple[int, int, int], ...],
    ) -> None:
        """Departures from `path` at record positions >= scan_from. The path follows the
        record's ids from record position `scan_from` on (path index = record index + shift);
        `before[m]`: log P of its first m ids; `tail_rows[i]`: the sampler's log-probabilities
        of [path id, *alternatives] at record position scan_from + i, in the path's context."""
        for j in range(scan_from, n_out):
            m = j + shift
            if before[m] == -math.inf:
                return  # the path's prefix is impossible here: nothing after it is reachable
            segment = segment_of.get(j)
            if segment is None:
                continue
            row = tail_rows[j - scan_from]
            alive = [
                (t, lp) for t, lp in zip(alternatives[j], row[1:], strict=True) if lp > -math.inf
            ]
            if not alive:
                continue
            if not windows:
                search.suspects += 1
                search.suspect_at.append(j)
            if len(windows) >= max_departures:
                # Under top_p = 1 every token is drawable: the same ratio as a branch's
                # decides whether one more departure is worth an open set.
                if any(lp - row[0] >= log_ratio for _, lp in alive):
                    search.limits.append(f"more than {max_departures} departures from the ids")
                    return
                search.pruned += len(alive)
                continue
            branch_from(path, shift, j, before, alive, windows, segment)

    def branch_from(
        path: list[int],
        shift: int,
        k: int,
        before: list[float],
        alive: list[tuple[int, float]],
        windows: tuple[tuple[int, int, int], ...],
        s: _Segment,
    ) -> None:
        """Depth-first over the tokens of a departure at record position k (path index
        k + shift), until it meets the record's ids again."""
        m = k + shift
        start = s.offsets[k - s.start]
        stack = [([t], start + len(vocab.token_bytes(t)), lp) for t, lp in alive]
        while stack:
            branch, reached, lp_branch = stack.pop()
            rel = _first_at_or_after(s.offsets, reached)
            covered = before[s.start + rel + shift] - before[m]  # the path's ids over them
            if own_fits(covered, lp_branch, log_ratio):
                search.pruned += 1
                continue
            length = m + len(branch)  # path ids up to the branch's end
            if s.offsets[rel] == reached:  # back on one of the record's token boundaries
                j = s.start + rel
                total_len = length + n_out - j
                ends_here = billed is None or total_len == billed
                may_fix = billed is not None and after_min_at(
                    s, j
                ) <= billed - length <= after_max_at(s, j)
                if ends_here or may_fix:
                    rejoin(path, shift, k, j, branch, before, lp_branch, windows, ends_here)
            if reached >= len(s.data):
                continue  # the segment ends here; only a rejoin could go on
            # Ids left for the rest of the segment at the billed length (later segments at
            # their fewest: a later departure may shrink them); a branch that cannot spell
            # the rest in so few can never come back to it.
            if billed is not None and s.fewest[reached] > billed - length - after_min[s.end]:
                continue
            if len(branch) >= max_window:
                search.limits.append(f"branch longer than {max_window} ids at output {k}")
                continue
            if search.branches >= max_branches:
                search.limits.append(f"more than {max_branches} branches")
                raise _Exhausted
            nexts = vocab.matching(s.data, reached)
            if s.offsets[rel] == reached:
                # The record's id here is a rejoin (handled above), not part of the branch.
                nexts = [t for t in nexts if t != out[s.start + rel]]
            if not nexts:
                continue
            ids = prompt + path[:m] + branch
            next_lps = scorer.logprobs_along(ids, len(ids), [nexts])[0]
            search.branches += 1
            for t, lp in zip(nexts, next_lps, strict=True):
                if lp > -math.inf:
                    stack.append(
                        ([*branch, t], reached + len(vocab.token_bytes(t)), lp_branch + lp)
                    )

    def after_min_at(s: _Segment, j: int) -> int:
        return s.fewest[s.offsets[j - s.start]] + after_min[s.end]

    def after_max_at(s: _Segment, j: int) -> int:
        return len(s.data) - s.offsets[j - s.start] + after_max[s.end]

    def rejoin(
        path: list[int],
        shift: int,
        k: int,
        j: int,
        branch: list[int],
        before: list[float],
        lp_branch: float,
        windows: tuple[tuple[int, int, int], ...],
        ends_here: bool,
    ) -> None:
        """A departure at record position k that met the record's ids again at j: score the
        record's tail after it (in the new context), keep the path if billing allows it, and
        look for the next departure in that tail."""
        m = k + shift
        new_path = path[:m] + branch + out[j:]
        new_shift = m + len(branch) - j
        new_windows = (*windows, (k, j - k, len(branch)))
        # No budget check here: tails are bounded by the branch nodes, which are checked.
        at = len(prompt) + m + len(branch)
        tail_rows = (
            scorer.logprobs_along(prompt + new_path, at, wanted_from(j)) if j < n_out else []
        )
        search.branches += 1
        # Inside the branch only its total matters (no departure is looked for there).
        new_before = (
            before[: m + 1]
            + [before[m]] * (len(branch) - 1)
            + prefix_sums(before[m] + lp_branch, [r[0] for r in tail_rows])
        )
        total = new_before[-1]
        key = tuple(new_path)
        if ends_here and total > -math.inf and key not in seen:
            seen.add(key)
            search.others.append(SplitPath(key, total, new_windows))
        # The next departure takes at least the record's id at j first (a different id there
        # is this departure going on, which branch_from follows).
        if j + 1 <= n_out:
            explore(new_path, new_shift, j + 1, new_before, tail_rows[1:], new_windows)

    with contextlib.suppress(_Exhausted):  # the limit is recorded where it ran out
        explore(out, 0, 0, prefix_sums(0.0, own), rows, ())
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
