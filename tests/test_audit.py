"""Fidelity audit: classification of mismatches on the real SmolLM2 tokenizer, the engine
reply shapes it reads (SGLang /generate, return_token_ids), the stage end to end with bad
records, and real greedy ground truth with its resumable cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from kimi_pipe.reporting import audit as audit_mod
from kimi_pipe.reporting.audit import TruthIds, classify, json_spans, truth_from_reply
from kimi_pipe.store.local_model import LocalModelSpec, ensure_local_model

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smollm2():
    from kimi_pipe.config import compose
    from kimi_pipe.core.models import load_model

    conf = OmegaConf.load(REPO / "conf" / "model" / "smollm2.yaml")
    ensure_local_model(LocalModelSpec.from_cfg(conf.local_model))
    return load_model(compose(["model=smollm2"]).model)


def enc(model: Any, text: str) -> list[int]:
    return model.tokenizer.encode_ordinary(text)


def end_id(model: Any) -> int:
    return model.markers["<|im_end|>"]


# --------------------------------------------------------------------------- classify


def test_exact(smollm2) -> None:
    ids = enc(smollm2, "Hello there.") + [end_id(smollm2)]
    cmp = classify(ids, list(ids), smollm2.tokenizer.decode, {end_id(smollm2)})
    assert cmp.exact and cmp.klass is None and cmp.first_diff is None


def test_non_canonical_split(smollm2) -> None:
    canonical = enc(smollm2, "The capital")
    split = enc(smollm2, "The") + enc(smollm2, " cap") + enc(smollm2, "ital")
    assert split != canonical  # the engine sampled a split BPE would not make
    cmp = classify(split, canonical, smollm2.tokenizer.decode, {end_id(smollm2)})
    assert cmp.klass == "non_canonical_split"
    assert cmp.first_diff == 1 and cmp.truth_len == len(canonical) + 1


def test_partial_utf8_character_cut_by_max_tokens(smollm2) -> None:
    """Found by the demo: an answer cut inside an emoji ends with a lone byte token; the
    API text has U+FFFD there, which encodes to another id of the same length."""
    wave = enc(smollm2, "🌊")
    assert len(wave) > 1  # a byte-level emoji: several byte tokens
    truth = enc(smollm2, "Sea: 🌊") + wave[:1]
    recon = enc(smollm2, "Sea: 🌊\ufffd")
    cmp = classify(truth, recon, smollm2.tokenizer.decode, {end_id(smollm2)})
    assert cmp.klass == "partial_utf8" and cmp.first_diff == len(truth) - 1


def test_lost_whitespace(smollm2) -> None:
    e = end_id(smollm2)
    truth = enc(smollm2, "Sure!\n\nHere it is:  done") + [e]
    recon = enc(smollm2, "Sure! Here it is: done") + [e]
    cmp = classify(truth, recon, smollm2.tokenizer.decode, {e})
    assert cmp.klass == "lost_whitespace" and "lost" in cmp.detail


def test_tool_call_reserialised(smollm2) -> None:
    e = end_id(smollm2)
    truth = enc(smollm2, 'call get_weather {"city": "Paris", "days": [1, 2]}') + [e]
    recon = enc(smollm2, 'call get_weather {"days":[1,2],"city":"Paris"}') + [e]
    cmp = classify(truth, recon, smollm2.tokenizer.decode, {e})
    assert cmp.klass == "tool_call_reserialised"


def test_end_token_only(smollm2) -> None:
    e = end_id(smollm2)
    body = enc(smollm2, "The answer is 4.")
    cmp = classify(body, body + [e], smollm2.tokenizer.decode, {e})
    assert cmp.klass == "end_token" and cmp.first_diff == len(body)


def test_other_and_end_token_flag(smollm2) -> None:
    e = end_id(smollm2)
    decode = smollm2.tokenizer.decode
    cmp = classify(enc(smollm2, "Goodbye"), enc(smollm2, "Hello") + [e], decode, {e})
    assert cmp.klass == "other" and cmp.end_token_differs


def test_json_spans_outermost_only() -> None:
    spans = json_spans('a {"x": {"y": [1]}} b [2, 3] {not json')
    assert [v for _, _, v in spans] == [{"x": {"y": [1]}}, [2, 3]]


# --------------------------------------------------------------------------- reply shapes


def test_sglang_generate_reply() -> None:
    reply = {"text": "hi", "output_ids": [5, 6, 2], "meta_info": {"id": "x", "prompt_tokens": 3}}
    assert truth_from_reply(reply) == TruthIds([5, 6, 2], None, "sglang_generate")


def test_return_token_ids_chat_reply() -> None:
    reply = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "finish_reason": "stop",
                "token_ids": [7, 8, 2],
            }
        ],  # fmt: skip
    }
    assert truth_from_reply(reply) == TruthIds([7, 8, 2], [1, 2, 3], "return_token_ids")


def test_return_token_ids_completion_and_litellm_shapes() -> None:
    completion = {"choices": [{"text": "hi", "prompt_token_ids": [1], "token_ids": [9]}]}
    assert truth_from_reply(completion) == TruthIds([9], [1], "return_token_ids")
    # LiteLLM's model_dump moves unknown keys into provider_specific_fields.
    dumped = {
        "provider_specific_fields": {"prompt_token_ids": [4]},
        "choices": [{"message": {"content": "x"}, "provider_specific_fields": {"token_ids": [3]}}],
    }
    assert truth_from_reply(dumped) == TruthIds([3], [4], "return_token_ids")


def test_reply_without_ids() -> None:
    assert truth_from_reply({"choices": [{"message": {"content": "x"}}]}) is None
    assert truth_from_reply(None) is None
    assert truth_from_reply({"output_ids": [1, True]}) is None  # not a list of ids


# --------------------------------------------------------------------------- the stage


def _record(model: Any, rid: str, content: str, usage_tokens: int | None) -> dict[str, Any]:
    from kimi_pipe.core.reconstruction import reconstruct

    messages = [{"role": "user", "content": f"Question {rid}?"}]
    response = {
        "choices": [
            {"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ],
        "usage": {"completion_tokens": usage_tokens} if usage_tokens is not None else None,
    }
    rec = reconstruct(model, messages, None, response).to_record()
    return {"id": rid, **rec, "messages": messages, "tools": None, "request": {"max_tokens": 32},
            "response": response, "error": None}  # fmt: skip


def _compose(tmp_path: Path, *overrides: str) -> Any:
    from kimi_pipe.config import compose

    return compose(["model=smollm2", *overrides])


def run_audit(cfg: Any) -> dict[str, Any]:
    """The audit of a composed config, through the stage's door (its job builder)."""
    from kimi_pipe.stages.jobs.audit import audit_job

    return audit_mod.run_audit(audit_job(cfg))


