"""The joined-tails cache of core/candidates.py is keyed by the tokenizer itself (issue 42): an
entry goes with its tokenizer, so a later tokenizer never reads another one's tails (an
`id()` key could be reused once the first tokenizer was evicted and collected)."""

from __future__ import annotations

import gc
from types import SimpleNamespace
from typing import Any

from kimi_pipe.core import candidates


class Vocab:
    def __init__(self, tokens: list[bytes]) -> None:
        self.tokens = tokens
        self.vocab_size = len(tokens)
        self.reads = 0

    def token_bytes(self, token_id: int) -> bytes:
        self.reads += 1
        return self.tokens[token_id]


def tails(tokenizer: Any) -> tuple[str, ...] | None:
    return candidates._joined_tails(SimpleNamespace(tokenizer=tokenizer))  # type: ignore[arg-type]


def test_each_tokenizer_has_its_own_tails_and_they_go_with_it() -> None:
    first = Vocab([b"a", b".\n", b"\n"])
    second = Vocab([b"b", b"!\r\n\r\n"])
    assert tails(first) == ("\n",)
    assert tails(second) == ("\r\n\r\n",)
    reads = first.reads
    assert tails(first) == ("\n",) and first.reads == reads  # cached: not listed again
    held = len(candidates._JOINED_TAILS)
    del first
    gc.collect()
    assert len(candidates._JOINED_TAILS) == held - 1  # its entry went with it
    for _ in range(50):  # new tokenizers (ids may be reused) list their own vocabulary
        fresh = Vocab([b"c", b"?\n\n"])
        assert tails(fresh) == ("\n\n",)
        del fresh
    assert tails(second) == ("\r\n\r\n",)


def test_a_tokenizer_without_a_vocabulary_size_has_none() -> None:
    assert tails(SimpleNamespace()) is None
