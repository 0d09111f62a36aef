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
  - texts differ only where stacks change text (whitespace at the edge of a piece between
    markers: a stripped reasoning tail, marker spaces, a dropped whitespace-only content;
    for a record flagged `tool_arguments_maybe_coerced`, argument values coerced to the
    schema): the engine's bytes say what was there, so the record carries the engine's ids
    (note `stack_changed_text`, each change in `stack_trims`), billing checked on them;
  - texts disagree anywhere else: error `logprob_mismatch` (position, both pieces); the
    record keeps the re-encoded ids, because either the text or the logprobs were changed
    and nothing here can tell which;
  - an entry that is not a token, or a sequence that cannot be placed: error
    `logprobs_invalid`; the logprobs are ignored, never trusted, and the record is not `ok`
    on the strength of re-encoding (corrupt logprobs are not proof, whatever the profile).

Why about 540 lines: mapping entries to ids and checking them against the reconstructed
text (covered span, stack trims, coerced JSON) share one alignment; split, the checks would
re-derive it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kimi_pipe.core.issue_codes import LOGPROB_ERRORS, Code
from kimi_pipe.core.issue_codes import (
    LOGPROB_NOTES as LOGPROB_NOTES,  # extraction/resolve.py's name
)
from kimi_pipe.core.models import Model
from kimi_pipe.core.plain import select
from kimi_pipe.core.reconstruction import ERRORS, Reconstruction

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
        return replace(rec, issues=_unique([*rec.issues, Code.LOGPROBS_MISSING]), details=details)

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
        issues = _unique([*rec.issues, Code.LOGPROBS_INVALID])
        return replace(rec, ok=False, issues=issues, details=details)
    if not engine:  # e.g. content-only logprobs of an empty content: nothing to compare
        summary["coverage"] = "none"
        return replace(rec, details=details)
    if not output:  # nothing was reconstructed to compare with (a malformed answer)
        summary["invalid"] = "no reconstructed output to place the tokens in"
        issues = _unique([*rec.issues, Code.LOGPROBS_INVALID])
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
    coerced_ok = Code.TOOL_ARGUMENTS_MAYBE_COERCED in rec.issues
    lead = output[start - 1] if start else None
    trims = (
        _stack_trims(model, output[start:], engine, coerced_ok, lead)
        if out_text != eng_text
        else None
    )
    if trims is not None:
        # The whole difference is whitespace a stack strips or adds beside a marker; the
        # text agrees everywhere else, so the engine's tokens are the ids (billed below).
        summary["stack_trims"] = trims
        end = start + trims[-1]["output_end"] if trims else len(output)
        out_pieces = [token_bytes(t) for t in output[start:end]]
        out_text = eng_text = b"".join(token_bytes(t) for t in engine)
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
        issues = _unique([*rec.issues, Code.LOGPROB_MISMATCH])
        return replace(rec, ok=_ok(issues), issues=issues, details=details)

    covered = output[start:end]
    if trims is not None:
        return _engine_ids_over_trims(model, rec, policy, details, summary, start, end, engine)
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
            issues = _unique([*rec.issues, Code.LOGPROB_MISMATCH])
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
        issues.append(Code.NONCANONICAL_SPLIT)
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

    cleared = {Code.BILLING_MISMATCH, *_covered_codes(coverage)}
    issues = [code for code in issues if code not in cleared]
    return _billed(rec, policy, details, new_output, issues)


def _billed(
    rec: Reconstruction,
    policy: LogprobPolicy,
    details: dict[str, Any],
    output: list[int],
    issues: list[str],
) -> Reconstruction:
    """The record on `output` (the ids it will carry), with the billing check redone on them."""
    reported = rec.completion_tokens_reported
    if reported is not None and abs(reported - len(output)) > policy.billing_tolerance:
        issues = [*issues, Code.BILLING_MISMATCH]
    issues = _unique(issues)
    return replace(
        rec,
        ok=_ok(issues),
        issues=issues,
        output_ids=output,
        loss_mask=_loss_mask(rec, len(output)),
        completion_tokens_reconstructed=len(output),
        details=details,
    )


def _covered_codes(coverage: str) -> set[str]:
    """Flags the engine's own bytes settle where they cover the output: the tool calls (their
    arguments verbatim) from the content on; with the whole output also the reasoning's tail
    (a newline after final punctuation) and the spaces beside every marker."""
    codes: set[str] = set()
    if coverage in ("whole", "content"):
        # The section's bytes: arguments as written (types, edges) and the model's own index.
        codes |= {Code.TOOL_ARGUMENTS_MAYBE_COERCED, Code.TOOL_ARGUMENTS_EDGES_UNVERIFIABLE}
        codes |= {Code.TOOL_INDEX_UNVERIFIABLE}
    if coverage == "whole":
        codes |= {Code.REASONING_TAIL_UNVERIFIABLE, Code.LEADING_SPACE_AFTER_MARKER}
        codes |= {Code.SPACE_BEFORE_TOOL_SECTION}
    return codes


