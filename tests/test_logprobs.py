"""Ids from logprobs: the engine's own tokens, with the real Kimi tokenizer.

The answers are built by hand in OpenAI's logprobs shape, and (at the end) bought through
`generate` from the fake OpenRouter over real HTTP, where an imitated stack samples
non-canonical splits with the same token count as canonical (billing cannot see them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import TAIL_KEPT
from conftest import TAIL_KEPT_OVERRIDES as KEPT

from kimi_pipe.core.logprobs import (
    BadLogprobs,
    LogprobPolicy,
    apply_logprobs,
    engine_ids,
    record_fields,
)
from kimi_pipe.core.models import Model
from kimi_pipe.core.reconstruction import Reconstruction, reconstruct
from tests.support.conftest_generate import base_overrides, read_jsonl, run_inprocess, write_prompts
from tests.support.fake_openrouter import Behaviour
from tests.support.fake_stacks import Stack

MESSAGES = [{"role": "user", "content": "Count."}]


def _rebuild(kimi: Model, resp: dict[str, Any]) -> Reconstruction:
    return reconstruct(kimi, MESSAGES, None, resp, serving=TAIL_KEPT)


REASONING = "Let me check 12345 first."
CONTENT = "Paris has 12345 people."


def _entries(model: Model, ids: list[int]) -> list[dict[str, Any]]:
    out = []
    for t in ids:
        data = model.tokenizer.token_bytes(t)
        out.append(
            {
                "token": data.decode("utf-8", "replace"),
                "logprob": -0.5,
                "bytes": list(data),
                "top_logprobs": [],
            }
        )
    return out


def _response(
    reasoning: str, content: str, completion_tokens: int, entries: list[dict] | None
) -> dict[str, Any]:
    return {
        "choices": [
            {
                "finish_reason": "stop",
                "logprobs": None if entries is None else {"content": entries},
                "message": {"role": "assistant", "content": content, "reasoning": reasoning},
            }
        ],
        "usage": {"completion_tokens": completion_tokens},
    }


def _ids(model: Model, text: str) -> list[int]:
    return model.tokenizer.encode_ordinary(text)


def _split_digits(model: Model, ids: list[int]) -> list[int]:
    """The split "123"+"45" -> "12"+"345": same text, same count, not what re-encoding gives."""
    tok = model.tokenizer
    a, b = tok.id_of_bytes(b"123"), tok.id_of_bytes(b"45")
    i = next(k for k in range(len(ids) - 1) if ids[k : k + 2] == [a, b])
    return ids[:i] + [tok.id_of_bytes(b"12"), tok.id_of_bytes(b"345")] + ids[i + 2 :]


def _truth(model: Model, reasoning: str = REASONING, content: str = CONTENT) -> list[int]:
    think, end = model.markers["</think>"], model.markers["<|im_end|>"]
    return _ids(model, reasoning) + [think] + _ids(model, content) + [end]


def test_entries_map_to_ids_by_bytes_and_markers_by_text(kimi: Model) -> None:
    truth = _split_digits(kimi, _truth(kimi))
    assert engine_ids(kimi, _entries(kimi, truth)) == truth
    # A byte-level token that is not valid UTF-8 alone is still found by its bytes.
    head = kimi.tokenizer.encode_ordinary("日本語です 🦜")
    pieces = [kimi.tokenizer.token_bytes(t) for t in head]
    assert engine_ids(kimi, _entries(kimi, head)) == head and b"".join(pieces).decode()
    # Without `bytes`: vLLM spells a part of a character as "bytes:\xe6\x97"; a U+FFFD
    # stands for lost bytes and cannot be trusted.
    part = next(p for p in pieces if _not_utf8(p))
    spelled = "bytes:" + "".join(f"\\x{b:02x}" for b in part)
    assert engine_ids(kimi, [{"token": spelled}]) == [kimi.tokenizer.id_of_bytes(part)]
    with pytest.raises(BadLogprobs, match="not whole characters"):
        engine_ids(kimi, [{"token": part.decode("utf-8", "replace")}])
    with pytest.raises(BadLogprobs, match="entry 1"):
        engine_ids(kimi, [{"token": "a", "bytes": [97]}, {"token": "?", "bytes": [300]}])
    glued = list(b"12345 first")  # not one token of the vocabulary
    with pytest.raises(BadLogprobs, match="is not a token"):
        engine_ids(kimi, [{"token": "12345 first", "bytes": glued}])


def test_text_only_entries_and_an_empty_end_entry(kimi: Model) -> None:
    """No `bytes` (the token text is used) and a trailing empty entry (an end of turn a
    server decoded with special tokens skipped) still give the engine's ids."""
    truth = _split_digits(kimi, _truth(kimi))
    entries = [{"token": e["token"], "logprob": -1.0} for e in _entries(kimi, truth[:-1])]
    entries.append({"token": "", "bytes": [], "logprob": -0.1})
    resp = _response(REASONING, CONTENT, len(truth), entries)
    rec = apply_logprobs(kimi, _rebuild(kimi, resp), resp, LogprobPolicy())
    assert rec.ok and rec.output_ids == truth and "noncanonical_split" in rec.issues
    assert record_fields(rec)["logprobs"]["empty_tail"] == 1
    # An empty entry inside the sequence cannot be identified: ignored, flagged.
    entries.insert(2, {"token": "", "bytes": []})
    resp = _response(REASONING, CONTENT, len(truth), entries)
    rec = apply_logprobs(kimi, _rebuild(kimi, resp), resp, LogprobPolicy())
    assert "logprobs_invalid" in rec.issues and rec.output_ids != truth


