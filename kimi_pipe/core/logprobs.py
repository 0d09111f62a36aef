"""The engine's own token ids from `logprobs.content[]` (pure: no IO, no globals).

Re-encoding the text a provider returns gives the canonical tokenization at best. When a
choice carries `logprobs.content[]` (OpenAI shape: `token`, `bytes`, `logprob`), those are
the tokens the engine sampled, including non-canonical splits (`"12"+"345"` where
re-encoding gives `"123"+"45"`) that no text-based method can recover and that the billing
check misses whenever the count is the same.

`apply_logprobs` maps each entry to an id by its bytes (markers and other special tokens by
their text), finds which span of the reconstructed output it covers (the whole output, or
only the content after the think-end marker), and compares texts there:
  - texts agree, ids agree: the reconstruction is confirmed;
  - texts agree, ids differ: a non-canonical split recovered (note `noncanonical_split`);
    the record carries the engine's ids unless `record_ids="reencoded"`;
  - texts disagree: error `logprob_mismatch` (position, both pieces); the record keeps
    the re-encoded ids, because either the text or the logprobs were changed and nothing
    here can tell which;
  - an entry that is not a token, or a sequence that cannot be placed: error
    `logprobs_invalid`; the logprobs are ignored, never trusted, and the record is not `ok`
    on the strength of re-encoding (corrupt logprobs are not proof, whatever the profile).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kimi_pipe.core.models import Model
from kimi_pipe.core.reconstruction import ERRORS, Reconstruction

LOGPROB_ERRORS = frozenset(
    {
        "logprob_mismatch",  # covered text differs from the answer text
        # Entries that are not tokens or do not fit the output: the answer was changed
        # somewhere between the engine and us, so re-encoding its text proves nothing.
        "logprobs_invalid",
    }
)
LOGPROB_NOTES = frozenset(
    {
        "noncanonical_split",  # same text, other ids than re-encoding: the engine's kept
        "logprobs_missing",  # logprobs were asked for and none came back
    }
)
RECORD_IDS = ("engine", "reencoded")
CONTEXT_TOKENS = 3  # tokens of context either side of a reported difference


@dataclass(frozen=True)
class LogprobPolicy:
    """How a record uses the engine's tokens."""

    record_ids: str = "engine"  # "engine": its ids where they cover; "reencoded": never
    requested: bool = False  # logprobs were asked for: an answer without any gets a note
    billing_tolerance: int = 0  # the billing check is redone on the ids the record carries

    def __post_init__(self) -> None:
        if self.record_ids not in RECORD_IDS:
            raise ValueError(
                f"logprobs.record_ids must be one of {RECORD_IDS}, not {self.record_ids!r}"
            )


class BadLogprobs(ValueError):
    """An entry that is not a token of this model's vocabulary."""


def logprob_entries(response: Any) -> list[Any] | None:
    """`choices[0].logprobs.content`, or None when the answer carries none."""
    if not isinstance(response, Mapping):
        return None
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return None
    logprobs = choices[0].get("logprobs")
    if not isinstance(logprobs, Mapping):
        return None
    content = logprobs.get("content")
    return content if isinstance(content, list) and content else None


def _empty(entry: Any) -> bool:
    return (
        isinstance(entry, Mapping) and entry.get("token") == "" and entry.get("bytes") in (None, [])
    )


def _text_bytes(index: int, text: str) -> bytes:
    """The bytes of an entry that has no `bytes`: its text, or vLLM's `bytes:\\xe6\\x97`
    spelling of a token that is part of a character."""
    if text.startswith("bytes:"):
        try:
            return (
                text[len("bytes:") :].encode("latin-1").decode("unicode_escape").encode("latin-1")
            )
        except (UnicodeDecodeError, UnicodeEncodeError):
            raise BadLogprobs(f"entry {index}: cannot read {text!r} as bytes") from None
    if "\ufffd" in text:
        # A replacement character stands for bytes that were lost: the token is unknown.
        raise BadLogprobs(f"entry {index}: token {text!r} without bytes is not whole characters")
    return text.encode("utf-8")


def engine_ids(model: Model, entries: Sequence[Any]) -> list[int]:
    """Each entry's id: an ordinary token by its exact bytes, else a special one by its text."""
    tokenizer = model.tokenizer
    ids: list[int] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("token"), str):
            raise BadLogprobs(f"entry {index}: not an object with a token string")
        text, raw = entry["token"], entry.get("bytes")
        if raw is None:
            data = _text_bytes(index, text)
        elif isinstance(raw, list):
            try:
                data = bytes(raw)  # checks every value is an int in 0..255
            except (TypeError, ValueError):
                raise BadLogprobs(f"entry {index}: bytes {raw!r} are not byte values") from None
        else:
            raise BadLogprobs(f"entry {index}: bytes {raw!r} is not a list of byte values")
        token_id = tokenizer.id_of_bytes(data) if data else None
        if token_id is None and data == text.encode("utf-8"):
            # Not an ordinary token: a marker or other special token, named by its text.
            token_id = model.markers.get(text, tokenizer.marker_id(text))
        if token_id is None:
            raise BadLogprobs(
                f"entry {index}: token {text!r} (bytes {list(data)}) is not a "
                f"token of {tokenizer.name}"
            )
        ids.append(token_id)
    return ids


