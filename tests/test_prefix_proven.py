"""The `prefix_proven` rung (issue 33), with the real Kimi tokenizer: a record flagged for one
ambiguity keeps the ids every reading shares, cut where they first differ; extraction and
the export take that prefix only; yield is counted in tokens and dollars.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kimi_pipe.core.evidence import DEFAULT_ACCEPT, PREFIX_PROVEN, UNRESOLVED, usable
from kimi_pipe.core.models import Model
from kimi_pipe.core.prefix import exact_output_tokens, proven_prefix, training_ids, with_prefix
from kimi_pipe.core.record_builder import RecordBuilder, mark_flagged
from kimi_pipe.core.token_yield import token_yield
from kimi_pipe.extraction.token_samples import read_token_records

MESSAGES = [{"role": "user", "content": "x"}]
REASONING = "The user asks for x. Let me check what x means here, then answer briefly."


def _response(reasoning: str, content: str, billed: int) -> dict[str, Any]:
    message = {"role": "assistant", "content": content, "reasoning": reasoning}
    return {
        "choices": [{"message": message, "finish_reason": "stop"}],
        "usage": {"completion_tokens": billed},
    }


def _truth(kimi: Model, text: str) -> list[int]:
    return kimi.tokenizer.encode_with_markers(text)


def _tail_record(kimi: Model, reasoning: str = REASONING) -> tuple[dict[str, Any], list[int]]:
    """A stack stripped the reasoning's `\\n`: the truth is one of several readings that
    differ at the reasoning's last token, near the answer's end."""
    truth = _truth(kimi, reasoning + "\n</think>Done.<|im_end|>")
    record = RecordBuilder(kimi).build(
        MESSAGES, None, _response(reasoning, "Done.", len(truth)), {"temperature": 1.0}
    )
    record["id"] = "r"
    return dict(record), truth


def _first_difference(sequences: list[list[int]]) -> int:
    """Computed apart from core/prefix.py: the first index where two readings differ."""
    i = 0
    while all(len(s) > i for s in sequences) and len({s[i] for s in sequences}) == 1:
        i += 1
    return i


def test_one_ambiguity_near_the_end_keeps_the_exact_prefix(kimi: Model) -> None:
    record, truth = _tail_record(kimi)
    options = [o["output_ids"] for o in record["candidates"]["options"]]
    assert truth in options and len(options) >= 2
    cut = _first_difference(options)
    assert 0 < cut < len(truth) - 2  # near the end, not at it
    assert not record["ok"] and record["evidence"] == PREFIX_PROVEN
    assert record["prefix"]["prefix_tokens"] == cut
    assert record["prefix"]["cut_by"] == "reasoning_tail_unverifiable"
    assert record["prefix"]["of_tokens"] == len(truth)
    ids, mask = training_ids(record)
    prompt = record["prompt_ids"]
    assert ids[: len(prompt)] == prompt
    assert ids[len(prompt) :] == truth[:cut]  # the truth's first `cut` ids, exactly
    assert len({o[cut] for o in options}) > 1  # and the next id is not proven
    assert mask == record["loss_mask"][: len(prompt)] + [1] * cut
    assert usable(record) and usable(record, DEFAULT_ACCEPT)
    assert not usable(record, ("engine_ids", "text_proven", "target_resolved"))
    assert exact_output_tokens(record) == cut
    # The record keeps what came back: its ids as returned, its candidate set.
    assert record["output_ids"] in options


def test_candidates_differing_at_position_zero_keep_nothing(kimi: Model) -> None:
    record, _ = _tail_record(kimi, ".")
    options = [o["output_ids"] for o in record["candidates"]["options"]]
    assert len(options) >= 2 and _first_difference(options) == 0
    assert record["evidence"] == UNRESOLVED and "prefix" not in record
    assert not usable(record) and exact_output_tokens(record) == 0


def test_no_prefix_is_proven_where_the_set_cannot_prove_one(kimi: Model) -> None:
    record, _ = _tail_record(kimi)
    # An open set: a reading it does not list may differ anywhere.
    open_set = {**record, "candidates": {**record["candidates"], "closed": False}}
    assert proven_prefix(open_set) is None
    # A code the set does not cover (an answer check), and a partial character.
    flagged = mark_flagged(json.loads(json.dumps(record)), ["model_mismatch"])
    assert flagged["evidence"] == UNRESOLVED and "prefix" not in flagged
    partial = {**record, "issues": [*record["issues"], "partial_character"]}
    assert proven_prefix(partial) is None
    assert not usable(with_prefix(partial)) and not usable(partial, DEFAULT_ACCEPT)
    # A reading a few ids off the bill counts as a reading: the cut moves before it.
    short = [0, *record["candidates"]["options"][0]["output_ids"][1:]]
    shorter = {**record, "short_readings": [{"output_ids": short, "loss_mask": [], "label": ""}]}
    assert proven_prefix(shorter) is None  # it differs at position 0
    # A prefix its readings do not share never reaches a training row.
    forged = {**record, "prefix": {**record["prefix"], "prefix_tokens": len(record["output_ids"])}}
    with pytest.raises(ValueError):
        training_ids(forged)


def _records_file(path: Path, kimi: Model) -> tuple[dict[str, Any], list[int], dict[str, Any]]:
    cut, truth = _tail_record(kimi)
    whole = json.loads(json.dumps(cut)) | {"id": "whole", "ok": True, "issues": []}
    whole |= {"evidence": "text_proven", "output_ids": truth}
    whole["loss_mask"] = whole["loss_mask"][: len(whole["prompt_ids"])] + [1] * len(truth)
    del whole["candidates"], whole["prefix"]
    partial = json.loads(json.dumps(cut)) | {"id": "partial"}
    partial["issues"] = [*partial["issues"], "truncated", "partial_character"]
    lines = [cut, whole, partial]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return cut, truth, whole


def test_extraction_reads_the_proven_prefix_only(tmp_path: Path, kimi: Model) -> None:
    records = tmp_path / "records.jsonl"
    cut, truth, whole = _records_file(records, kimi)
    k = cut["prefix"]["prefix_tokens"]
    for kw in ({}, {"accept": DEFAULT_ACCEPT}, {"only_ok": False}):
        samples, counts = read_token_records(records, **kw)  # type: ignore[arg-type]
        by_id = {s.id: s for s in samples}
        assert "partial" not in by_id  # never, whatever the policy
        assert by_id["r"].input_ids == cut["prompt_ids"] + truth[:k]
        assert len(by_id["r"].loss_mask) == len(by_id["r"].input_ids)
        assert by_id["whole"].input_ids == whole["prompt_ids"] + truth
        assert counts["cut_to_proven_prefix"] == 1
    old = ("engine_ids", "text_proven", "target_resolved")
    samples, counts = read_token_records(records, accept=old)
    assert [s.id for s in samples] == ["whole"]


def test_export_honours_the_cut(tmp_path: Path, kimi: Model) -> None:
    from kimi_pipe.exporters import export
    from kimi_pipe.store.hidden_store import StoreWriter, make_manifest

    run = tmp_path / "run"
    run.mkdir()
    cut, truth, whole = _records_file(run / "records.jsonl", kimi)
    k = cut["prefix"]["prefix_tokens"]
    stray = json.loads(json.dumps(cut)) | {"id": "stored_whole"}
    with open(run / "records.jsonl", "a") as fh:
        fh.write(json.dumps(stray) + "\n")
    (run / "summary.json").write_text(
        json.dumps({"spend_usd": 0.01, "budget": {"price_out_usd_per_mtok": 2.5}})
    )
    manifest = make_manifest(
        model="m", num_layers=8, layer_ids=[1, 3, 4], layer_convention="output_of_layer",
        final_state="post_norm", hidden_size=4, dtype="float32", loss_mask="test",
        source_runs=[str(run)], backend="test",
    )  # fmt: skip
    rows = {
        "r": training_ids(cut),  # extraction cut it
        "whole": training_ids(whole),
        "stored_whole": (stray["prompt_ids"] + stray["output_ids"], stray["loss_mask"]),
    }
    with StoreWriter(tmp_path / "store", manifest, shard_samples=2) as w:
        for sid, (ids, mask) in rows.items():
            w.add(sid, ids, mask, torch.zeros(len(ids), 12), torch.zeros(len(ids), 4))
    summary = export([tmp_path / "store"], tmp_path / "out", "tokens", seed=0)
    index = [json.loads(line) for line in (tmp_path / "out" / "export_index.jsonl").open()]
    assert sorted(e["id"] for e in index) == ["r", "whole"]  # never past a proven prefix
    length = {e["id"]: e["length"] for e in index}
    assert length["r"] == len(cut["prompt_ids"]) + k
    policy = summary["policy"]
    assert policy["exported_by_evidence"] == {PREFIX_PROVEN: 1, "text_proven": 1}
    assert policy["excluded_by_evidence"] == {"prefix_not_cut": 1}
    assert policy["exported_tokens_by_evidence"][PREFIX_PROVEN] == length["r"]
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"exported, evidence `{PREFIX_PROVEN}` | 1 |" in card
    assert "completion tokens bought" in card and "per million exact tokens" in card


def test_yield_in_tokens_and_dollars_adds_up(kimi: Model) -> None:
    cut, truth = _tail_record(kimi)
    k = cut["prefix"]["prefix_tokens"]
    whole = json.loads(json.dumps(cut)) | {"id": "w", "ok": True, "issues": []}
    whole |= {"evidence": "text_proven", "output_ids": truth, "completion_tokens_reported": 7}
    whole["output_ids"] = truth[:7]
    zero, _ = _tail_record(kimi, ".")
    zero["id"] = "z"
    failed = {"id": "f", "error": {"class": "x"}, "output_ids": []}
    billed = len(truth) + 7 + zero["completion_tokens_reported"]
    block = token_yield([cut, whole, zero, failed], price_out_per_token=2e-6, spend_usd=0.5)
    assert block["completion_tokens_bought"] == billed
    assert block["exact_by_rung"][PREFIX_PROVEN] == k
    assert block["exact_by_rung"]["text_proven"] == 7
    assert block["exact_accepted"] == k + 7
    assert sum(block["bought_by_rung"].values()) == billed
    assert block["exact_share"] == pytest.approx((k + 7) / billed)
    assert block["listed_usd_per_exact_token"] == pytest.approx(2e-6 * billed / (k + 7))
    assert block["spend_usd_per_exact_token"] == pytest.approx(0.5 / (k + 7))
    # Under the old default the prefix does not count: fewer exact tokens, dearer ones.
    old = token_yield([cut, whole, zero], ("engine_ids", "text_proven", "target_resolved"))
    assert old["exact_accepted"] == 7
    # A later record of an id replaces an earlier one, as extraction reads them.
    again = token_yield([cut, {**cut, "completion_tokens_reported": 1}])
    assert again["completion_tokens_bought"] == 1


class _Scorer:
    tokens = 0


class _Target:
    """A target whose next-token scorer is never asked: the search is replaced below."""

    def next_token_scorer(self, sampling: Any) -> _Scorer:
        return _Scorer()


def _checked(record: dict[str, Any], others: list[tuple[list[int], float]], limits: list[str],
             monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:  # fmt: skip
    """check_prefix with the split search's answer given: the record's own path at log 0 and
    `others` (ids, logprob)."""
    from kimi_pipe.core.splits import SplitPath, SplitSearch
    from kimi_pipe.extraction import prefix_check
    from kimi_pipe.extraction.resolve import ResolveSettings

    def search(prompt: Any, ids: Any, billed: Any, vocab: Any, scorer: Any) -> SplitSearch:
        paths = [SplitPath(tuple(o), lp) for o, lp in others]
        return SplitSearch(0.0, True, paths, limits=list(limits))

    monkeypatch.setattr(prefix_check, "search_splits", search)
    monkeypatch.setattr(prefix_check, "neighbour_readings", lambda *a: ([], []))
    out, _ = prefix_check.check_prefix(record, _Target(), None, ResolveSettings(), "t")  # type: ignore[arg-type]
    assert out is not None
    return dict(out)


def test_the_target_confirms_or_withdraws_a_prefix(
    kimi: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-canonical split of a reading that leaves the prefix before the cut (the engine
    may have drawn it: same text, same count) withdraws the prefix unless the target gives it
    at most 1 - min_posterior; one that leaves it after the cut changes nothing."""
    record, truth = _tail_record(kimi)
    k = record["prefix"]["prefix_tokens"]
    first = record["candidates"]["options"][0]["output_ids"]
    early = [*first[:2], 7, *first[3:]]  # departs at position 2 < k
    late = [*first[: k + 1], 7, *first[k + 2 :]]
    alone = _checked(record, [], [], monkeypatch)
    assert alone["evidence"] == PREFIX_PROVEN and alone["prefix"]["split_check"]["posterior"] == 1
    assert "prefix_split_checked" in alone["notes"]
    assert _checked(record, [(late, 0.0)], [], monkeypatch)["evidence"] == PREFIX_PROVEN
    assert _checked(record, [(early, -20.0)], [], monkeypatch)["evidence"] == PREFIX_PROVEN
    doubt = _checked(record, [(early, -1.0)], [], monkeypatch)
    assert doubt["evidence"] == UNRESOLVED and "prefix" not in doubt
    assert doubt["issues"][-1] == "prefix_split_ambiguous" and not usable(doubt)
    assert with_prefix(doubt)["evidence"] == UNRESOLVED  # withdrawn for good
    bounded = _checked(record, [], ["too many branches"], monkeypatch)
    assert bounded["evidence"] == UNRESOLVED  # an incomplete search proves nothing