def test_whole_output_noncanonical_split_recovered(kimi: Model) -> None:
    truth = _split_digits(kimi, _truth(kimi))
    canonical = _truth(kimi)
    assert truth != canonical and len(truth) == len(canonical)
    # Without logprobs: the billing check passes and the canonical (wrong) ids are kept.
    plain = _rebuild(kimi, _response(REASONING, CONTENT, len(truth), None))
    assert plain.ok and plain.output_ids == canonical
    # The engine's tokens, without the end-of-turn token (as many servers send them).
    resp = _response(REASONING, CONTENT, len(truth), _entries(kimi, truth[:-1]))
    rec = apply_logprobs(kimi, _rebuild(kimi, resp), resp, LogprobPolicy())
    assert rec.ok and rec.output_ids == truth
    assert "noncanonical_split" in rec.issues
    fields = record_fields(rec)
    assert fields["id_sources"] == [
        [0, len(truth) - 1, "engine"],
        [len(truth) - 1, len(truth), "reencoded"],
    ]
    split = fields["logprobs"]["splits"][0]
    assert split["engine"] == ["12", "345"] and split["reencoded"] == ["123", "45"]
    assert fields["logprobs"]["coverage"] == "whole"
    assert len(rec.loss_mask) == len(rec.prompt_ids) + len(truth)

    keep = apply_logprobs(kimi, _rebuild(kimi, resp), resp, LogprobPolicy(record_ids="reencoded"))
    assert keep.output_ids == canonical and "noncanonical_split" in keep.issues


def test_agreeing_logprobs_confirm_the_reconstruction(kimi: Model) -> None:
    truth = _truth(kimi)
    resp = _response(REASONING, CONTENT, len(truth), _entries(kimi, truth))
    rec = apply_logprobs(kimi, _rebuild(kimi, resp), resp, LogprobPolicy())
    assert rec.ok and rec.issues == [] and rec.output_ids == truth
    assert record_fields(rec)["id_sources"] == [[0, len(truth), "confirmed"]]
    assert record_fields(rec)["logprobs"]["agree"] is True


def test_content_only_logprobs_cover_the_content_span(kimi: Model) -> None:
    canonical = _truth(kimi)
    think = canonical.index(kimi.markers["</think>"])
    content_ids = _split_digits(kimi, _ids(kimi, CONTENT))
    truth = canonical[: think + 1] + content_ids + canonical[-1:]
    resp = _response(REASONING, CONTENT, len(truth), _entries(kimi, content_ids))
    rec = apply_logprobs(kimi, _rebuild(kimi, resp), resp, LogprobPolicy())
    assert rec.ok and rec.output_ids == truth
    lp = record_fields(rec)
    assert lp["logprobs"]["coverage"] == "content"
    assert lp["id_sources"] == [
        [0, think + 1, "reencoded"],
        [think + 1, think + 1 + len(content_ids), "engine"],
        [len(truth) - 1, len(truth), "reencoded"],
    ]