def _covered_start(model: Model, output: Sequence[int], engine: Sequence[int]) -> tuple[str, int]:
    """Where the engine's tokens begin in the output: with the think-end marker among them
    they are the whole output; without it, a thinking model's content after that marker."""
    think_end = model.format.output.think_end
    think_id = model.markers.get(think_end) if think_end else None
    if think_id is None or model.format.output.reasoning is None or think_id in engine:
        return "whole", 0
    if think_id in output:
        return "content", list(output).index(think_id) + 1
    return "content", len(output)  # cut inside the reasoning: no content was written


def _first_difference(a: bytes, b: bytes) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _token_at(pieces: Sequence[bytes], offset: int) -> int:
    """Index of the token holding byte `offset` (len(pieces) past the end)."""
    seen = 0
    for i, piece in enumerate(pieces):
        seen += len(piece)
        if offset < seen:
            return i
    return len(pieces)


def _piece(model: Model, ids: Sequence[int], at: int) -> str | None:
    return model.tokenizer.piece(ids[at]) if at < len(ids) else None  # None: past the end


def _show(model: Model, ids: Sequence[int], at: int) -> list[str]:
    lo, hi = max(0, at - CONTEXT_TOKENS), min(len(ids), at + CONTEXT_TOKENS + 1)
    return [model.tokenizer.piece(t) for t in ids[lo:hi]]