def test_audit_stage_with_engine_replies(smollm2, tmp_path: Path) -> None:
    e = end_id(smollm2)
    # (id, what the server's text said, the ids the engine really produced)
    cases = [
        ("exact", "Paris is the capital.", enc(smollm2, "Paris is the capital.") + [e]),
        ("split", "The capital", enc(smollm2, "The cap") + enc(smollm2, "ital") + [e]),
        ("space", "Sure! Done", enc(smollm2, "Sure!\n\nDone") + [e]),
        ("json", '{"a":1,"b":[2,3]}', enc(smollm2, '{"a": 1, "b": [2, 3]}') + [e]),
        ("end", "No end here.", enc(smollm2, "No end here.")),  # engine ids exclude the eos
        ("other", "Yes", enc(smollm2, "No") + [e]),
        ("cut", "Sea: 🌊\ufffd", enc(smollm2, "Sea: 🌊") + enc(smollm2, "🌊")[:1]),
    ]
    records, replies = [], []
    for n, (rid, text, truth) in enumerate(cases):
        # usage counts what the engine generated: the length check may catch the mismatch
        rec = _record(smollm2, rid, text, len(truth))
        records.append(rec)
        if n % 2:  # SGLang /generate shape
            reply = {"text": text, "output_ids": truth, "meta_info": {"prompt_tokens": 9}}
        else:  # vLLM/SGLang OpenAI-compatible with return_token_ids
            reply = {"prompt_token_ids": rec["prompt_ids"],
                     "choices": [{"message": {"content": text}, "token_ids": truth}]}  # fmt: skip
        replies.append({"id": rid, "reply": reply})
    bad = [
        {"id": "failed", "ok": False, "prompt_ids": [], "output_ids": [],
         "error": {"class": "server_error", "message": "boom", "status": 502}},
        {"id": "no-ids", "ok": False, "issues": ["malformed_response"], "prompt_ids": [],
         "output_ids": [], "error": None},
        _record(smollm2, "no-reply", "Some text.", None),
    ]  # fmt: skip
    records_path = tmp_path / "records.jsonl"
    records_path.write_text("".join(json.dumps(r) + "\n" for r in [*records, *bad]))
    replies_path = tmp_path / "replies.jsonl"
    replies_path.write_text("".join(json.dumps(r) + "\n" for r in replies) + "not json\n")

    cfg = _compose(tmp_path, "audit.truth=replies", f"audit.records={records_path}",
                   f"audit.replies={replies_path}")  # fmt: skip
    summary = run_audit(cfg)

    assert summary["audited"] == 7 and summary["exact"] == 1
    assert summary["exact_match_rate"] == pytest.approx(1 / 7)
    assert summary["output_mismatch_classes"] == {
        "non_canonical_split": 1, "lost_whitespace": 1, "tool_call_reserialised": 1,
        "end_token": 1, "partial_utf8": 1, "other": 1,
    }  # fmt: skip
    assert summary["skipped"] == {"provider_error": 1, "no_reconstructed_ids": 1, "no_truth": 1}
    assert summary["prompt_checked"] == 4 and summary["prompt_exact"] == 4
    # Length differences are caught by the billing check, same-length ones are not.
    saved = json.loads((tmp_path / "audit.json").read_text())
    rows = {r["id"]: r for r in saved["samples"]}
    assert rows["split"]["issues"] == ["billing_mismatch"]
    assert rows["other"]["truth_len"] == rows["other"]["recon_len"]
    assert rows["other"]["issues"] == []  # same length: invisible to the billing check
    assert summary["mismatches_caught_by_billing_check"] == sum(
        "billing_mismatch" in r["issues"] for r in rows.values() if not r["output_exact"]
    )
    assert saved["exact_match_rate"] == summary["exact_match_rate"]  # top level: the card reads it
    table = (tmp_path / "audit.md").read_text()
    assert "| exact match (prompt + output ids) | 1 (14.3%) |" in table
    assert "| split | non_canonical_split | 1 |" in table  # "The" then " cap" | "ital"


