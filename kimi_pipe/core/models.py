"""A model: its tokenizer, its validated marker ids and its declarative chat format."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kimi_pipe.core.formats import Marker, ModelFormat, Piece, Template, parse_format
from kimi_pipe.core.plain import plain
from kimi_pipe.core.tokenizers import (
    TextChunking,
    Tokenizer,
    TokenizerSpec,
    load_tokenizer,
    split_for_bpe,
)
from kimi_pipe.errors import ConfigError


class MarkerMismatch(ConfigError):
    """A configured marker id disagrees with the tokenizer: refuse to start."""


SHORT_SEGMENT = 64  # prompt segments this short are encoded once per model (_short_segments)


@dataclass(frozen=True)
class Model:
    name: str
    tokenizer: Tokenizer
    markers: Mapping[str, int]  # marker name -> id, confirmed by the tokenizer
    format: ModelFormat
    chunking: TextChunking | None = None  # how the reference tokenizer cuts prompt text
    # Names an answer's `model` may carry for this model (`model.served_names`; a dated
    # variant such as -0127 is the same model). Empty: not checked (a local server's path).
    served_names: tuple[str, ...] = ()
    # The ids of short prompt segments (role names, a system prompt, tool ids), which repeat
    # in every request of a dataset: a pure function of the text, kept with the model.
    _short_segments: dict[str, list[int]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # The ids of the format's templates without fields (the generation prompt's opening,
    # the end of turn), asked for on every answer.
    _constant_ids: dict[str, tuple[int, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def constant_ids(self, template: Template) -> tuple[int, ...]:
        """The ids of a template that has no fields, encoded once per model."""
        known = self._constant_ids.get(template.source)
        if known is None:
            known = self._constant_ids[template.source] = tuple(self.encode(template.render()))
        return known

    def encode(self, pieces: Iterable[Piece]) -> list[int]:
        """Encode rendered pieces: adjacent text is joined first, markers are hard ids.

        Joining matters: BPE of "a" and "b" apart differs from BPE of "ab". This is the
        output side: the model sampled its answer token by token, nothing cut its text.
        """
        return self._encode(pieces, None)

    def encode_prompt(self, pieces: Iterable[Piece]) -> list[int]:
        """Encode a rendered prompt as the serving stack does: like `encode`, but each text
        segment between markers is first cut the way the reference tokenizer cuts it
        (`model.tokenizer.chunking`; servers encode the text between special tokens one
        segment at a time, so the cuts restart after every marker)."""
        return self._encode(pieces, self.chunking)

    def _encode(self, pieces: Iterable[Piece], chunking: TextChunking | None) -> list[int]:
        # `ids` + each text's ids, joined here rather than in a helper per piece (this runs
        # for every answer). Prompt ids of short segments are the shared `_short_segments`
        # lists, so they are always copied.
        markers = self.markers
        short = self._short_segments
        ids: list[int] = []
        text: str | None = None  # the text since the last marker, joined as it comes
        for piece in pieces:
            if isinstance(piece, Marker):
                if text is not None:
                    if chunking is not None and len(text) <= SHORT_SEGMENT and text in short:
                        ids += short[text]  # known after its first prompt
                    else:
                        ids = self._joined(ids, text, chunking)
                    text = None
                ids.append(markers[piece.name])
            elif text is None:
                text = piece
            else:
                text += piece
        return ids if text is None else self._joined(ids, text, chunking)

    def _joined(self, ids: list[int], text: str, chunking: TextChunking | None) -> list[int]:
        """`ids` followed by the text's ids. A text's own new list that is longer takes `ids`
        in front (a memmove), so the longest text (an answer's reasoning, a long prompt turn)
        is not copied id by id."""
        if chunking is not None and len(text) <= SHORT_SEGMENT:
            known = self._short_segments[text] = self._encode_chunked(text, chunking)
            ids += known  # now shared: copied
            return ids
        if chunking is None:
            more = self.tokenizer.encode_ordinary(text)
        else:
            more = self._encode_chunked(text, chunking)
        if len(more) > len(ids):
            more[:0] = ids
            return more
        ids += more
        return ids

    def _encode_chunked(self, text: str, chunking: TextChunking) -> list[int]:
        encode = self.tokenizer.encode_ordinary
        if len(text) <= chunking.max_run and len(text) <= chunking.max_chars:
            return encode(text)  # nothing to cut (split_for_bpe's own first test), the common case
        parts = split_for_bpe(text, chunking)
        if len(parts) == 1:
            return encode(parts[0])  # no per-token Python loop
        ids: list[int] = []
        for part in parts:
            ids.extend(encode(part))
        return ids


def _as_dict(cfg: Mapping[str, Any]) -> dict[str, Any]:
    data = plain(cfg)
    if not isinstance(data, dict):
        raise ConfigError(f"model: a mapping of settings, not {cfg!r}")
    return data


def validate_markers(tokenizer: Tokenizer, expected: Mapping[str, int]) -> dict[str, int]:
    """Check every configured marker against the tokenizer, both directions."""
    problems: list[str] = []
    for name, configured in expected.items():
        actual = tokenizer.marker_id(name)
        encoded = tokenizer.encode_with_markers(name)
        decoded = tokenizer.decode([configured]) if 0 <= configured < tokenizer.vocab_size else None
        if actual != configured or encoded != [configured] or decoded != name:
            problems.append(
                f"marker {name!r}: configured id {configured}, tokenizer id {actual} "
                f"(encode -> {encoded}, decode({configured}) -> {decoded!r})"
            )
    if problems:
        raise MarkerMismatch(
            "model config disagrees with its tokenizer; fix conf/model/*.yaml markers:\n  "
            + "\n  ".join(problems)
        )
    return dict(expected)


def load_model(cfg: Mapping[str, Any]) -> Model:
    """Load the tokenizer named by `cfg.tokenizer`, validate `cfg.markers`, parse the format."""
    data = _as_dict(cfg)
    spec = TokenizerSpec.from_config(data["tokenizer"])
    tokenizer = load_tokenizer(spec)
    expected = {str(k): int(v) for k, v in (data.get("markers") or {}).items()}
    markers = validate_markers(tokenizer, expected)
    model_format = parse_format(data, tuple(markers))
    return Model(
        name=data["name"],
        tokenizer=tokenizer,
        markers=markers,
        format=model_format,
        chunking=spec.chunking,
        served_names=tuple(str(n) for n in data.get("served_names") or ()),
    )
