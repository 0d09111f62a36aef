"""A model: its tokenizer, its validated marker ids and its declarative chat format."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.core.formats import Marker, ModelFormat, Piece, parse_format
from kimi_pipe.core.tokenizers import Tokenizer, TokenizerSpec, load_tokenizer


class MarkerMismatch(ValueError):
    """A configured marker id disagrees with the tokenizer: refuse to start."""


@dataclass(frozen=True)
class Model:
    name: str
    tokenizer: Tokenizer
    markers: Mapping[str, int]  # marker name -> id, confirmed by the tokenizer
    format: ModelFormat

    def encode(self, pieces: Iterable[Piece]) -> list[int]:
        """Encode rendered pieces: adjacent text is joined first, markers are hard ids.

        Joining matters: BPE of "a" and "b" apart differs from BPE of "ab".
        """
        ids: list[int] = []
        pending: list[str] = []
        for piece in pieces:
            if isinstance(piece, Marker):
                if pending:
                    ids.extend(self.tokenizer.encode_ordinary("".join(pending)))
                    pending.clear()
                ids.append(self.markers[piece.name])
            else:
                pending.append(piece)
        if pending:
            ids.extend(self.tokenizer.encode_ordinary("".join(pending)))
        return ids


def _as_dict(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)


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


def load_model(cfg: DictConfig | Mapping[str, Any]) -> Model:
    """Load the tokenizer named by `cfg.tokenizer`, validate `cfg.markers`, parse the format."""
    data = _as_dict(cfg)
    tokenizer = load_tokenizer(TokenizerSpec.from_config(data["tokenizer"]))
    expected = {str(k): int(v) for k, v in (data.get("markers") or {}).items()}
    markers = validate_markers(tokenizer, expected)
    model_format = parse_format(data, tuple(markers))
    return Model(name=data["name"], tokenizer=tokenizer, markers=markers, format=model_format)
