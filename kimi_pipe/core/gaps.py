"""Where a reading short of its bill can differ from the sequences it stands for (pure: no IO).

A stack that drops whitespace (a reasoning's tail, a whitespace-only content before tool
calls, the arguments' edges: tests/test_dropped_whitespace.py) returns the same message for
every amount and spelling of it, so a reading a few ids short of the bill stands for more
sequences than can be listed: the reading with whitespace put back at the edges of its text
pieces. Such a reading is a *gap* of its candidate set (core/candidates.py, `Gap`). Every
sequence it stands for agrees with it up to some position and there takes an id of one class:

* inside a text piece with remaining bytes R: an id whose bytes are a prefix of R, or R
  followed by whitespace (R with whitespace appended, split another way);
* at a piece's first id, also whitespace before that (a prefix of ws + R + ws);
* where the reading has a marker (or its answer could go on after its last id): whitespace
  only (a whitespace piece the reading lacks);
* but inside a tool-call section, where the reading has a marker right after another, or
  after the section: any id (None). A parser may drop any text there, not only whitespace
  (vLLM 0.34's Kimi parser stays in a tool state after the section "so trailing model text
  after native tool calls is suppressed", vllm/parser/kimi_k2.py).

Before `start` every such sequence has the reading's own ids (the ids before the reasoning's
last lone space: core/candidates.py `_reasoning_head`). Target resolution weighs the mass of
those classes along the reading: an upper bound on everything the gap stands for
(extraction/gap_bounds.py). "Whitespace" is what Python's `str.strip()` removes, as the
stacks strip it; a character may be cut inside its UTF-8 bytes at a token's end.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from kimi_pipe.core.splits import Vocabulary

# Every character `str.isspace()` accepts (tests/test_gaps.py checks the list against it).
WHITESPACE = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680"
    + "".join(chr(c) for c in range(0x2000, 0x200B))
    + "\u2028\u2029\u202f\u205f\u3000"
)
_WHITESPACE = tuple(ch.encode() for ch in WHITESPACE)
# Bytes that open a whitespace character without finishing it (a token may end there).
_CUT_WHITESPACE = frozenset(w[:n] for w in _WHITESPACE for n in range(1, len(w)))


def whitespace_run(data: bytes) -> bool:
    """`data` is whitespace characters, the last possibly cut inside its bytes."""
    return not _strip_tail(data)


def _strip_head(data: bytes) -> bytes:
    """`data` less the whole whitespace characters it starts with."""
    moved = True
    while moved and data:
        moved = False
        for w in _WHITESPACE:
            if data.startswith(w):
                data, moved = data[len(w) :], True
                break
    return data


def _strip_tail(data: bytes) -> bytes:
    """`data` less the whitespace it ends with (a cut character first, then whole ones)."""
    for n in range(min(3, len(data)), 0, -1):
        if data[-n:] in _CUT_WHITESPACE:
            data = data[:-n]
            break
    moved = True
    while moved and data:
        moved = False
        for w in _WHITESPACE:
            if data.endswith(w):
                data, moved = data[: -len(w)], True
                break
    return data


def core_of(data: bytes) -> bytes:
    """Bytes less the whitespace at both ends: the key the class lookup indexes by."""
    return _strip_tail(_strip_head(data))


def consistent(data: bytes, rest: bytes, *, piece_start: bool) -> bool:
    """Bytes a sequence of the gap can put where the reading has the rest of a piece `rest`
    (empty at a marker): a prefix of `rest` or `rest` + whitespace, after whitespace where a
    piece starts."""
    if piece_start:
        data = _strip_head(data)
        if whitespace_run(data):
            return True
    if not data:
        return False
    if rest.startswith(data):
        return True
    return data.startswith(rest) and whitespace_run(data[len(rest) :])


class _Index:
    """A vocabulary's ordinary ids by `core_of` their bytes (built once, seconds at most)."""

    def __init__(self, vocab: Vocabulary) -> None:
        if vocab.size <= 0:
            raise ValueError("gap classes need the vocabulary's size (Vocabulary.size)")
        self.by_core: dict[bytes, list[int]] = {}
        for token_id in range(vocab.size):
            data = vocab.token_bytes(token_id)
            if data and vocab.id_of_bytes(data) == token_id:
                self.by_core.setdefault(core_of(data), []).append(token_id)


_INDEXES: weakref.WeakKeyDictionary[Any, _Index] = weakref.WeakKeyDictionary()


def _index(vocab: Vocabulary) -> _Index:
    found = _INDEXES.get(vocab)
    if found is None:
        found = _INDEXES[vocab] = _Index(vocab)
    return found


def site_classes(
    ids: Sequence[int],
    start: int,
    vocab: Vocabulary,
    *,
    open_end: bool,
    section_start: int | None = None,
) -> list[list[int] | None]:
    """For each position from `start` to the reading's end (one more where `open_end`: the
    answer may go on after its last id), the other ids a sequence of the gap can have there;
    None: any id (a marker after a marker, or the end, past the tool-call section's opening
    marker at `section_start`)."""
    index = _index(vocab)
    ordinary = [vocab.ordinary(t) for t in ids]
    classes: list[list[int] | None] = []
    for k in range(start, len(ids) + (1 if open_end else 0)):
        if (
            section_start is not None
            and section_start < k
            and (k == len(ids) or not ordinary[k])
            and not ordinary[k - 1]
        ):
            classes.append(None)  # text a parser drops in a tool state: any of it
            continue
        own = ids[k] if k < len(ids) else None
        if k < len(ids) and ordinary[k]:
            end = k
            while end < len(ids) and ordinary[end]:
                end += 1
            rest = b"".join(vocab.token_bytes(t) for t in ids[k:end])
            piece_start = k == 0 or not ordinary[k - 1]
        else:
            rest, piece_start = b"", True
        keys = {core_of(rest[:n]) for n in range(min(vocab.max_token_bytes, len(rest)) + 1)}
        found = {
            t
            for key in keys
            for t in index.by_core.get(key, ())
            if t != own and consistent(vocab.token_bytes(t), rest, piece_start=piece_start)
        }
        classes.append(sorted(found))
    return classes