def _segments(model: Model, ids: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The marker ids of a sequence and the [start, end) runs of text ids between them (one
    more run than markers)."""
    marker_ids = set(model.markers.values())
    markers: list[int] = []
    runs: list[tuple[int, int]] = []
    begin = 0
    for i, token in enumerate(ids):
        if token in marker_ids:
            markers.append(token)
            runs.append((begin, i))
            begin = i + 1
    runs.append((begin, len(ids)))
    return markers, runs


def _stack_trims(
    model: Model,
    output: Sequence[int],
    engine: Sequence[int],
    allow_coerced: bool = False,
    lead: int | None = None,
) -> list[dict[str, Any]] | None:
    """Where the engine's tokens and the reconstruction differ only by whitespace at the
    ends of the text between markers, every such difference (each with `output_end`, the
    output index up to which the engine's tokens stand for the output); None when any other
    difference remains (same markers in the same order, the same text inside every piece).

    This is what stacks do to the model's text (vLLM strips the reasoning's tail and drops a
    whitespace-only content before tool calls, parsers trim arguments, spaces_between_special
    _tokens adds spaces beside markers); the engine's own bytes say what was there. With
    `allow_coerced` (the record was flagged `tool_arguments_maybe_coerced`), a piece whose
    JSON values differ only as a coercing stack changes them ("30" -> 30) counts too. `lead`:
    the marker before `output` (the think-end marker where only the content is covered)."""
    out_markers, out_runs = _segments(model, output)
    eng_markers, eng_runs = _segments(model, engine)
    if not eng_markers or out_markers[: len(eng_markers)] != eng_markers:
        return None
    whole = len(eng_markers) == len(out_markers)
    if not whole and eng_runs[-1][0] != eng_runs[-1][1]:
        return None  # the engine stops inside a piece the output goes on with
    token_bytes = model.tokenizer.token_bytes
    trims: list[dict[str, Any]] = []
    pairs = zip(eng_runs if whole else eng_runs[:-1], out_runs, strict=False)
    for k, ((e0, e1), (o0, o1)) in enumerate(pairs):
        eng_text = b"".join(token_bytes(t) for t in engine[e0:e1])
        out_text = b"".join(token_bytes(t) for t in output[o0:o1])
        if eng_text == out_text:
            continue
        coerced = False
        if eng_text.strip() != out_text.strip():
            if not (allow_coerced and _coerced_json(eng_text, out_text)):
                return None
            coerced = True
        previous = out_markers[k - 1] if k else lead
        before = model.tokenizer.piece(previous) if previous is not None else None
        after = model.tokenizer.piece(out_markers[k]) if k < len(out_markers) else None
        trims.append(
            {
                "after_marker": before,
                "before_marker": after,
                "engine": eng_text.decode("utf-8", "replace")[:40],
                "text": out_text.decode("utf-8", "replace")[:40],
                **({"why": "argument values coerced to the schema's types"} if coerced else {}),
            }
        )
    if not trims:
        return None
    # The engine's tokens stand for the output up to its last marker they share (+ its text).
    covered_end = out_runs[-1][1] if whole else out_runs[len(eng_markers)][0]
    for trim in trims:
        trim["output_end"] = covered_end
    return trims


def _coerced_json(engine_text: bytes, output_text: bytes) -> bool:
    """Both pieces are JSON objects and the output's values are the engine's as a stack that
    coerces to schema types leaves them: a string became the number or boolean it spells."""

    try:
        engine_value = json.loads(engine_text)
        output_value = json.loads(output_text)
    except ValueError:
        return False
    return isinstance(engine_value, dict) and _coerces_to(engine_value, output_value)


def _coerces_to(engine: Any, output: Any) -> bool:
    if isinstance(engine, dict):
        return (
            isinstance(output, dict)
            and engine.keys() == output.keys()
            and all(_coerces_to(engine[k], output[k]) for k in engine)
        )
    if isinstance(engine, list):
        return (
            isinstance(output, list)
            and len(engine) == len(output)
            and all(_coerces_to(a, b) for a, b in zip(engine, output, strict=True))
        )
    if type(engine) is type(output):
        return bool(engine == output)
    if not isinstance(engine, str) or isinstance(output, str):
        return False
    text = engine.strip()
    if isinstance(output, bool):
        return text.lower() == str(output).lower()
    if output is None:
        return text.lower() == "null"
    try:
        return bool(int(text) == output) if isinstance(output, int) else float(text) == output
    except ValueError:
        return False


def _engine_ids_over_trims(
    model: Model,
    rec: Reconstruction,
    policy: LogprobPolicy,
    details: dict[str, Any],
    summary: dict[str, Any],
    start: int,
    end: int,
    engine: Sequence[int],
) -> Reconstruction:
    """The record on the engine's ids where the text differs from them only by whitespace a
    stack trims beside markers (`_stack_trims`): what the stack changed is noted, the
    re-encoded rest kept, and billing checked on the result."""
    output = list(rec.output_ids)
    new_output = output[:start] + list(engine) + output[end:]
    head = [[0, start, "reencoded"]] if start else []
    tail = [[start + len(engine), len(new_output), "reencoded"]] if end < len(output) else []
    details["id_sources"] = head + [[start, start + len(engine), "engine"]] + tail
    summary["agree"] = False
    cleared = {Code.BILLING_MISMATCH, *_covered_codes(str(summary.get("coverage")))}
    issues = [code for code in rec.issues if code not in cleared]
    return _billed(rec, policy, details, new_output, [*issues, Code.STACK_CHANGED_TEXT])


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

    return LogprobPolicy(
        record_ids=str(select(cfg, "validation.record_ids", default="engine")),
        requested=bool(select(cfg, "provider.logprobs", default=False)),
        billing_tolerance=int(select(cfg, "validation.billing_tolerance", default=0) or 0),
    )