def test_text_changed_by_the_server_is_a_logprob_mismatch(kimi: Model) -> None:
    # The server's text differs from the engine's tokens inside a piece ("Paris" -> "paris"):
    # either side may have been changed, so neither is trusted.
    truth = _truth(kimi)
    think = truth.index(kimi.markers["</think>"])
    changed = "p" + CONTENT[1:]
    resp = _response(REASONING, changed, len(truth), _entries(kimi, truth[think + 1 :]))
    base = _rebuild(kimi, resp)
    rec = apply_logprobs(kimi, base, resp, LogprobPolicy())
    assert not rec.ok and "logprob_mismatch" in rec.issues
    mismatch = record_fields(rec)["logprobs"]["mismatch"]
    assert mismatch["output_token"] == think + 1 and mismatch["engine_token"] == 0
    assert mismatch["engine_piece"] == "Paris" and mismatch["reencoded_piece"] == "par"
    assert "Paris" in mismatch["engine_context"]
    assert rec.output_ids == base.output_ids  # never trusted where the texts disagree
    assert record_fields(rec)["logprobs"]["engine_ids"] == truth[think + 1 :]  # kept to inspect


def test_whitespace_a_stack_changes_beside_a_marker_keeps_the_engines_ids(kimi: Model) -> None:
    # vLLM-style spacing: the server says " Paris ..." where the engine wrote "Paris ...".
    # Whitespace at the edge of a piece between markers is what stacks add or strip; the text
    # agrees everywhere else, so the engine's tokens are the ids (billing checked on them).
    truth = _truth(kimi)
    think = truth.index(kimi.markers["</think>"])
    resp = _response(REASONING, " " + CONTENT, len(truth), _entries(kimi, truth[think + 1 :]))
    base = _rebuild(kimi, resp)
    assert base.output_ids != truth  # re-encoding keeps the stack's space
    rec = apply_logprobs(kimi, base, resp, LogprobPolicy())
    assert rec.output_ids == truth
    assert "stack_changed_text" in rec.issues and "logprob_mismatch" not in rec.issues
    lp = record_fields(rec)["logprobs"]
    assert lp["stack_trims"][0]["after_marker"] == "</think>"
    trim = lp["stack_trims"][0]
    assert (trim["engine"], trim["text"]) == (CONTENT, " " + CONTENT)
    assert record_fields(rec)["id_sources"][1] == [think + 1, len(truth), "engine"]
    # A space inside the piece is not a stack's edge change: still a mismatch.
    inner = CONTENT.replace("has ", "has  ")
    resp = _response(REASONING, inner, len(truth), _entries(kimi, truth[think + 1 :]))
    rec = apply_logprobs(kimi, _rebuild(kimi, resp), resp, LogprobPolicy())
    assert not rec.ok and "logprob_mismatch" in rec.issues
    # Billing still decides: an engine sequence one id short of the bill is flagged.
    resp = _response(REASONING, " " + CONTENT, len(truth) + 1, _entries(kimi, truth[think + 1 :]))
    rec = apply_logprobs(kimi, _rebuild(kimi, resp), resp, LogprobPolicy())
    assert not rec.ok and "billing_mismatch" in rec.issues and rec.output_ids == truth


def test_a_stripped_reasoning_tail_is_proven_by_whole_output_logprobs(kimi: Model) -> None:
    # vLLM strips the reasoning's trailing newline ("first.\n" is one Kimi token, so billing
    # cannot see it); whole-output logprobs hold it: the record is the engine's, tail and all.
    reasoning = REASONING + "\n"
    truth = _truth(kimi, reasoning=reasoning)
    resp = _response(REASONING, CONTENT, len(truth), _entries(kimi, truth))
    base = reconstruct(kimi, MESSAGES, None, resp)  # the unknown profile: tail unverifiable
    assert not base.ok and "reasoning_tail_unverifiable" in base.issues
    rec = apply_logprobs(kimi, base, resp, LogprobPolicy())
    assert rec.ok and rec.output_ids == truth
    assert "reasoning_tail_unverifiable" not in rec.issues and "stack_changed_text" in rec.issues
    trim = record_fields(rec)["logprobs"]["stack_trims"][0]
    assert trim["before_marker"] == "</think>" and trim["engine"] == reasoning