def test_audit_truth_from_the_records_own_response(smollm2, tmp_path: Path) -> None:
    rec = _record(smollm2, "r1", "Yes.", None)
    rec["response"]["prompt_token_ids"] = rec["prompt_ids"]
    rec["response"]["choices"][0]["token_ids"] = list(rec["output_ids"])
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    summary = run_audit(_compose(tmp_path, "audit.truth=response", f"audit.records={path}"))
    assert summary["exact"] == summary["audited"] == 1


def test_missing_inputs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(audit_mod.AuditError, match="records file not found"):
        run_audit(_compose(tmp_path, f"audit.run_dir={tmp_path}"))
    (tmp_path / "records.jsonl").write_text("")
    with pytest.raises(audit_mod.AuditError, match="needs audit.replies"):
        run_audit(_compose(tmp_path, f"audit.run_dir={tmp_path}", "audit.truth=replies"))
    with pytest.raises(audit_mod.AuditError, match="audit.truth='guess'"):
        run_audit(_compose(tmp_path, f"audit.run_dir={tmp_path}", "audit.truth=guess"))


@pytest.mark.slow
def test_hf_greedy_truth_and_resume(smollm2, tmp_path: Path, monkeypatch) -> None:
    """Real greedy generation is the truth; a rerun reuses the cached truth ids."""
    cfg = _compose(tmp_path, f"audit.run_dir={tmp_path}", "audit.threads=1")
    model_dir = Path(str(cfg.model.hf_weights))
    engine = audit_mod.HFGreedyTruth(model_dir, "cpu", "float32", 1)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    truth = engine({"messages": messages}, 6)
    assert truth.prompt_ids and 1 <= len(truth.output_ids) <= 6
    from kimi_pipe.core.prompt_render import prompt_ids

    assert truth.prompt_ids == prompt_ids(smollm2, messages)

    def rec(rid: str, out: list[int]) -> dict[str, Any]:
        return {
            "id": rid,
            "ok": True,
            "issues": [],
            "messages": messages,
            "error": None,
            "prompt_ids": truth.prompt_ids,
            "output_ids": out,
            "request": {"max_tokens": 6},
        }

    wrong = list(truth.output_ids)
    wrong[-1] = enc(smollm2, " banana")[0]
    (tmp_path / "records.jsonl").write_text(
        json.dumps(rec("good", truth.output_ids)) + "\n" + json.dumps(rec("bad", wrong)) + "\n"
    )
    first = run_audit(cfg)
    assert (first["audited"], first["exact"]) == (2, 1)
    cached = [json.loads(x) for x in (tmp_path / audit_mod.TRUTH_FILE).read_text().splitlines()]
    assert [c["id"] for c in cached] == ["good", "bad"]

    def no_generation(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("truth should come from the cache")

    monkeypatch.setattr(audit_mod.HFGreedyTruth, "__init__", no_generation)
    again = run_audit(cfg)
    assert (again["audited"], again["exact"]) == (2, 1)


def test_duplicate_ids_count_once_the_last_record_wins(smollm2, tmp_path: Path) -> None:
    """A resumed run may hold a sample twice: the last record is the one audited."""
    good = _record(smollm2, "r1", "Yes.", None)
    good["response"]["prompt_token_ids"] = good["prompt_ids"]
    good["response"]["choices"][0]["token_ids"] = list(good["output_ids"])
    stale = json.loads(json.dumps(good))
    stale["response"]["choices"][0]["token_ids"] = enc(smollm2, "No.")  # an earlier attempt
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (stale, good)))
    summary = run_audit(_compose(tmp_path, "audit.truth=response", f"audit.records={path}"))
    assert summary["exact"] == summary["audited"] == 1
    assert audit_mod.latest_by_id([{"id": "a", "n": 1}, {"id": "b"}, {"id": "a", "n": 2}]) == [
        {"id": "b"},
        {"id": "a", "n": 2},
    ]


def test_hf_greedy_cache_key_holds_dtype_and_threads(tmp_path: Path, monkeypatch) -> None:
    """Truth made with another dtype or thread count is not reused from the cache."""
    made: list[tuple[str, int | None]] = []

    class FakeEngine:
        def __init__(self, model_dir: Path, device: str, dtype: str, threads: int | None) -> None:
            self.key = (dtype, threads)

        def __call__(self, record: Any, max_new_tokens: int) -> TruthIds:
            made.append(self.key)
            return TruthIds([1, 2], [3], "x")

    monkeypatch.setattr(audit_mod, "HFGreedyTruth", FakeEngine)
    rec = {"id": "r1", "messages": [{"role": "user", "content": "hi"}]}
    cache = audit_mod.TruthCache(tmp_path / audit_mod.TRUTH_FILE)
    for dtype, threads in [("float32", 1), ("float32", 1), ("bfloat16", 1), ("float32", 4)]:
        s = audit_mod.AuditSettings(model_path=str(tmp_path), dtype=dtype, threads=threads)
        audit_mod._truth_source(s, cache, None)(rec)
    cache.close()
    assert made == [("float32", 1), ("bfloat16", 1), ("float32", 4)]  # the repeat is cached
