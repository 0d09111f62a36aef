"""Tokenizer loading: a native tiktoken loader and a Hugging Face backend.

Both expose the same small interface (`Tokenizer`): ordinary-text encoding that never
turns text into special ids, lookup of a marker's id, and decoding. Which backend and
which files are used is data in `conf/model/*.yaml` (`model.tokenizer`).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import tiktoken

from kimi_pipe.errors import ConfigError

STRICT_ENV = "KIMI_PIPE_STRICT"


class TokenizerNotFound(ConfigError, FileNotFoundError):
    """The tokenizer files could not be located; the message says how to provide them."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    # True when text is pre-split by a GPT-style pattern alone (tiktoken's pat_str, nothing
    # before it): a lone space between non-whitespace always starts a piece, so the text on
    # each side encodes as in the whole (core/reconstruction.py counts edge readings on that;
    # tests/test_edge_readings.py checks it on every shipped model). False: checked per text.
    splits_at_lone_spaces: bool

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode text as plain text: marker names inside it stay text. A new list on every
        call: the caller may keep and extend it (core/models.Model.encode does)."""
        ...

    def marker_id(self, name: str) -> int | None:
        """The single id the tokenizer gives the marker `name`, or None."""
        ...

    def encode_with_markers(self, text: str) -> list[int]:
        """Encode with every marker name recognised (trusted text only: validation, tests)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def piece(self, token_id: int) -> str:
        """Human-readable text of one id (for snapshots and error messages)."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one id (a special id: its name)."""
        ...

    def id_of_bytes(self, data: bytes) -> int | None:
        """The ordinary id whose bytes are exactly `data`, or None."""
        ...