def test_coerced_arguments_are_explained_by_whole_output_logprobs(kimi: Model) -> None:
    # vLLM 0.33 coerces a string the schema types as integer ("10" -> 10) and re-serialises
    # the arguments; the engine's tokens hold what the model wrote.
    tools = [{"type": "function", "function": {"name": "wait", "parameters": {
        "type": "object", "properties": {"seconds": {"type": "integer"}}}}}]  # fmt: skip
    model_args, served_args = '{"seconds": "10"}', '{"seconds": 10}'
    calls = [{"id": "functions.wait:0", "type": "function",
              "function": {"name": "wait", "arguments": model_args}}]  # fmt: skip
    m = kimi.markers
    truth = (
        _ids(kimi, REASONING) + [m["</think>"], m["<|tool_calls_section_begin|>"],
        m["<|tool_call_begin|>"]] + _ids(kimi, "functions.wait:0")
        + [m["<|tool_call_argument_begin|>"]] + _ids(kimi, model_args)
        + [m["<|tool_call_end|>"], m["<|tool_calls_section_end|>"], m["<|im_end|>"]]
    )  # fmt: skip
    resp = _response(REASONING, "", len(truth), _entries(kimi, truth))
    served = [{**calls[0], "function": {"name": "wait", "arguments": served_args}}]
    resp["choices"][0]["message"]["tool_calls"] = served
    base = reconstruct(kimi, MESSAGES, tools, resp, serving=TAIL_KEPT)
    assert "tool_arguments_maybe_coerced" in base.issues
    rec = apply_logprobs(kimi, base, resp, LogprobPolicy())
    assert rec.ok and rec.output_ids == truth, rec.issues
    assert "tool_arguments_maybe_coerced" not in rec.issues
    # Without the coercion flag (a profile that says arguments are verbatim) the same
    # difference is a mismatch: nothing declared explains it.
    verbatim = reconstruct(kimi, MESSAGES, None, resp, serving=TAIL_KEPT)
    rec = apply_logprobs(kimi, verbatim, resp, LogprobPolicy())
    assert not rec.ok and "logprob_mismatch" in rec.issues


def test_marker_turned_into_text_is_not_a_split(kimi: Model) -> None:
    # The bytes agree, but the engine sampled the </think> marker where the answer spells it
    # as text inside content: a different token stream, not a split.
    truth = _truth(kimi)
    text = REASONING + "</think>" + CONTENT
    resp = _response("", "", len(truth), _entries(kimi, truth))
    resp["choices"][0]["message"]["content"] = text
    resp["choices"][0]["message"]["reasoning"] = None
    base = _rebuild(kimi, resp)
    rec = apply_logprobs(kimi, base, resp, LogprobPolicy())
    assert rec.output_ids == truth  # reasoning_from_content split it at the marker already
    # Now the same answer where the engine's tokens spell "</think>" as ordinary text.
    as_text = _ids(kimi, REASONING + "</think>" + CONTENT) + truth[-1:]
    resp2 = _response(REASONING, CONTENT, len(as_text), _entries(kimi, as_text))
    rec2 = apply_logprobs(kimi, _rebuild(kimi, resp2), resp2, LogprobPolicy())
    assert not rec2.ok and "logprob_mismatch" in rec2.issues


def test_bad_logprobs_are_flagged_and_ignored(kimi: Model) -> None:
    truth = _truth(kimi)
    entries = _entries(kimi, truth)
    entries[1:3] = [{"token": "glued", "bytes": entries[1]["bytes"] + entries[2]["bytes"]}]
    resp = _response(REASONING, CONTENT, len(truth), entries)
    base = _rebuild(kimi, resp)
    rec = apply_logprobs(kimi, base, resp, LogprobPolicy())
    assert "logprobs_invalid" in rec.issues and rec.output_ids == base.output_ids
    assert "entry 1" in record_fields(rec)["logprobs"]["invalid"]
    resp["choices"][0]["logprobs"]["content"][0]["bytes"] = "not a list"
    rec = apply_logprobs(kimi, base, resp, LogprobPolicy())
    assert "logprobs_invalid" in rec.issues and rec.output_ids == base.output_ids


