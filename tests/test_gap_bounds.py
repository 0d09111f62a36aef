"""A bounded open set at extraction: what its gaps leave unlisted, weighed by a real model
(SmolLM2's weights) under the request's sampler (core/gaps.py, extraction/gap_bounds.py).

A gap is a reading short of the bill; it stands for itself with whitespace put back at its
text's edges, more spellings than can be listed. Target resolution counts them among every
option's rivals at an upper bound: the mass of each site's class after the reading's ids
before it. These tests score the sequences one by one with plain forwards and check the
bound holds them all, and that resolution reports a posterior no higher than the true one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kimi_pipe.config import compose
from kimi_pipe.core.tokenizers import HFTokenizer
from kimi_pipe.extraction.gap_bounds import gap_bounds
from kimi_pipe.extraction.records_pass import resolve_records
from kimi_pipe.extraction.resolve import (
    HFSuffixScorer,
    ResolveSettings,
    Sampling,
    decide,
    full_sequence_logprobs,
    resolvable,
)
from kimi_pipe.extraction.sampler import logsumexp
from kimi_pipe.extraction.split_check import HFNextTokenScorer, vocabulary_of
from kimi_pipe.stages.extract import run_extract
from kimi_pipe.store.hidden_store import HiddenStore
from kimi_pipe.store.records import read_records
from tests.support.candidate_sets import covers
from tests.test_resolve import (  # noqa: F401  (smol, smollm2_dir: fixtures)
    ANSWER,
    encode,
    prompt_ids,
    smol,
    smollm2_dir,
    tail_record,
)

# A reading a stack's stripping left short: "The capital of France is Paris" (no period).
SHORT = ANSWER.rstrip(".")
# Whitespace a stack may have stripped from the short reading's end, as the model wrote it.
STRIPPED = (" ", "\n", "\n\n", "  ", "\t", " \n", ".", ". ", ".\n", "\u3000")


@pytest.fixture(scope="module")
def vocab(smollm2_dir: Path) -> Any:  # noqa: F811
    return vocabulary_of(HFTokenizer(smollm2_dir))


def _end(tok: Any) -> int:
    return int(tok.convert_tokens_to_ids("<|im_end|>"))


def _gap(tok: Any) -> dict[str, Any]:
    ids = encode(tok, SHORT) + [_end(tok)]
    start = len(encode(tok, "The capital of France is"))
    return {"output_ids": ids, "start": start, "open_end": False, "label": "short"}


def _judge(sampling: dict[str, float]) -> Sampling:
    judge = Sampling.from_record(sampling, None, *ResolveSettings().slacks)
    assert judge is not None
    return judge


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_bound_holds_every_sequence_the_gap_stands_for(
    smol: tuple[Any, Any],  # noqa: F811
    vocab: Any,
    top_p: float,
) -> None:
    """Each sequence (the short text with whitespace, or text and whitespace, after it) leaves
    the gap at a site of its class, and all of them together weigh no more than the bound."""
    model, tok = smol
    judge = _judge({"temperature": 1.0, "top_p": top_p})
    prompt = prompt_ids(tok)
    gap = _gap(tok)
    candidates = {"options": [], "gaps": [gap]}
    total = -math.inf
    for tail in STRIPPED:
        ids = encode(tok, SHORT + tail) + [_end(tok)]
        if tail.strip():  # "." is text, not whitespace: its sequence is not the gap's
            assert not covers(candidates, ids, vocab) or tail.strip() == ""
            continue
        assert covers(candidates, ids, vocab), repr(tail)
        total = logsumexp([total, full_sequence_logprobs(model, prompt + ids, len(prompt), judge)])
    bounds = gap_bounds(prompt, [gap], vocab, HFNextTokenScorer(model, judge))
    sites, reading = bounds[:-1], bounds[-1]
    bound = logsumexp(sites)
    assert total <= bound + 1e-6
    assert bound < 0  # not the trivial bound: far less than all the mass after the prompt
    assert reading == pytest.approx(
        full_sequence_logprobs(model, prompt + gap["output_ids"], len(prompt), judge), abs=1e-4
    )


def _record(tok: Any, sampling: dict[str, float], *, bounded: bool = True) -> dict[str, Any]:
    """test_resolve's two readings at the bill (with a newline restored, and as returned: its
    TEXT is ANSWER) and, where `bounded`, the short reading as a gap of an open set."""
    record = tail_record(tok, "gap", sampling)
    if bounded:
        record["candidates"].update(
            closed=False,
            why_open="a reading short of the bill: the stack may have dropped whitespace",
            gaps=[_gap(tok)],
        )
    return record


def _resolve(path: Path, record: dict[str, Any], model: Any, vocab: Any) -> dict[str, Any]:
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    summary = resolve_records(
        path,
        HFSuffixScorer(model, "smollm2"),
        ResolveSettings(min_posterior=0.6, split_check=False),
        vocab=vocab,
    )
    out = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    out["_counts"] = summary["counts"]
    return out


def test_a_bounded_set_goes_to_the_target_with_its_gaps_among_the_rivals(
    smol: tuple[Any, Any],  # noqa: F811
    vocab: Any,
    tmp_path: Path,
) -> None:
    model, tok = smol
    sampling = {"temperature": 1.0, "top_p": 1.0}
    record = _record(tok, sampling)
    assert resolvable(record) is None
    del record["candidates"]["gaps"]
    assert resolvable(record) == "open_set"  # open, and nothing bounds what it leaves out

    bounded = _resolve(tmp_path / "a.jsonl", _record(tok, sampling), model, vocab)
    closed = _resolve(tmp_path / "b.jsonl", _record(tok, sampling, bounded=False), model, vocab)
    res = bounded["resolution"]
    assert res["bound"] == "lower" and res["unlisted"] >= 2  # sites, and the reading itself
    assert res["chosen"] == closed["resolution"]["chosen"]
    assert res["posterior"] < closed["resolution"]["posterior"]
    # The true posterior among the options, the short reading and its whitespace sequences.
    judge = _judge(sampling)
    prompt = bounded["prompt_ids"]
    scores = [
        full_sequence_logprobs(model, prompt + o["output_ids"], len(prompt), judge)
        for o in _record(tok, sampling)["candidates"]["options"]
    ]
    others = [
        full_sequence_logprobs(
            model, prompt + encode(tok, SHORT + t) + [_end(tok)], len(prompt), judge
        )
        for t in ("", " ", "\n", "\n\n", "  ")
    ]
    top = scores[res["chosen"]]
    true_posterior = 1.0 / sum(math.exp(s - top) for s in scores + others)
    assert res["posterior"] <= true_posterior + 1e-4
    assert bounded["ok"] is (res["posterior"] >= 0.6)


def test_extract_resolves_a_bounded_set_with_the_split_check_off(
    smol: tuple[Any, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    """Through the extract stage: the gaps' classes read the model's tokenizer whether or not
    the split check runs, and the states are captured on the chosen ids."""
    _, tok = smol
    record = _record(tok, {"temperature": 1.0, "top_p": 1.0})
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps(record) + "\n", encoding="utf-8")
    cfg = compose(
        [
            "model=smollm2",
            f"extract.run_dir={tmp_path}",
            "resolve.min_posterior=0.6",
            "resolve.split_check=false",
        ]
    )
    summary = run_extract(cfg)
    assert summary["resolve"]["counts"] == {"resolved": 1}
    (after,) = read_records(records)
    assert after["ok"] and after["evidence"] == "target_resolved"
    assert after["resolution"]["bound"] == "lower" and after["resolution"]["unlisted"] >= 2
    chosen = record["candidates"]["options"][after["resolution"]["chosen"]]
    stored = HiddenStore(tmp_path / "hidden_hf").tokens("gap")["input_ids"].tolist()
    assert stored == record["prompt_ids"] + chosen["output_ids"]


def test_without_a_vocabulary_a_bounded_set_waits(
    smol: tuple[Any, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    """The classes need the tokenizer's vocabulary: without it nothing is guessed."""
    model, tok = smol
    record = _record(tok, {"temperature": 1.0, "top_p": 1.0})
    out = _resolve(tmp_path / "a.jsonl", record, model, None)
    assert out["_counts"] == {"not_resolved_no_vocabulary": 1}
    assert "resolution" not in out and out["ok"] is False


def test_unlisted_mass_lowers_the_posterior() -> None:
    closed = decide([-1.0, -3.0], 0.8)
    assert closed["resolved"]
    bounded = decide([-1.0, -3.0], 0.8, unlisted=[-2.0, -math.inf])
    assert bounded["bound"] == "lower" and bounded["unlisted"] == 2
    expected = 1.0 / (1.0 + math.exp(-2.0) + math.exp(-1.0))
    assert bounded["posterior"] == pytest.approx(expected)
    assert bounded["margin"] == pytest.approx(1.0)  # the gap is the strongest rival
    assert not bounded["resolved"]
    nothing = decide([-1.0, -3.0], 0.8, unlisted=[-math.inf])
    assert nothing["posterior"] == pytest.approx(closed["posterior"]) and nothing["resolved"]
