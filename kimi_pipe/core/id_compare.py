"""Comparing reconstructed ids with an engine's own: the first difference and its class.

Pure: ids, texts and a decoder in, a verdict out (the audit stage does the IO).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kimi_pipe.core.issue_codes import BILLING_MISMATCH

MISMATCH_CLASSES = (
    "non_canonical_split",  # same text, other token split (the engine sampled a non-BPE split)
    "lost_whitespace",  # texts differ only in whitespace (a parser stripped or added it)
    "tool_call_reserialised",  # differ only inside JSON (arguments re-serialised by the server)
    "end_token",  # differ only in the trailing end-of-turn token(s)
    # The answer holds bytes that are no whole character (cut by max_tokens inside a
    # multi-byte character): the API text carries U+FFFD, the bytes are lost.
    "partial_utf8",
    "other",
)
BILLING_ISSUE = BILLING_MISMATCH  # the reconstruction's length check against usage


@dataclass
class Comparison:
    exact: bool
    klass: str | None  # one of MISMATCH_CLASSES, None when exact
    first_diff: int | None  # index of the first differing id
    truth_len: int
    recon_len: int
    end_token_differs: bool = False
    detail: str = ""


_WS = re.compile(r"\s+")
FFFD = "\ufffd"  # what a decoder puts where bytes are no valid UTF-8
_FFFD_RUN = re.compile("\ufffd+")


def _strip_end(ids: Sequence[int], end_ids: frozenset[int]) -> list[int]:
    out = list(ids)
    while out and out[-1] in end_ids:
        out.pop()
    return out


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def json_spans(text: str) -> list[tuple[int, int, Any]]:
    """Every JSON object or array in `text` (outermost only), as (start, end, value)."""
    decoder = json.JSONDecoder()
    spans: list[tuple[int, int, Any]] = []
    i = 0
    while i < len(text):
        if text[i] in "{[":
            try:
                value, end = decoder.raw_decode(text, i)
            except ValueError:
                i += 1
                continue
            if isinstance(value, dict | list):
                spans.append((i, end, value))
                i = end
                continue
        i += 1
    return spans


def _json_skeleton(text: str) -> tuple[str, list[Any]]:
    """Text with every JSON value replaced by a placeholder, and the parsed values."""
    parts: list[str] = []
    values: list[Any] = []
    last = 0
    for start, end, value in json_spans(text):
        parts.append(text[last:start])
        parts.append("\x00JSON\x00")
        values.append(value)
        last = end
    parts.append(text[last:])
    return "".join(parts), values


def classify(
    truth: Sequence[int],
    recon: Sequence[int],
    decode: Callable[[Sequence[int]], str],
    end_ids: Iterable[int] = (),
) -> Comparison:
    """Compare truth ids with reconstructed ids and name the kind of difference.

    The end token is set aside first, then the texts are compared: the same text means a
    different split; whitespace-only or JSON-only differences get their own class.
    """
    ends = frozenset(end_ids)
    first = _first_diff(truth, recon)
    base = Comparison(first is None, None, first, len(truth), len(recon))
    if first is None:
        return base
    t_body, r_body = _strip_end(truth, ends), _strip_end(recon, ends)
    base.end_token_differs = list(truth[len(t_body) :]) != list(recon[len(r_body) :])
    if t_body == r_body:
        base.klass = "end_token"
        t_end, r_end = list(truth[len(t_body) :]), list(recon[len(r_body) :])
        base.detail = f"truth ends {t_end}, reconstruction ends {r_end}"
        return base
    t_text, r_text = decode(t_body), decode(r_body)
    t_skel, t_vals = _json_skeleton(t_text)
    r_skel, r_vals = _json_skeleton(r_text)
    if FFFD in t_text and _FFFD_RUN.sub(FFFD, t_text) == _FFFD_RUN.sub(FFFD, r_text):
        base.klass = "partial_utf8"
        base.detail = "bytes of an incomplete character; the text has U+FFFD in their place"
    elif t_text == r_text:
        base.klass = "non_canonical_split"
        base.detail = f"same text, {len(t_body)} truth ids vs {len(r_body)} reconstructed"
    elif t_vals and t_skel == r_skel and t_vals == r_vals:
        # Checked before whitespace: re-serialised JSON often differs only in separators.
        base.klass = "tool_call_reserialised"
        base.detail = f"{len(t_vals)} JSON value(s) equal once parsed, serialised differently"
    elif _WS.sub("", t_text) == _WS.sub("", r_text):
        base.klass = "lost_whitespace"
        t_ws, r_ws = _ws_chars(t_text), _ws_chars(r_text)
        change = "lost" if t_ws > r_ws else "gained" if t_ws < r_ws else "moved"
        base.detail = f"whitespace characters: truth {t_ws}, reconstruction {r_ws} ({change})"
    else:
        base.klass = "other"
        base.detail = f"texts differ from character {_first_char_diff(t_text, r_text)}"
    if base.end_token_differs:
        base.detail += "; end token differs too"
    return base


def _ws_chars(text: str) -> int:
    return sum(len(m) for m in _WS.findall(text))


def _first_char_diff(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
