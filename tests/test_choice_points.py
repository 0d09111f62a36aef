"""Choice points: argument edges of several calls factored out of a closed set, and the
target's walk through them (core/candidates.ChoicePoint, extraction/resolve.decide_points).

Two calls whose arguments' edges each have 20 same-count readings are 400 sequences; listed
one by one with the other ambiguities of a real answer they were 6,400 options and 12 MB in
one record. Each option now carries one choice point per call; the target walks them, and the
posterior it reports is a proven lower bound on the chosen sequence's posterior among them all.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from omegaconf import OmegaConf

import kimi_pipe.core.candidates as candidates
from kimi_pipe.core.models import Model
from kimi_pipe.core.record_builder import RecordBuilder
from kimi_pipe.extraction.resolve import (
    HFSuffixScorer,
    ResolveSettings,
    Sampling,
    full_sequence_logprobs,
    option_ids,
    resolvable,
    score_record,
)
from tests.support.candidate_sets import sequences_of
from tests.test_resolve import REPO, encode, prompt_ids
from tests.test_wild_corpus import build, read


def _answers(kimi: Model, calls: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Wild answers whose closed or open set is about `calls` calls' argument edges."""
    builder = RecordBuilder(kimi)
    out = []
    for row in read("kimi_k25_wild.jsonl"):
        message = row["response"]["choices"][0]["message"]
        if len(message.get("tool_calls") or []) != calls:
            continue
        record = build(builder, row)
        if "tool_arguments_edges_unverifiable" in record["issues"]:
            out.append((row, record))
    return out


