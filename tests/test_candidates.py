"""Closed candidate sets and the evidence ladder, with the real Kimi tokenizer.

Each answer here is built from ids the model could have emitted (`truth`), passed through
what a stack does (tail stripped, spaces beside markers, a space moved), then reconstructed:
the truth must be among the options, a one-member closed set must equal the truth, and a
set the rules cannot bound must say it is open.
"""

from __future__ import annotations

from itertools import product
from typing import Any

from conftest import TAIL_KEPT

from kimi_pipe.core.candidates import (
    NO_OPTION_FITS,
    READING_DISTANCE,
    SINGLE_CANDIDATE,
    enumerate_candidates,
)
from kimi_pipe.core.evidence import (
    DEFAULT_ACCEPT,
    ENGINE_IDS,
    TEXT_PROVEN,
    UNRESOLVED,
    evidence_of,
    parse_accept,
    sampling_of,
    usable,
)
from kimi_pipe.core.models import Model
from kimi_pipe.core.reconstruction import reconstruct
from kimi_pipe.core.record_builder import RecordBuilder
from kimi_pipe.core.serving import ServingProfile
from kimi_pipe.extraction.split_check import checkable
from tests.support.candidate_sets import sequences_of

MESSAGES = [{"role": "user", "content": "x"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _response(
    reasoning: str | None,
    content: str,
    billed: int | None,
    calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = calls
    usage = {"completion_tokens": billed} if billed is not None else None
    return {"choices": [{"message": message, "finish_reason": "stop"}], "usage": usage}


def _truth(kimi: Model, text: str) -> list[int]:
    return kimi.tokenizer.encode_with_markers(text)


def _options(kimi: Model, response: dict[str, Any], profile: ServingProfile, **kw: Any):
    rec = reconstruct(kimi, MESSAGES, kw.get("tools"), response, serving=profile)
    return rec, enumerate_candidates(
        kimi, MESSAGES, kw.get("tools"), response, rec, profile=profile,
        billing_tolerance=kw.get("tolerance", 0),
    )  # fmt: skip


def test_stripped_reasoning_tail_is_a_closed_set_holding_the_truth(kimi: Model) -> None:
    """vLLM 0.33 strips `it.\\n` to `it.` at the same count: both, and every longer newline
    run that stays one token after the period, are options; billing bounds the set."""
    truth = _truth(kimi, "Check it.\n</think>Done.<|im_end|>")
    response = _response("Check it.", "Done.", len(truth))
    for profile in (ServingProfile(), ServingProfile(reasoning_tail="stripped")):
        rec, cands = _options(kimi, response, profile)
        assert not rec.ok and "reasoning_tail_unverifiable" in rec.issues
        assert cands is not None and cands.closed and cands.why_open is None
        ids = [o.output_ids for o in cands.options]
        assert truth in ids and rec.output_ids in ids and len(ids) >= 2
        assert cands.classes == ["reasoning_tail"]
        assert cands.options[0].label == "as returned"
        # They differ at the reasoning's last token (the period, with or without newlines).
        period = len(_truth(kimi, "Check it"))
        assert cands.diverge_at == period
        # Every option has the billed length and a mask over prompt + output.
        for o in cands.options:
            assert len(o.output_ids) == len(truth)
            assert len(o.loss_mask) == len(rec.prompt_ids) + len(o.output_ids)
        # Closed means complete: no other newline/CR tail up to 6 characters fits billing.
        fits = {
            "".join(t)
            for n in range(7)
            for t in product("\n\r", repeat=n)
            if len(_truth(kimi, "Check it." + "".join(t))) == len(_truth(kimi, "Check it."))
        }
        assert len(fits) == len(ids)


def test_one_fitting_tail_is_a_proof_and_the_record_is_text_proven(kimi: Model) -> None:
    """A reasoning whose last character does not join a newline into one token: billing
    leaves exactly one option, so the default profile proves the ids (flag -> note)."""
    reasoning = "Done 🙂"  # an emoji: its newline is an id of its own
    assert len(_truth(kimi, reasoning + "\n")) > len(_truth(kimi, reasoning))
    truth = _truth(kimi, reasoning + "</think>Hi.<|im_end|>")
    response = _response(reasoning, "Hi.", len(truth))
    rec, cands = _options(kimi, response, ServingProfile())
    assert "reasoning_tail_unverifiable" in rec.issues and not rec.ok
    assert cands is not None and cands.proves and cands.options[0].output_ids == truth
    record = RecordBuilder(kimi).build(MESSAGES, None, response, {"temperature": 0.6})
    assert record["ok"] and record["evidence"] == TEXT_PROVEN
    assert record["output_ids"] == truth and "candidates" not in record
    assert SINGLE_CANDIDATE in record["issues"]
    assert "reasoning_tail_unverifiable" not in record["issues"]
    assert record["sampling"] == {"temperature": 0.6, "top_p": None}


def test_two_options_stay_unresolved_with_their_candidates(kimi: Model) -> None:
    truth = _truth(kimi, "Check it.</think>Done.<|im_end|>")
    response = _response("Check it.", "Done.", len(truth))
    record = RecordBuilder(kimi).build(MESSAGES, None, response)
    # Not ok: the readings' shared prefix only is proven (tests/test_prefix_proven.py).
    assert not record["ok"] and record["evidence"] == "prefix_proven"
    cands = record["candidates"]
    assert cands["closed"] and truth in [o["output_ids"] for o in cands["options"]]
    assert record["sampling"] is None  # no request known
    kept = RecordBuilder(kimi, TAIL_KEPT).build(MESSAGES, None, response)
    assert kept["ok"] and kept["evidence"] == TEXT_PROVEN and kept["output_ids"] == truth


def test_letter_tail_one_id_short_is_an_open_set(kimi: Model) -> None:
    """`it\\n` stripped to `it`: billing sees one id missing, but any whitespace token could
    be it: the newline runs are listed, the set says it is open."""
    truth = _truth(kimi, "Check it\n</think>Done.<|im_end|>")
    response = _response("Check it", "Done.", len(truth))
    rec, cands = _options(kimi, response, ServingProfile(reasoning_tail="stripped"))
    assert rec.issues == ["billing_mismatch"]
    assert cands is not None and not cands.closed and "whitespace" in (cands.why_open or "")
    assert truth in [o.output_ids for o in cands.options]
    kept_rec, kept = _options(kimi, response, TAIL_KEPT)
    assert kept is None  # a stack that keeps the tail: the mismatch is not this ambiguity


def test_no_billing_and_a_tolerance_leave_the_set_open(kimi: Model) -> None:
    truth = _truth(kimi, "Done 🙂</think>Hi.<|im_end|>")
    _, no_usage = _options(kimi, _response("Done 🙂", "Hi.", None), ServingProfile())
    assert no_usage is not None and not no_usage.closed
    assert "no billed" in (no_usage.why_open or "")
    _, tolerant = _options(
        kimi, _response("Done 🙂", "Hi.", len(truth)), ServingProfile(), tolerance=1
    )
    assert tolerant is not None and not tolerant.closed
    record = RecordBuilder(kimi).build(MESSAGES, None, _response("Done 🙂", "Hi.", None))
    assert not record["ok"] and record["candidates"]["closed"] is False


def test_model_space_after_marker_is_proven_when_the_spaced_reading_is_impossible(
    kimi: Model,
) -> None:
    """Content starts with a space, the reasoning does not: a stack that spaces every marker
    would have spaced the reasoning too, so the space is the model's (one option)."""
    truth = _truth(kimi, "I greet back</think> Hello<|im_end|>")
    response = _response("I greet back", " Hello", len(truth))
    rec, cands = _options(kimi, response, ServingProfile())
    assert rec.issues == ["leading_space_after_marker"]
    assert cands is not None and cands.proves and cands.options[0].output_ids == truth
    record = RecordBuilder(kimi).build(MESSAGES, None, response)
    assert record["ok"] and record["evidence"] == TEXT_PROVEN and record["output_ids"] == truth


def test_spaced_answer_leaves_both_readings(kimi: Model) -> None:
    """Spaces on both sides of every marker: the stack's (vLLM) or the model's? Both fit."""
    spaced = _truth(kimi, " I greet back </think> Hello<|im_end|>")
    plain = _truth(kimi, "I greet back</think>Hello<|im_end|>")
    response = _response(" I greet back ", " Hello", len(plain))
    rec, cands = _options(kimi, response, ServingProfile(reasoning_tail="kept"))
    assert "leading_space_after_marker" in rec.issues
    assert cands is not None and cands.closed and cands.classes == ["marker_space"]
    ids = [o.output_ids for o in cands.options]
    assert plain in ids
    # The model's own spaces cost no id here (" I" and "I" are one token each) when the billed
    # count matches; otherwise billing removes that reading.
    assert (spaced in ids) == (len(spaced) == len(plain))


def test_space_before_tool_section_moves_back_into_the_arguments(kimi: Model) -> None:
    """SGLang 0.5.14 streaming: `<|tool_call_argument_begin|> {"` arrives as content ending
    in a space and arguments without it. Both readings are options."""
    args = '{"city": "Paris"}'
    truth = _truth(
        kimi,
        "Check.</think>Let me look.<|tool_calls_section_begin|><|tool_call_begin|>"
        "functions.get_weather:0<|tool_call_argument_begin|> " + args
        + "<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
    )  # fmt: skip
    calls = [{"id": "functions.get_weather:0", "type": "function",
              "function": {"name": "get_weather", "arguments": args}}]  # fmt: skip
    profile = ServingProfile(reasoning_tail="kept", marker_spacing="none",
                             tool_call_ids="model", argument_types="verbatim")  # fmt: skip
    response = _response("Check.", "Let me look. ", len(truth), calls)
    rec, cands = _options(kimi, response, profile, tools=TOOLS)
    assert "space_before_tool_section" in rec.issues and not rec.ok
    # Open: SGLang 0.5.14 also strips the arguments' trailing space (its corpus shows it), and
    # other whitespace there could hide at the same count.
    # The arguments' edges are unknown to this profile (SGLang strips them): their readings
    # join the options (issue 30).
    assert cands is not None and not cands.closed
    assert cands.classes == ["argument_edges", "tool_section_space"]
    ids = [o.output_ids for o in cands.options]
    assert truth in ids
    # "look. " costs an id more than "look." (' {"' and '{"' are one each): billing keeps the
    # as-returned reading only where the counts agree.
    assert (rec.output_ids in ids) == (len(rec.output_ids) == len(truth))
    moved = next(o for o in cands.options if o.output_ids == truth)
    assert moved.label.startswith("content's last space moved")


def test_other_errors_are_not_enumerated(kimi: Model) -> None:
    response = _response("Check it.", "Done.", 3)  # billed far below the text
    _, cands = _options(kimi, response, ServingProfile())
    assert cands is None  # billing_mismatch with too few ids: no stripped tail explains it
    cut = _response("Check it.", "Done", 99)
    cut["choices"][0]["finish_reason"] = "length"
    _, cands = _options(kimi, cut, ServingProfile())
    assert cands is None


def test_evidence_helpers() -> None:
    assert DEFAULT_ACCEPT == ("engine_ids", "text_proven", "target_resolved", "prefix_proven")
    old = {"ok": True, "issues": [], "output_ids": [1]}
    assert evidence_of(old) == TEXT_PROVEN and usable(old)
    engine = {**old, "logprobs": {"coverage": "whole", "agree": True},
              "id_sources": [[0, 1, "confirmed"]]}  # fmt: skip
    assert evidence_of(engine) == ENGINE_IDS
    flagged = {"ok": False, "issues": ["reasoning_tail_unverifiable"], "output_ids": [1]}
    assert evidence_of(flagged) == UNRESOLVED and not usable(flagged)
    assert usable(flagged, ("unresolved",))
    partial = {"ok": False, "issues": ["truncated", "partial_character"], "output_ids": [1],
               "evidence": "unresolved"}  # fmt: skip
    assert not usable(partial, ("unresolved",))  # never, whatever the policy
    assert parse_accept(None) == DEFAULT_ACCEPT and parse_accept(["text_proven"]) == (
        "text_proven",
    )
    try:
        parse_accept(["ok"])
    except ValueError as exc:
        assert "unknown rung" in str(exc)
    else:
        raise AssertionError("an unknown rung was accepted")
    assert sampling_of({"params": {"temperature": 1.0, "top_p": 0.9, "top_k": 20}}) == {
        "temperature": 1.0, "top_p": 0.9, "top_k": 20,
    }  # fmt: skip


def test_server_shape_corpus_has_no_silent_record_and_sets_hold_the_truth(kimi: Model) -> None:
    """Through the one reconstruction entry, under `unknown` and the declared profiles: every
    `ok` record (text_proven, single candidates and cut answers included) carries the ground
    truth, and every closed candidate set lists it among its options."""
    from test_server_shapes import corpus, declared_profile

    unknown = RecordBuilder(kimi)
    rungs: dict[str, int] = {}
    closed = 0
    for stem, r in corpus():
        truth = r["ground_truth_output_ids"]
        for builder in (unknown, RecordBuilder(kimi, declared_profile(r))):
            record = builder.build(r["messages"], r["tools"], r["response"])
            rungs[record["evidence"]] = rungs.get(record["evidence"], 0) + 1
            if record["ok"]:
                assert record["output_ids"] == truth, (stem, r["id"], record["issues"])
            cands = record.get("candidates")
            if cands and cands["closed"]:
                closed += 1
                assert tuple(truth) in sequences_of(cands["options"]), (stem, r["id"])
    assert rungs.get(TEXT_PROVEN, 0) > 0 and rungs.get(UNRESOLVED, 0) > 0 and closed > 0


def test_extraction_keeps_the_accepted_rungs_and_never_a_lost_last_id(tmp_path) -> None:
    """extract.accept (and only_ok, from which it derives by default): proven rungs in,
    flagged out, a cut answer with proven ids in, `partial_character` out whatever the policy."""
    import json

    from kimi_pipe.extraction.token_samples import read_token_records

    def rec(sid: str, ok: bool, issues: list[str], evidence: str | None = None) -> dict:
        row = {"id": sid, "ok": ok, "issues": issues, "prompt_ids": [1], "output_ids": [2, 3],
               "loss_mask": [0, 1, 1]}  # fmt: skip
        if evidence:
            row["evidence"] = evidence
        return row

    rows = [
        rec("proven", True, [], "text_proven"),
        rec("cut", True, ["truncated"], "text_proven"),
        rec("old_style", True, []),  # written before the ladder: derived from ok
        rec("flagged", False, ["reasoning_tail_unverifiable"], "unresolved"),
        rec("lost_last_id", False, ["truncated", "partial_character"], "unresolved"),
    ]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    kept, counts = read_token_records(path)
    assert [s.id for s in kept] == ["proven", "cut", "old_style"]
    assert counts["skipped_not_ok"] == 2
    everything, _ = read_token_records(path, only_ok=False)
    assert [s.id for s in everything] == ["proven", "cut", "old_style", "flagged"]
    flagged_only, counts = read_token_records(path, accept=["unresolved"])
    assert [s.id for s in flagged_only] == ["flagged"] and counts["skipped_by_accept"] == 3


def test_faithful_provider_under_the_default_profile(
    kimi: Model, kimi_cases: list[dict[str, Any]]
) -> None:
    """Hand-written answers of a provider that changes nothing, no profile named: nothing
    silent; every closed candidate set holds the true ids (for the target model to resolve);
    what has no set is a real fault. Issue 19's 98 % text_proven
    needs more evidence than text and billing give (README "Evidence ladder and yield")."""
    from conftest import expected_output_ids

    builder = RecordBuilder(kimi)
    proven = resolvable = 0
    for case in kimi_cases:
        record = builder.build(case["messages"], case.get("tools"), case["response"])
        truth = expected_output_ids(kimi, case)
        if record["ok"]:
            proven += 1
            assert record["output_ids"] == truth, case["id"]
        elif "candidates" in record:
            options = [o["output_ids"] for o in record["candidates"]["options"]]
            if record["candidates"]["closed"]:  # an open set may miss it: never resolved
                assert truth in options, case["id"]
                resolvable += 1
        else:
            faults = {"malformed_response", "provider_error", "billing_mismatch"}
            assert faults & set(record["issues"]), (case["id"], record["issues"])
    assert proven >= 6 and resolvable >= 13  # measured: 6 proven, 13 closed sets of 24


def test_a_reading_one_id_short_of_the_bill_is_kept_for_the_split_check(kimi: Model) -> None:
    """Spaces on both sides of the think-end marker: the model's or the stack's? With them the
    model's, " I count " ends in a space token of its own; without them "I count" does not, so
    the unspaced reading is one id short of the bill and billing keeps the spaced one. But the
    engine may have drawn the unspaced text with a split one id longer: that reading is kept
    in `short_readings` for the split check (extraction/split_check.py) to weigh."""
    spaced = _truth(kimi, " I count </think> Hello<|im_end|>")
    plain = _truth(kimi, "I count</think>Hello<|im_end|>")
    assert len(plain) == len(spaced) - 1
    # A streaming stack that keeps only the space after each marker (vLLM 0.15.1, issue 30)
    # reads the same text as "I count " + "Hello", at the spaced reading's length: two options.
    leading = _truth(kimi, "I count </think>Hello<|im_end|>")
    response = _response(" I count ", " Hello", len(spaced))
    rec, cands = _options(kimi, response, ServingProfile(reasoning_tail="kept"))
    assert cands is not None and cands.closed
    assert [o.output_ids for o in cands.options] == [spaced, leading]
    assert [o.output_ids for o in cands.short] == [plain]
    record = RecordBuilder(kimi, ServingProfile(reasoning_tail="kept")).build(
        MESSAGES, None, response
    )
    assert not record["ok"] and SINGLE_CANDIDATE not in record["issues"]
    assert [r["output_ids"] for r in record["short_readings"]] == [plain]


def test_a_reading_one_id_over_the_bill_is_kept_for_the_split_check(kimi: Model) -> None:
    """The mirror case: billed at the unspaced reading's length, the spaced one is one id over
    the bill; a split of it one id shorter (BPE's canonical split is not always the shortest)
    would fit. It is kept in `long_readings`."""
    spaced = _truth(kimi, " I count </think> Hello<|im_end|>")
    plain = _truth(kimi, "I count</think>Hello<|im_end|>")
    response = _response(" I count ", " Hello", len(plain))
    rec, cands = _options(kimi, response, ServingProfile(reasoning_tail="kept"))
    assert cands is not None and cands.closed
    assert [o.output_ids for o in cands.options] == [plain]
    leading = _truth(kimi, "I count </think>Hello<|im_end|>")  # vLLM 0.15.1 streaming
    assert [o.output_ids for o in cands.long] == [spaced, leading] and cands.short == []
    record = RecordBuilder(kimi, ServingProfile(reasoning_tail="kept")).build(
        MESSAGES, None, response
    )
    assert [r["output_ids"] for r in record["long_readings"]] == [spaced, leading]


def test_newline_readings_a_few_ids_off_the_bill_are_kept_for_the_split_check(
    kimi: Model,
) -> None:
    """A stripped `it.\\n\\n`: the options are the runs that join the period (no id of their
    own). Longer newline runs cost one to three ids more; an engine that drew one of them split
    shorter than BPE's encoding would match the bill too, so they are kept as `long_readings`
    (never beyond READING_DISTANCE ids, as far as the split check's departures reach)."""
    truth = _truth(kimi, "Check it.\n\n</think>Done.<|im_end|>")
    response = _response("Check it.", "Done.", len(truth))
    rec, cands = _options(kimi, response, ServingProfile(reasoning_tail="stripped"))
    assert cands is not None and cands.closed and truth in [o.output_ids for o in cands.options]
    offs = sorted({len(o.output_ids) - len(truth) for o in cands.long})
    assert offs and offs[0] >= 1 and offs[-1] <= READING_DISTANCE
    assert cands.short == []  # no whitespace costs fewer than no ids
    options = {tuple(o.output_ids) for o in cands.options}
    assert all(tuple(o.output_ids) not in options for o in cands.long)
    texts = [kimi.tokenizer.decode(o.output_ids) for o in cands.long]
    tails = [t.removeprefix("Check it.").split("</think>")[0] for t in texts]
    assert all(tail and set(tail) <= {"\n", "\r"} for tail in tails), tails


def test_no_option_fitting_the_bill_keeps_the_readings_for_the_split_check(kimi: Model) -> None:
    """Billed one id under every reading's canonical encoding: the engine drew a shorter split
    somewhere. Nothing for the target to choose among (no option, an open set), but the
    readings are kept, and the split check takes the record (extraction/split_check.py)."""
    truth = _truth(kimi, "Check it.\n</think>Done.<|im_end|>")
    response = _response("Check it.", "Done.", len(truth) - 1)
    rec, cands = _options(kimi, response, ServingProfile(reasoning_tail="stripped"))
    assert cands is not None and cands.options == [] and not cands.closed
    assert cands.why_open == NO_OPTION_FITS and cands.keeps_readings
    assert truth in [o.output_ids for o in cands.long] and cands.short == []
    record = RecordBuilder(kimi, ServingProfile(reasoning_tail="stripped")).build(
        MESSAGES, None, response
    )
    assert not record["ok"] and record["evidence"] == "unresolved"
    assert truth in [r["output_ids"] for r in record["long_readings"]]
    assert checkable(record) == "billing_splits_off"  # the stack may have changed the text
    assert checkable(record, billing_splits=True) is None
