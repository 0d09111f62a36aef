"""Kimi's vocabulary as Moonshot's slow `TikTokenTokenizer` sees it, from its two data files
(`tiktoken.model`, `tokenizer_config.json`); standard library only.

Shared by the tokenizer views that run inside a server's venv: the worker of
tools/make_server_fixtures.py (run there as this directory's script) and
tools/live_vllm/kimi_live_plugin.py (tools/make_live_vllm_corpus.py copies this file
beside it into the vLLM venv's site-packages).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, NamedTuple


class KimiVocab(NamedTuple):
    ranks: dict[int, bytes]  # BPE id -> its bytes
    added: dict[int, str]  # added / reserved token id -> its name
    special: list[str]  # bos, eos, unk, pad and the additional special tokens, by name
    config: dict[str, Any]  # tokenizer_config.json


def load_kimi_vocab(tokenizer_dir: Path) -> KimiVocab:
    ranks: dict[int, bytes] = {}
    for line in (tokenizer_dir / "tiktoken.model").read_text().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[int(rank)] = base64.b64decode(token)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    added = {int(i): v["content"] for i, v in config["added_tokens_decoder"].items()}
    for i in range(len(ranks), len(ranks) + 256):
        added.setdefault(i, f"<|reserved_token_{i}|>")
    special = [config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")]
    special += list(config.get("additional_special_tokens") or [])
    return KimiVocab(ranks, added, special, config)


def byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (how slow byte-level tokenizers name tokens)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table