def test_count_changing_split_fixes_the_billing_check(kimi: Model) -> None:
    tok = kimi.tokenizer
    canonical = _truth(kimi)
    i = canonical.index(tok.id_of_bytes(b" first"))
    truth = canonical[:i] + [tok.id_of_bytes(b" fir"), tok.id_of_bytes(b"st")] + canonical[i + 1 :]
    resp = _response(REASONING, CONTENT, len(truth), None)
    plain = _rebuild(kimi, resp)
    assert not plain.ok and "billing_mismatch" in plain.issues
    resp = _response(REASONING, CONTENT, len(truth), _entries(kimi, truth))
    rec = apply_logprobs(kimi, _rebuild(kimi, resp), resp, LogprobPolicy())
    assert rec.ok and rec.output_ids == truth and "billing_mismatch" not in rec.issues
    assert rec.completion_tokens_reconstructed == len(truth)


def test_missing_logprobs_noted_only_when_asked(kimi: Model) -> None:
    truth = _truth(kimi)
    resp = _response(REASONING, CONTENT, len(truth), None)
    base = _rebuild(kimi, resp)
    assert (
        "logprobs_missing" in apply_logprobs(kimi, base, resp, LogprobPolicy(requested=True)).issues
    )
    assert apply_logprobs(kimi, base, resp, LogprobPolicy()).issues == base.issues
    with pytest.raises(ValueError, match="record_ids"):
        LogprobPolicy(record_ids="canonical")


def test_generate_writes_the_engines_ids_over_http(
    kimi: Model, kimi_dir: Path, tmp_path: Path, fake_openrouter: Any, api_key_env: str
) -> None:
    """Non-canonical splits, same count as canonical: with provider.logprobs=true the
    records hold the engine's ids exactly; without, they hold the canonical ids, ok."""
    stack = Stack(kimi, "splitty", splits=2, logprobs="whole")
    srv = fake_openrouter(default=Behaviour(stack=stack))
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 3, tools_every=2, text=lambda i: f"Question {i}: call calc?")
    out = tmp_path / "with"
    status, summary = run_inprocess(
        [*base_overrides(prompts, srv.url(), out, kimi_dir), "provider.logprobs=true", *KEPT], out
    )
    assert status == 0 and summary is not None
    body = srv.requests[0].body
    assert body["logprobs"] is True and body["provider"]["require_parameters"] is True
    records = {r["id"]: r for r in read_jsonl(out / "records.jsonl")}
    assert set(records) == set(ids)
    for i, rid in enumerate(ids):
        truth = stack.emitted[f"Question {i}: call calc?"]
        rec = records[rid]
        assert rec["output_ids"] == truth, rid
        assert rec["ok"] and "noncanonical_split" in rec["issues"]
        assert rec["completion_tokens_reported"] == len(truth)
        assert rec["id_sources"][0][2] == "engine"

    out2 = tmp_path / "without"
    # The scripted stack sends the model's arguments as written ({"expr": "12345"} could
    # otherwise be a coercing stack's text for 12345: core/coercion.py).
    verbatim = "serving.argument_types=verbatim"
    status, _ = run_inprocess(
        [*base_overrides(prompts, srv.url(), out2, kimi_dir), *KEPT, verbatim], out2
    )
    assert status == 0
    for rec in read_jsonl(out2 / "records.jsonl"):
        truth = stack.emitted[f"Question {int(rec['id'][1:])}: call calc?"]
        # The limitation logprobs remove: same count, billing agrees, ids are not the truth.
        assert rec["ok"] and rec["output_ids"] != truth and len(rec["output_ids"]) == len(truth)
        assert "logprobs" not in rec and "id_sources" not in rec  # not asked, not sent


def test_reconstruct_stage_uses_logprobs(kimi: Model, kimi_dir: Path, tmp_path: Path) -> None:
    import json

    from kimi_pipe.stages.reconstruct import main

    truth = _split_digits(kimi, _truth(kimi))
    resp = _response(REASONING, CONTENT, len(truth), _entries(kimi, truth))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "messages": MESSAGES, "response": resp}) + "\n")
    args = ["model=kimi_k25", f"model.tokenizer.path={kimi_dir}", f"input={src}", f"output={dst}"]
    assert main(args) == 0
    rec = json.loads(dst.read_text())
    assert rec["output_ids"] == truth and rec["id_sources"] == [[0, len(truth), "engine"]]
    assert main([*args, "validation.record_ids=reencoded"]) == 0
    rec = json.loads(dst.read_text())
    assert rec["output_ids"] == _truth(kimi) and "noncanonical_split" in rec["issues"]