def _diff_runs(
    a: Sequence[int], b: Sequence[int], la: Sequence[int], lb: Sequence[int]
) -> list[tuple[int, int, int, int]]:
    """Runs where two id sequences of the same bytes differ: (a_start, a_end, b_start,
    b_end), found by walking both until their byte positions meet again (`la`, `lb`: the
    byte length of each token)."""
    runs: list[tuple[int, int, int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] == b[j]:
            i, j = i + 1, j + 1
            continue
        si, sj, pa, pb = i, j, la[i], lb[j]
        i, j = i + 1, j + 1
        while pa != pb:  # grow the shorter side until both end on the same byte
            if pa < pb:
                pa += la[i]
                i += 1
            else:
                pb += lb[j]
                j += 1
        runs.append((si, i, sj, j))
    return runs


def apply_logprobs(
    model: Model, rec: Reconstruction, response: Any, policy: LogprobPolicy
) -> Reconstruction:
    """The reconstruction checked (and where allowed, corrected) by the engine's tokens."""
    details = dict(rec.details)
    output = list(rec.output_ids)
    reencoded_only = [[0, len(output), "reencoded"]] if output else []
    entries = logprob_entries(response)
    if entries is None:
        if not policy.requested:
            return rec  # nothing asked, nothing sent: the record keeps its plain layout
        details["logprobs"] = {"present": False}
        details["id_sources"] = reencoded_only
        return replace(rec, issues=_unique([*rec.issues, "logprobs_missing"]), details=details)

    summary: dict[str, Any] = {"present": True, "tokens": len(entries)}
    details["logprobs"] = summary
    details["id_sources"] = reencoded_only
    # A server that skips special tokens when decoding sends the end of turn as an empty
    # entry: it carries no bytes to identify, so it is left out (the end stays re-encoded).
    while entries and _empty(entries[-1]):
        entries = entries[:-1]
        summary["empty_tail"] = summary.get("empty_tail", 0) + 1
    try:
        engine = engine_ids(model, entries)
    except BadLogprobs as exc:
        summary["invalid"] = str(exc)
        issues = _unique([*rec.issues, "logprobs_invalid"])
        return replace(rec, ok=False, issues=issues, details=details)
    if not engine:  # e.g. content-only logprobs of an empty content: nothing to compare
        summary["coverage"] = "none"
        return replace(rec, details=details)
    if not output:  # nothing was reconstructed to compare with (a malformed answer)
        summary["invalid"] = "no reconstructed output to place the tokens in"
        issues = _unique([*rec.issues, "logprobs_invalid"])
        return replace(rec, ok=False, issues=issues, details=details)

    token_bytes = model.tokenizer.token_bytes
    coverage, start = _covered_start(model, output, engine)
    summary["coverage"] = coverage
    out_pieces = [token_bytes(t) for t in output[start:]]
    eng_pieces = [token_bytes(t) for t in engine]
    eng_text = b"".join(eng_pieces)
    # The covered span ends where the output's bytes reach the engine's byte length.
    end, seen = start, 0
    while end < len(output) and seen < len(eng_text):
        seen += len(out_pieces[end - start])
        end += 1
    out_text = b"".join(out_pieces[: end - start])
    if out_text != eng_text:
        at = _first_difference(out_text, eng_text)
        e_at, o_at = _token_at(eng_pieces, at), start + _token_at(out_pieces, at)
        summary["mismatch"] = {
            "byte": at,
            "engine_token": e_at,
            "output_token": o_at,
            "engine_piece": _piece(model, engine, e_at),
            "reencoded_piece": _piece(model, output, o_at),
            # The text from the first differing byte on, both ways.
            "engine_text": eng_text[at : at + 24].decode("utf-8", "replace"),
            "reencoded_text": out_text[at : at + 24].decode("utf-8", "replace"),
            "engine_context": _show(model, engine, e_at),
            "reencoded_context": _show(model, output, o_at),
        }
        # Kept for inspection, not used: either these or the text were changed.
        summary["engine_ids"] = engine
        issues = _unique([*rec.issues, "logprob_mismatch"])
        return replace(rec, ok=_ok(issues), issues=issues, details=details)

    covered = output[start:end]
    runs = _diff_runs(
        covered, engine, [len(p) for p in out_pieces[: end - start]], [len(p) for p in eng_pieces]
    )
    marker_ids = set(model.markers.values())
    for a0, a1, b0, b1 in runs:
        # Same bytes but a marker on one side only: marker text became text (or the reverse),
        # not a split the model sampled.
        if marker_ids & (set(covered[a0:a1]) ^ set(engine[b0:b1])):
            summary["mismatch"] = {
                "output_token": start + a0,
                "engine_token": b0,
                "engine_piece": "".join(model.tokenizer.piece(t) for t in engine[b0:b1]),
                "reencoded_piece": "".join(model.tokenizer.piece(t) for t in covered[a0:a1]),
                "why": "a marker on one side is text on the other",
            }
            summary["engine_ids"] = engine
            issues = _unique([*rec.issues, "logprob_mismatch"])
            return replace(rec, ok=_ok(issues), issues=issues, details=details)
    summary["agree"] = not runs
    summary["splits"] = [
        {
            "output_token": start + a0,
            "engine": [model.tokenizer.piece(t) for t in engine[b0:b1]],
            "reencoded": [model.tokenizer.piece(t) for t in covered[a0:a1]],
        }
        for a0, a1, b0, b1 in runs
    ]
    issues = list(rec.issues)
    if runs:
        issues.append("noncanonical_split")
    if policy.record_ids == "reencoded" or not runs:
        # "confirmed": re-encoded ids the engine's tokens agree with, id for id.
        sources: list[list[Any]] = [[start, end, "confirmed" if not runs else "reencoded"]]
        new_output = output
    else:
        new_output = output[:start] + engine + output[end:]
        sources = [[start, start + len(engine), "engine"]]
    head = [[0, start, "reencoded"]] if start else []
    tail_start = sources[0][1]
    tail = [[tail_start, len(new_output), "reencoded"]] if tail_start < len(new_output) else []
    details["id_sources"] = head + sources + tail

    reported = rec.completion_tokens_reported
    issues = [code for code in issues if code != "billing_mismatch"]
    if coverage == "whole":
        # The engine's own bytes span the reasoning's end: what a stripped tail could hide
        # (a newline after final punctuation) is proven present or absent.
        issues = [code for code in issues if code != "reasoning_tail_unverifiable"]
    if reported is not None and abs(reported - len(new_output)) > policy.billing_tolerance:
        issues.append("billing_mismatch")
    issues = _unique(issues)
    return replace(
        rec,
        ok=_ok(issues),
        issues=issues,
        output_ids=new_output,
        loss_mask=_loss_mask(rec, len(new_output)),
        completion_tokens_reconstructed=len(new_output),
        details=details,
    )


def _loss_mask(rec: Reconstruction, output_len: int) -> list[int]:
    """The mask for a new output length: the prompt part and the last (end) value kept."""
    prompt_part = rec.loss_mask[: len(rec.prompt_ids)]
    old = rec.loss_mask[len(rec.prompt_ids) :]
    if len(old) == output_len:
        return list(rec.loss_mask)
    if not old:
        return prompt_part + [1] * output_len
    body = [old[0]] * max(0, output_len - 1)
    return prompt_part + body + [old[-1]] if output_len else prompt_part


def _ok(issues: Sequence[str]) -> bool:
    return not any(code in ERRORS or code in LOGPROB_ERRORS for code in issues)


def _unique(issues: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(issues))


def record_fields(rec: Reconstruction) -> dict[str, Any]:
    """What a stored record adds: where each id span came from, and the logprob summary."""
    fields: dict[str, Any] = {}
    for key in ("id_sources", "logprobs"):
        if key in rec.details:
            fields[key] = rec.details[key]
    return fields


def policy_from_config(cfg: Any) -> LogprobPolicy:
    """From the composed config: `provider.logprobs` (asked for) and `validation`."""
    from omegaconf import OmegaConf

    return LogprobPolicy(
        record_ids=str(OmegaConf.select(cfg, "validation.record_ids", default="engine")),
        requested=bool(OmegaConf.select(cfg, "provider.logprobs", default=False)),
        billing_tolerance=int(
            OmegaConf.select(cfg, "validation.billing_tolerance", default=0) or 0
        ),
    )