@pytest.mark.kimi
def test_factored_edges_stand_for_exactly_the_listed_sequences(
    kimi: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One call's 20 edge readings listed as options, and the same answer with its edges
    forced into choice points: the same sequences, every one billed alike."""
    monkeypatch.setattr(candidates, "MAX_LISTED_OPTIONS", 10**6)  # listed, however many
    row, listed = next(
        (row, r) for row, r in _answers(kimi, calls=1) if (r.get("candidates") or {}).get("closed")
    )
    assert not any(o.get("points") for o in listed["candidates"]["options"])
    monkeypatch.setattr(candidates, "MAX_EDGE_READINGS", 1)
    factored = build(RecordBuilder(kimi), row)
    cands = factored["candidates"]
    assert cands["closed"] and resolvable(factored) is None
    assert all(o.get("points") for o in cands["options"])
    assert len(cands["options"]) < len(listed["candidates"]["options"])
    assert sequences_of(cands["options"]) == sequences_of(listed["candidates"]["options"])
    first_point = min(p["at"] for o in cands["options"] for p in o["points"])
    assert cands["diverge_at"] <= first_point  # nothing past a point is called shared


@pytest.mark.kimi
def test_two_calls_edges_are_a_closed_set_of_choice_points(kimi: Model) -> None:
    """The recorded Chutes answer with two calls: before, 'too many argument-edge readings to
    list' (open, lost); now closed, one point per call on every option."""
    closed = [r for _, r in _answers(kimi, calls=2) if (r.get("candidates") or {}).get("closed")]
    assert closed, "no two-call answer reaches a closed set"
    for record in closed:
        assert resolvable(record) is None
        for option in record["candidates"]["options"]:
            points = option["points"]
            assert len(points) == 2 and points[0]["at"] < points[1]["at"]
            for point in points:
                assert len(point["alternatives"]) == len(point["labels"]) == 20
                assert point["labels"][0] == "as returned"
        assert len(sequences_of(record["candidates"]["options"])) == 400 * len(
            record["candidates"]["options"]
        )


# --------------------------------------------------------------------------- the target's walk


@pytest.fixture(scope="module")
def smol() -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kimi_pipe.store.local_model import LocalModelSpec, ensure_local_model

    spec = LocalModelSpec.from_cfg(OmegaConf.load(REPO / "conf/model/smollm2.yaml").local_model)
    path = ensure_local_model(spec)
    return AutoModelForCausalLM.from_pretrained(str(path)).eval(), AutoTokenizer.from_pretrained(
        str(path)
    )


def _one_token(tok: Any, word: str) -> int:
    ids = encode(tok, word)
    assert len(ids) == 1, (word, ids)
    return ids[0]


def _record(tok: Any, sampling: dict[str, float]) -> dict[str, Any]:
    """'The capital of France is Paris.' with two choice points: the country and the city,
    three one-token alternatives each (the answer's own first)."""
    end = int(tok.convert_tokens_to_ids("<|im_end|>"))
    ids = encode(tok, "The capital of France is Paris.") + [end]
    countries = [_one_token(tok, w) for w in (" France", " Spain", " Italy")]
    cities = [_one_token(tok, w) for w in (" Paris", " Rome", " Madrid")]
    at_country, at_city = ids.index(countries[0]), ids.index(cities[0])
    option = {
        "output_ids": ids,
        "loss_mask": [1] * len(ids),
        "label": "as returned",
        "points": [
            {"at": at_country, "alternatives": [[t] for t in countries], "labels": ["a", "b", "c"]},
            {"at": at_city, "alternatives": [[t] for t in cities], "labels": ["a", "b", "c"]},
        ],
    }
    prompt = prompt_ids(tok)
    return {
        "id": "points",
        "ok": False,
        "evidence": "unresolved",
        "issues": ["tool_arguments_edges_unverifiable"],
        "notes": [],
        "prompt_ids": prompt,
        "output_ids": ids,
        "loss_mask": [0] * len(prompt) + [1] * len(ids),
        "sampling": sampling,
        "candidates": {
            "closed": True,
            "why_open": None,
            "classes": ["argument_edges"],
            "diverge_at": at_country,
            "options": [option],
        },
    }


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_walks_posterior_is_a_lower_bound_of_the_true_one(
    smol: tuple[Any, Any], top_p: float
) -> None:
    """Every combination scored whole (9 forwards) against the walk: the walk's posterior never
    exceeds the chosen sequence's true posterior, and a resolved walk chose the likeliest."""
    model, tok = smol
    sampling = {"temperature": 1.0, "top_p": top_p}
    record = _record(tok, sampling)
    option = record["candidates"]["options"][0]
    judge = Sampling.from_record(sampling, None, *ResolveSettings().slacks)
    assert judge is not None
    prompt = record["prompt_ids"]
    truth = {}
    for choices in itertools.product(range(3), range(3)):
        ids = option_ids(option, list(choices))
        truth[choices] = full_sequence_logprobs(model, prompt + ids, len(prompt), judge)
    top = max(truth.values())
    assert top > -math.inf
    total = sum(math.exp(v - top) for v in truth.values() if v > -math.inf)
    for min_posterior in (0.6, 0.999):
        out = score_record(
            record, HFSuffixScorer(model, "smollm2"), ResolveSettings(min_posterior=min_posterior)
        )
        assert out is not None
        res = out["resolution"]
        chosen = tuple(res["choices"])
        true_posterior = math.exp(truth[chosen] - top) / total
        assert res["bound"] == "lower" and res["posterior"] <= true_posterior + 1e-4
        if res["posterior"] > 0.5:
            assert truth[chosen] == top  # above one half: it can only be the likeliest
        if out["ok"]:
            assert out["evidence"] == "target_resolved"
            assert out["output_ids"] == option_ids(option, list(chosen))
            assert res["posterior"] >= min_posterior
        else:
            assert res["posterior"] < min_posterior and out["output_ids"] == record["output_ids"]


def test_a_point_that_is_not_the_options_own_ids_is_refused(smol: tuple[Any, Any]) -> None:
    _, tok = smol
    record = _record(tok, {"temperature": 1.0, "top_p": 1.0})
    assert resolvable(record) is None
    point = record["candidates"]["options"][0]["points"][1]
    point["alternatives"] = point["alternatives"][1:]  # the option's own ids no longer first
    assert resolvable(record) == "bad_option"
    point["alternatives"] = [point["alternatives"][0], [1, 2]]  # another length
    assert resolvable(record) == "bad_option"


def test_extract_walks_the_points_then_stores_the_chosen_ids(tmp_path: Any, smol: Any) -> None:
    """Through `extract` as a user runs it: the record is resolved on the walk's ids (or kept
    unresolved with only its shared prefix), and the store holds exactly those ids."""
    import json

    from kimi_pipe.config import compose
    from kimi_pipe.stages.extract import run_extract
    from kimi_pipe.store.hidden_store import HiddenStore
    from kimi_pipe.store.records import read_records

    _, tok = smol
    tight = {**_record(tok, {"temperature": 1.0, "top_p": 0.5}), "id": "tight"}
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps(tight) + "\n")
    cfg = compose(["model=smollm2", f"extract.run_dir={tmp_path}", "resolve.split_check=false"])
    run_extract(cfg)
    (after,) = read_records(records)
    res = after["resolution"]
    assert res["bound"] == "lower" and len(res["choices"]) == 2
    option = tight["candidates"]["options"][0]
    store = HiddenStore(tmp_path / "hidden_hf")
    stored = store.tokens("tight")["input_ids"].tolist()
    # Under a 0.5 nucleus every other country and city is outside it: each departure is
    # impossible, so the bound is 1 and the record is resolved on the answer's own ids.
    assert after["ok"] and after["evidence"] == "target_resolved", res
    assert res["posterior"] == 1.0 and res["departures"] == 0
    assert after["output_ids"] == option_ids(option, res["choices"]) == tight["output_ids"]
    assert stored == tight["prompt_ids"] + after["output_ids"]