def test_byte_level_hf_tokenizer_maps_entries_by_bytes() -> None:
    """The same mapping on a Hugging Face byte-level BPE (SmolLM2), including tokens that
    are half of a UTF-8 character."""
    from conftest import load_or_skip

    small = load_or_skip("smollm2")
    ids = small.tokenizer.encode_ordinary("héllo wörld 日本 12345")
    pieces = [small.tokenizer.token_bytes(t) for t in ids]
    assert b"".join(pieces) == "héllo wörld 日本 12345".encode()
    assert any(_not_utf8(p) for p in pieces)  # a token that is part of a character
    assert engine_ids(small, _entries(small, ids)) == ids
    im_end = small.markers["<|im_end|>"]
    assert engine_ids(small, [{"token": "<|im_end|>", "bytes": list(b"<|im_end|>")}]) == [im_end]


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_only_empty_entries_change_nothing(kimi: Model) -> None:
    truth = _truth(kimi)
    resp = _response(REASONING, CONTENT, len(truth), [{"token": "", "bytes": []}])
    base = _rebuild(kimi, resp)
    rec = apply_logprobs(kimi, base, resp, LogprobPolicy())
    assert rec.output_ids == base.output_ids and rec.issues == base.issues
    assert record_fields(rec)["id_sources"] == [[0, len(truth), "reencoded"]]


def test_unknown_tail_is_proven_only_by_whole_logprobs(kimi: Model) -> None:
    """Under the default `unknown` profile a reasoning ending in punctuation may have lost a
    newline (vLLM 0.33 strips it; same token count): flagged, unless the engine's own tokens
    cover the whole output, reasoning end included."""
    truth = _truth(kimi)
    assert REASONING[-1] in ".!?"
    plain = reconstruct(kimi, MESSAGES, None, _response(REASONING, CONTENT, len(truth), None))
    assert not plain.ok and plain.issues == ["reasoning_tail_unverifiable"]
    resp = _response(REASONING, CONTENT, len(truth), _entries(kimi, truth))
    whole = apply_logprobs(kimi, reconstruct(kimi, MESSAGES, None, resp), resp, LogprobPolicy())
    assert whole.ok and whole.issues == [] and whole.output_ids == truth


def test_corrupt_logprobs_are_not_proof_even_under_a_declared_profile(kimi: Model) -> None:
    """Issue 19 item 5: logprobs that are no tokens (two entries glued, a byte out of range)
    mean the answer was changed between the engine and us: the re-encoded text, which on its
    own passes every check under the declared profile, is not proof. Flagged, never `ok`."""
    truth = _truth(kimi)
    plain = _rebuild(kimi, _response(REASONING, CONTENT, len(truth), None))
    assert plain.ok  # without logprobs the same answer is proven by text + profile + billing
    entries = _entries(kimi, truth)
    entries[1:3] = [{"token": "glued", "bytes": entries[1]["bytes"] + entries[2]["bytes"]}]
    resp = _response(REASONING, CONTENT, len(truth), entries)
    rec = apply_logprobs(kimi, _rebuild(kimi, resp), resp, LogprobPolicy())
    assert "logprobs_invalid" in rec.issues and not rec.ok
    out_of_range = _entries(kimi, truth)
    out_of_range[0]["bytes"] = [300]
    resp = _response(REASONING, CONTENT, len(truth), out_of_range)
    rec = apply_logprobs(kimi, _rebuild(kimi, resp), resp, LogprobPolicy())
    assert "logprobs_invalid" in rec.issues and not rec.ok
    # Through the one reconstruction entry the record's rung says so.
    from kimi_pipe.core.record_builder import RecordBuilder

    record = RecordBuilder(kimi, TAIL_KEPT).build(MESSAGES, None, resp)
    assert not record["ok"] and record["evidence"] == "unresolved"