@dataclass(frozen=True)
class TextChunking:
    """How a model's reference tokenizer cuts long text before BPE (`model.tokenizer.chunking`).

    Some reference tokenizers (tiktoken-based ones, to stay clear of tiktoken's stack limit on
    huge inputs) encode a string as consecutive slices of `max_chars` characters, each
    further cut wherever a run of whitespace or of non-whitespace characters grows longer
    than `max_run`. Where a cut falls inside what would be one BPE token the ids differ
    from a whole-string encode, so the prompt side must cut the same way to get the ids
    the server saw.
    """

    max_chars: int
    max_run: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> TextChunking:
        data = dict(cfg)
        unknown = set(data) - {"max_chars", "max_run"}
        if unknown:
            raise ValueError(f"unknown model.tokenizer.chunking keys: {sorted(unknown)}")
        try:
            chunking = cls(max_chars=int(data["max_chars"]), max_run=int(data["max_run"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"model.tokenizer.chunking needs integer max_chars and max_run, got {data!r}"
            ) from exc
        if chunking.max_chars < 1 or chunking.max_run < 1:
            raise ValueError(f"model.tokenizer.chunking values must be >= 1, got {data!r}")
        return chunking


def split_for_bpe(text: str, chunking: TextChunking | None) -> list[str]:
    """The slices the reference tokenizer encodes one by one (see `TextChunking`).

    Runs are whitespace as `str.isspace` sees it (the same class as `re`'s `\\s`), restart at
    each `max_chars` slice, and a run is cut before its (max_run + 1)-th character, then
    every max_run characters after. The slices join back to `text`.
    """
    if chunking is None or not text:
        return [text] if text else []
    if len(text) <= min(chunking.max_run, chunking.max_chars):
        return [text]  # nothing to cut: the common case costs one comparison
    long_run = _long_run_pattern(chunking.max_run)
    pieces: list[str] = []
    for offset in range(0, len(text), chunking.max_chars):
        part = text[offset : offset + chunking.max_chars]
        cut = 0
        # Anchored at run starts (lookbehind), so the scan stays linear in the text.
        for run in long_run.finditer(part):
            for at in range(run.start() + chunking.max_run, run.end(), chunking.max_run):
                pieces.append(part[cut:at])
                cut = at
        pieces.append(part[cut:])
    return pieces


@lru_cache(maxsize=8)
def _long_run_pattern(max_run: int) -> re.Pattern[str]:
    longer = f"{{{max_run + 1},}}"
    return re.compile(rf"(?<!\S)\S{longer}|(?<!\s)\s{longer}")


@dataclass(frozen=True)
class TokenizerSpec:
    """Where a tokenizer comes from (`model.tokenizer` in the model config)."""

    backend: str  # "tiktoken" | "hf"
    path: str | None = None
    path_env: str | None = None
    shared_dir: str | None = None  # folder name under ../shared/tokenizers
    package: str | None = None  # a Python package whose folder holds the files
    package_subdir: str = ""
    hf_repo: str | None = None
    files: tuple[str, ...] = ()
    ranks_file: str = "tiktoken.model"
    pat_str: str | None = None
    num_special: int = 0
    special_names: tuple[tuple[int, str], ...] = ()  # (id, name) pairs
    special_names_from: str | None = None  # a tokenizer_config.json with added_tokens_decoder
    reserved_name: str = "<|reserved_token_{id}|>"
    trust_remote_code: bool = False
    how_to_get: str = ""
    chunking: TextChunking | None = None  # how the reference encode cuts long text

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> TokenizerSpec:
        data = dict(cfg)
        data["files"] = tuple(data.get("files") or ())
        names = data.get("special_names") or {}
        data["special_names"] = tuple((int(k), str(v)) for k, v in dict(names).items())
        if isinstance(data.get("pat_str"), list | tuple):
            # Written as a list of alternatives in YAML for readability.
            data["pat_str"] = "|".join(data["pat_str"])
        if data.get("chunking") is not None:
            data["chunking"] = TextChunking.from_config(data["chunking"])
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model.tokenizer keys: {sorted(unknown)}")
        return cls(**data)


def resolve_tokenizer_dir(spec: TokenizerSpec) -> Path:
    """Find the tokenizer directory.

    Order: explicit `path`, then the environment variable `path_env`, then
    `../shared/tokenizers/<shared_dir>` beside the checkout or the working directory,
    then an installed package folder, then a `huggingface_hub` download (cached).
    """
    tried: list[str] = []
    candidates: list[Path] = []
    if spec.path:
        candidates.append(Path(spec.path).expanduser())
    if spec.path_env and os.environ.get(spec.path_env):
        candidates.append(Path(os.environ[spec.path_env]).expanduser())
    if spec.shared_dir:
        for base in (Path(__file__).resolve().parents[2], Path.cwd()):  # the checkout, the cwd
            candidates.append(base.parent / "shared" / "tokenizers" / spec.shared_dir)
    for candidate in candidates:
        tried.append(str(candidate))
        if _has_files(candidate, spec):
            return candidate
        if spec.path and candidate == Path(spec.path).expanduser():
            missing = [f for f in _required_files(spec) if not (candidate / f).is_file()]
            raise TokenizerNotFound(
                f"model.tokenizer.path={candidate} does not hold {missing}. "
                + (spec.how_to_get or "Point it at a directory with the tokenizer files.")
            )
    if spec.package:
        found = importlib.util.find_spec(spec.package)
        if found is not None and found.submodule_search_locations:
            folder = Path(next(iter(found.submodule_search_locations))) / spec.package_subdir
            tried.append(str(folder))
            if _has_files(folder, spec):
                return folder
    if spec.hf_repo:
        downloaded = _hub_download(spec)
        if downloaded is not None:
            return downloaded
        tried.append(f"huggingface_hub {spec.hf_repo}")
    raise TokenizerNotFound(
        "tokenizer files not found (tried: " + ", ".join(tried) + "). " + spec.how_to_get
    )


def _required_files(spec: TokenizerSpec) -> list[str]:
    if spec.files:
        return list(spec.files)
    if spec.backend == "tiktoken":
        return [spec.ranks_file]
    return ["tokenizer_config.json"]


def _has_files(folder: Path, spec: TokenizerSpec) -> bool:
    return folder.is_dir() and all((folder / f).is_file() for f in _required_files(spec))


def _hub_download(spec: TokenizerSpec) -> Path | None:
    """Data files only (never code) from the Hub; None when offline or not installed."""
    try:
        from huggingface_hub import hf_hub_download  # optional dep
    except ImportError:
        return None
    folder: Path | None = None
    try:
        for name in _required_files(spec):
            folder = Path(hf_hub_download(str(spec.hf_repo), name)).parent
    except Exception:  # offline, gated or missing: the caller reports what was tried
        return None
    return folder


def load_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    folder = resolve_tokenizer_dir(spec)
    if spec.backend == "tiktoken":
        return _load_tiktoken_cached(folder, spec)
    if spec.backend == "hf":
        return HFTokenizer(folder, trust_remote_code=spec.trust_remote_code)
    raise ValueError(f"unknown tokenizer backend {spec.backend!r} (expected tiktoken or hf)")


class TiktokenTokenizer:
    """BPE ranks file + special ids placed after the ranks (Kimi/Qwen layout)."""

    def __init__(self, folder: Path, spec: TokenizerSpec) -> None:

        if not spec.pat_str:
            raise ValueError("model.tokenizer.pat_str is required for the tiktoken backend")
        ranks = _read_ranks(folder / spec.ranks_file)
        first_special = len(ranks)
        names = dict(spec.special_names)
        if spec.special_names_from:
            names.update(_added_tokens(folder / spec.special_names_from))
        count = max(spec.num_special, (max(names) + 1 - first_special) if names else 0)
        specials: dict[str, int] = {}
        for token_id in range(first_special, first_special + count):
            specials[names.get(token_id, spec.reserved_name.format(id=token_id))] = token_id
        self.name = folder.name
        self._encoding = tiktoken.Encoding(
            name=f"kimi_pipe:{folder}",
            pat_str=spec.pat_str,
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        self._specials = specials
        self._special_names = {v: k for k, v in specials.items()}
        self._ranks = ranks  # bytes -> id of every ordinary token
        self._bytes_of: list[bytes] | None = None  # id -> bytes, built on first use
        self.vocab_size = first_special + count
        self.splits_at_lone_spaces = True

    def encode_ordinary(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def marker_id(self, name: str) -> int | None:
        return self._specials.get(name)

    def encode_with_markers(self, text: str) -> list[int]:
        """Encode with every special name recognised (used to validate markers only)."""
        return self._encoding.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(list(ids))

    def piece(self, token_id: int) -> str:
        if token_id in self._special_names:
            return self._special_names[token_id]
        return self._encoding.decode_single_token_bytes(token_id).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one id (a special id: its name)."""
        if self._bytes_of is None:
            # One table for the whole vocabulary: per-id calls into tiktoken cost more than
            # the rest of the logprob check together.
            table = [b""] * self.vocab_size
            for data, rank in self._ranks.items():
                table[rank] = data
            for name, special in self._specials.items():
                table[special] = name.encode()
            self._bytes_of = table
        return self._bytes_of[token_id]

    def id_of_bytes(self, data: bytes) -> int | None:
        """The ordinary (BPE) id whose bytes are exactly `data`; None when none is."""
        return self._ranks.get(data)


@lru_cache(maxsize=8)
def _load_tiktoken_cached(folder: Path, spec: TokenizerSpec) -> TiktokenTokenizer:
    return TiktokenTokenizer(folder, spec)


def _read_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with path.open("rb") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
            except ValueError as exc:
                raise ValueError(f"{path}:{line_no}: not a 'base64 rank' line") from exc
    return ranks


def _added_tokens(path: Path) -> dict[int, str]:
    if not path.is_file():
        raise TokenizerNotFound(f"{path} not found (needed for the special-token names)")
    decoder = json.loads(path.read_text(encoding="utf-8")).get("added_tokens_decoder", {})
    return {int(k): v["content"] for k, v in decoder.items()}


class HFTokenizer:
    """A Hugging Face tokenizer; ordinary text bypasses added-token matching."""

    def __init__(self, folder: Path, trust_remote_code: bool = False) -> None:
        from transformers import AutoTokenizer  # optional dep

        self._tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
        self.name = folder.name
        self.splits_at_lone_spaces = False  # a normaliser or another pre-tokenizer may differ
        self.vocab_size = len(self._tok)
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{folder}: only fast (tokenizer.json) tokenizers are supported")
        self._backend = backend
        self._added = {t.content: i for i, t in self._tok.added_tokens_decoder.items()}
        self._by_bytes: dict[bytes, int] | None = None

    def encode_ordinary(self, text: str) -> list[int]:
        # Normaliser -> pre-tokeniser -> model, skipping the added-token matcher, so a
        # marker name inside user text is encoded as the characters it is made of.
        if not text:
            return []
        normalizer = self._backend.normalizer
        normalized = normalizer.normalize_str(text) if normalizer else text
        pre = self._backend.pre_tokenizer
        words = [w for w, _ in pre.pre_tokenize_str(normalized)] if pre else [normalized]
        model = self._backend.model
        return [t.id for word in words for t in model.tokenize(word)]

    def marker_id(self, name: str) -> int | None:
        if name in self._added:
            return self._added[name]
        token_id = self._tok.convert_tokens_to_ids(name)
        if isinstance(token_id, int) and token_id != self._tok.unk_token_id:
            return token_id
        return None

    def encode_with_markers(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def piece(self, token_id: int) -> str:
        return str(self._tok.decode([token_id], skip_special_tokens=False))

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one id (byte-level BPE vocabularies; added tokens: their text)."""
        token = self._tok.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder()
        if token in self._added or not all(ch in decoder for ch in token):
            return self.piece(token_id).encode()
        return bytes(decoder[ch] for ch in token)

    def id_of_bytes(self, data: bytes) -> int | None:
        """The ordinary id whose bytes are exactly `data`; None when none is."""
        if self._by_bytes is None:
            decoder = _byte_decoder()
            self._by_bytes = {
                bytes(decoder[ch] for ch in token): token_id
                for token, token_id in self._tok.get_vocab().items()
                if token not in self._added and all(ch in decoder for ch in token)
            }
        return self._by_bytes.get(data)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 byte values, reversed: printable
    Latin-1 bytes stand for themselves, the others for code points from 256 up, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    stand_in = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in stand_in:
            stand_in[byte] = chr(256 + extra)
            extra += 1
    return {ch: byte for byte, ch in stand_in.items()}
