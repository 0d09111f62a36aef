"""Target resolution (extraction/resolve.py) on the real SmolLM2 weights and tokenizer."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kimi_pipe.extraction.resolve import (
    TARGET_UNRESOLVED,
    HFSuffixScorer,
    ResolveSettings,
    Sampling,
    decide,
    full_sequence_logprobs,
    resolvable,
    rewrite_records,
    sampled_logprobs,
    sampler_log_table,
)
from kimi_pipe.stages.extract import run_extract
from kimi_pipe.stages.jobs.extract import extract_job
from kimi_pipe.store.hidden_store import HiddenStore
from kimi_pipe.store.records import read_records

REPO = Path(__file__).resolve().parent.parent
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    from kimi_pipe.store.local_model import LocalModelSpec, ensure_local_model

    spec = LocalModelSpec.from_cfg(OmegaConf.load(REPO / "conf/model/smollm2.yaml").local_model)
    return ensure_local_model(spec)


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir)).eval()
    return model, AutoTokenizer.from_pretrained(str(smollm2_dir))


def encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def prompt_ids(tok: Any) -> list[int]:
    return encode(tok, f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")


def tail_record(tok: Any, sid: str = "r0", sampling: dict | None = None) -> dict[str, Any]:
    """An answer whose stack stripped its trailing whitespace: 'as returned' vs '\\n' restored
    (two token sequences, the order 19a's candidates use: restored first)."""
    end = int(tok.convert_tokens_to_ids("<|im_end|>"))
    prompt = prompt_ids(tok)
    returned = encode(tok, ANSWER) + [end]
    restored = encode(tok, ANSWER + "\n") + [end]
    diverge = next(i for i, (a, b) in enumerate(zip(returned, restored, strict=False)) if a != b)
    options = [
        {"output_ids": restored, "loss_mask": [1] * len(restored), "label": "tail '\\n' restored"},
        {"output_ids": returned, "loss_mask": [1] * len(returned), "label": "as returned"},
    ]
    return {
        "id": sid,
        "ok": False,
        "evidence": "unresolved",
        "issues": ["reasoning_tail_unverifiable"],
        "notes": [],
        "prompt_ids": prompt,
        "output_ids": returned,
        "loss_mask": [0] * len(prompt) + [1] * len(returned),
        "sampling": sampling if sampling is not None else {"temperature": 1.0, "top_p": 1.0},
        "candidates": {
            "closed": True,
            "why_open": None,
            "classes": ["reasoning_tail"],
            "diverge_at": diverge,
            "options": options,
        },
    }


# --------------------------------------------------------------------------- the sampler


def test_sampled_logprobs_follow_temperature_top_k_top_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = probs.log().unsqueeze(0).repeat(4, 1)
    full = sampled_logprobs(logits, [0, 1, 2, 3], Sampling(1.0))
    assert full == pytest.approx(probs.log().tolist())
    # top_p 0.7: tokens 0 (0.5) and 1 (0.3, 0.5 above it) are in; token 2 has 0.8 above it.
    nucleus = sampled_logprobs(logits, [0, 1, 2, 3], Sampling(1.0, top_p=0.7))
    assert nucleus[:2] == pytest.approx([math.log(0.5 / 0.8), math.log(0.3 / 0.8)])
    assert nucleus[2:] == [-math.inf, -math.inf]
    # top_k 3 drops the last; renormalised over 0.95.
    top3 = sampled_logprobs(logits[:2], [2, 3], Sampling(1.0, top_k=3))
    assert top3 == [pytest.approx(math.log(0.15 / 0.95)), -math.inf]
    # min_p 0.2: a token under 0.2 x 0.5 = 0.1 is out.
    floor = sampled_logprobs(logits[:2], [2, 3], Sampling(1.0, min_p=0.2))
    assert floor == [pytest.approx(math.log(0.15 / 0.95)), -math.inf]
    # Temperature 0.5 squares the probabilities before normalising.
    sq = probs**2 / (probs**2).sum()
    assert sampled_logprobs(logits[:1], [1], Sampling(0.5)) == pytest.approx([math.log(sq[1])])
    # Greedy: only the argmax.
    assert sampled_logprobs(logits[:2], [0, 1], Sampling(0.0)) == [0.0, -math.inf]


def test_decide_posterior_margin_and_threshold() -> None:
    d = decide([-1.0, -1.0 - math.log(9999.0)], 0.999)
    assert d["chosen"] == 0 and d["posterior"] == pytest.approx(0.9999)
    assert d["margin"] == pytest.approx(math.log(9999.0)) and d["resolved"]
    assert not decide([-1.0, -1.0 - math.log(99.0)], 0.999)["resolved"]
    d = decide([-math.inf, -3.0], 0.999)
    assert (d["chosen"], d["posterior"], d["impossible"], d["margin"]) == (1, 1.0, [0], None)
    assert decide([-math.inf, -math.inf], 0.999)["chosen"] is None


# --------------------------------------------------------------------------- real model


@pytest.mark.parametrize(
    "sampling",
    [Sampling(1.0), Sampling(1.0, top_p=0.9), Sampling(0.7, top_p=0.95, top_k=50), Sampling(0.0)],
)
def test_prefix_reuse_equals_full_forwards(smol: tuple[Any, Any], sampling: Sampling) -> None:
    model, tok = smol
    prefix = prompt_ids(tok) + encode(tok, "The capital")
    suffixes = [
        encode(tok, " of France is Paris.") + [2],
        encode(tok, " of France is Paris.\n") + [2],
        encode(tok, " city of France is Lyon.") + [2],
        encode(tok, " of Spain is Madrid.") + [2],  # same length as the first: one batch
    ]
    scorer = HFSuffixScorer(model, "smollm2")
    cached = scorer.score_suffixes(prefix, suffixes, sampling)
    full = [full_sequence_logprobs(model, prefix + s, len(prefix), sampling) for s in suffixes]
    for c, f in zip(cached, full, strict=True):
        if f == -math.inf:
            assert c == -math.inf
        else:
            assert c == pytest.approx(f, abs=1e-3)
    # The prefix ran once; each suffix whose first token the sampler could draw ran on it
    # (less its last token, which predicts nothing); the others were dropped unrun.
    first_ok = [
        full_sequence_logprobs(model, prefix + s[:1], len(prefix), sampling) > -math.inf
        for s in suffixes
    ]
    assert scorer.prefix_tokens == len(prefix)
    ran = [len(s) - 1 for s, ok in zip(suffixes, first_ok, strict=True) if ok]
    assert scorer.suffix_tokens == sum(ran)
    assert scorer.pruned >= first_ok.count(False)
    assert any(c > -math.inf for c in cached)
    # Suffixes run a few positions at a time (bounded logits memory): the same sums.
    chunked = HFSuffixScorer(model, "smollm2", chunk_tokens=2).score_suffixes(
        prefix, suffixes, sampling
    )
    for c, k in zip(cached, chunked, strict=True):
        assert k == c if c == -math.inf else k == pytest.approx(c, abs=1e-4)


def test_top_p_makes_the_tail_option_impossible(smol: tuple[Any, Any]) -> None:
    model, tok = smol
    rec = tail_record(tok)
    scorer = HFSuffixScorer(model, "smollm2")
    loose = resolve_one(rec, scorer, ResolveSettings())
    assert loose["resolution"]["impossible"] == []
    assert all(lp is not None for lp in loose["resolution"]["logprobs"])
    rec = tail_record(tok, sampling={"temperature": 1.0, "top_p": 0.5})
    tight = resolve_one(rec, scorer, ResolveSettings())
    res = tight["resolution"]
    # "." then "\n" (the restored option) is outside a 0.5 nucleus after "Paris": prob 0.
    assert res["impossible"] == [0] and res["logprobs"][0] is None
    assert (res["chosen"], res["posterior"], res["top_p"]) == (1, 1.0, 0.5)
    assert tight["ok"] and tight["evidence"] == "target_resolved"
    assert tight["output_ids"] == rec["candidates"]["options"][1]["output_ids"]
    assert "reasoning_tail_unverifiable" not in tight["issues"]
    assert {"resolved_by_target", "reasoning_tail_unverifiable"} <= set(tight["notes"])


def test_below_threshold_stays_unresolved(smol: tuple[Any, Any]) -> None:
    model, tok = smol
    rec = tail_record(tok)
    scorer = HFSuffixScorer(model, "smollm2")
    res = resolve_one(rec, scorer, ResolveSettings())["resolution"]
    posterior = res["posterior"]
    assert 0.5 < posterior < 1.0  # the target prefers one, but not with certainty
    strict = resolve_one(rec, scorer, ResolveSettings(min_posterior=(1 + posterior) / 2))
    # Not resolved: the options' shared ids stay proven (core/prefix.py), the rest is cut.
    assert not strict["ok"] and strict["evidence"] == "prefix_proven"
    assert strict["prefix"]["prefix_tokens"] == rec["candidates"]["diverge_at"]
    assert strict["issues"] == ["reasoning_tail_unverifiable", TARGET_UNRESOLVED]
    assert strict["output_ids"] == rec["output_ids"]  # nothing replaced
    assert strict["resolution"]["posterior"] == pytest.approx(posterior)
    assert strict["resolution"]["min_posterior"] == (1 + posterior) / 2


def resolve_one(rec: dict[str, Any], scorer: Any, settings: ResolveSettings) -> dict[str, Any]:
    from kimi_pipe.extraction.resolve import score_record

    assert resolvable(rec) is None
    out = score_record(rec, scorer, settings)
    assert out is not None
    return out


def test_only_closed_sets_with_nothing_else_wrong_are_resolvable(smol: tuple[Any, Any]) -> None:
    _, tok = smol
    rec = tail_record(tok)
    assert resolvable(rec) is None
    opened = {**rec, "candidates": {**rec["candidates"], "closed": False, "why_open": "split"}}
    assert resolvable(opened) == "open_set"
    other = {**rec, "issues": [*rec["issues"], "tool_index_untrusted"]}
    assert resolvable(other) == "other_issues"
    assert resolvable({**rec, "ok": True}) == "already_ok"
    # More options than the target scores (resolve.max_options): not resolvable.
    listed = len(rec["candidates"]["options"])
    assert resolvable(rec, max_options=listed) is None
    assert resolvable(rec, max_options=listed - 1) == "too_many_options"
    # No temperature known: not scored at all.
    none = {**rec, "sampling": None}
    from kimi_pipe.extraction.resolve import score_record

    assert score_record(none, HFSuffixScorer(smol[0], "smollm2"), ResolveSettings()) is None


# --------------------------------------------------------------------------- the records file


def test_extract_resolves_then_stores_the_chosen_ids(tmp_path: Path, smol: Any) -> None:
    _, tok = smol
    plain = tail_record(tok, "plain")
    plain.update(ok=True, evidence="text_proven", issues=[])
    del plain["candidates"]
    tight = tail_record(tok, "tight", sampling={"temperature": 1.0, "top_p": 0.5})
    unsure = tail_record(tok, "unsure", sampling={"temperature": 1.0, "top_p": 1.0})
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in (plain, tight, unsure)))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "model=smollm2",
                f"extract.run_dir={tmp_path}",
                "resolve.min_posterior=1.0",
                "resolve.split_check=false",  # candidate sets only: tests/test_split_check.py
            ],
        )
    summary = run_extract(cfg)
    assert summary["resolve"]["counts"] == {"resolved": 1, TARGET_UNRESOLVED: 1}
    after = {r["id"]: r for r in read_records(records)}
    assert after["tight"]["evidence"] == "target_resolved" and after["tight"]["ok"]
    assert after["unsure"]["issues"][-1] == TARGET_UNRESOLVED and not after["unsure"]["ok"]
    assert after["plain"] == plain  # untouched
    assert after["unsure"]["evidence"] == "prefix_proven"  # its shared prefix only is kept
    store = HiddenStore(tmp_path / "hidden_hf")
    assert sorted(store.ids) == ["plain", "tight", "unsure"]
    k = unsure["candidates"]["diverge_at"]
    cut = unsure["prompt_ids"] + unsure["candidates"]["options"][0]["output_ids"][:k]
    assert store.tokens("unsure")["input_ids"].tolist() == cut
    chosen = tight["candidates"]["options"][after["tight"]["resolution"]["chosen"]]
    assert store.tokens("tight")["input_ids"].tolist() == tight["prompt_ids"] + chosen["output_ids"]
    assert chosen["output_ids"] != tight["output_ids"] or after["tight"]["resolution"]["chosen"]
    # Running again scores nothing new and leaves the file as it is.
    before = records.read_bytes()
    again = run_extract(cfg)
    assert again["resolve"]["counts"] == {"not_resolved_scored_before": 1}
    assert records.read_bytes() == before


def test_rewrite_keeps_other_bytes_and_skips_changed_lines(tmp_path: Path) -> None:
    from kimi_pipe.extraction.resolve import _digest

    path = tmp_path / "records.jsonl"
    lines = [b'{"id":"a","v":1}\n', b"not json\n", b'{"id":"b","v":1}\n', b'{"id":"b","v":2}\n']
    path.write_bytes(b"".join(lines) + b'{"id":"c","v"')  # torn tail kept as it is
    updates = {
        "b": (_digest(lines[3]), {"id": "b", "v": 3}),
        "a": (_digest(b'{"id":"a","v":0}'), {"id": "a", "v": 9}),  # changed since: left alone
    }
    assert rewrite_records(path, updates) == 1
    assert path.read_bytes() == b"".join(lines[:3]) + b'{"id":"b","v":3}\n{"id":"c","v"'
    assert not list(tmp_path.glob(".*.tmp"))


KILL_CHILD = """
import json, sys
from kimi_pipe.extraction.resolve import _digest, rewrite_records
path = sys.argv[1]
while True:
    lines = open(path, "rb").read().splitlines(keepends=True)
    updates = {}
    for raw in lines:
        rec = json.loads(raw)
        updates[rec["id"]] = (_digest(raw), {**rec, "v": rec["v"] + 1})
    rewrite_records(path, updates)
    print("round", flush=True)
"""


def test_kill_during_rewrites_leaves_every_record_whole(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    pad = "x" * 2000
    rows = [{"id": f"r{i}", "v": 0, "pad": pad} for i in range(3000)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for attempt in range(6):
        child = subprocess.Popen(
            [sys.executable, "-c", KILL_CHILD, str(path)],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert child.stdout is not None
        child.stdout.readline()  # at least one whole rewrite done
        time.sleep(0.05 + 0.07 * attempt)  # then kill it somewhere inside a later one
        child.send_signal(signal.SIGKILL)
        child.wait()
        rows = read_records(path)
        assert [r["id"] for r in rows] == [f"r{i}" for i in range(3000)]
        assert len({r["v"] for r in rows}) == 1  # one rewrite's file, never a mix
        assert all(r["pad"] == pad for r in rows)
    assert rows[0]["v"] >= 6


def test_a_backend_that_cannot_score_leaves_records_unresolved(tmp_path: Path) -> None:
    from kimi_pipe.extraction.records_pass import resolve_records

    rec = {
        "id": "x",
        "ok": False,
        "issues": ["reasoning_tail_unverifiable"],
        "prompt_ids": [5, 6],
        "output_ids": [7, 2],
        "loss_mask": [0, 0, 1, 1],
        "sampling": {"temperature": 1.0, "top_p": 0.9},
        "candidates": {
            "closed": True,
            "classes": ["reasoning_tail"],
            "diverge_at": 1,
            "options": [
                {"output_ids": [7, 8, 2], "loss_mask": [1, 1, 1]},
                {"output_ids": [7, 2], "loss_mask": [1, 1]},
            ],
        },
    }
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    before = path.read_bytes()
    summary = resolve_records(path, None, ResolveSettings())
    assert summary["counts"] == {"not_resolved_backend_cannot_score": 1}
    assert path.read_bytes() == before
    # A set over resolve.max_options is counted as such, before any scorer is asked.
    summary = resolve_records(path, None, ResolveSettings(max_options=1))
    assert summary["counts"] == {"not_resolved_too_many_options": 1}
    assert path.read_bytes() == before


def test_nucleus_slack_decides_what_is_impossible_at_the_edge() -> None:
    """A token whose higher-ranked mass passes top_p by 0.005 is outside the nucleus; a judge
    that allows for other numerics (`resolve.nucleus_slack` 0.01) keeps it drawable."""
    probs = torch.tensor([0.5, 0.405, 0.05, 0.045])  # mass above the third token: 0.905
    logits = torch.log(probs)[None, :]
    strict = sampled_logprobs(logits, [2], Sampling(1.0, 0.9))
    loose = sampled_logprobs(logits, [2], Sampling(1.0, 0.9, slack=0.01))
    assert strict == [-math.inf] and loose[0] > -math.inf
    table = sampler_log_table(logits, Sampling(1.0, 0.9, slack=0.01))
    assert table[0, 2].item() == pytest.approx(loose[0]) and table[0, 3] == -math.inf
    sent = {"sampling": {"temperature": 1.0, "top_p": 0.9}}
    sampling = ResolveSettings(nucleus_slack=0.01).sampling_of(sent)
    assert sampling is not None and sampling.slack == 0.01
    with pytest.raises(ValueError):
        ResolveSettings(nucleus_slack=1.5)


def test_the_judges_dtype_sets_the_default_slacks() -> None:
    """A judge in bfloat16 puts the provider's float32 greedy argmax up to 0.6 % below its top
    logit (measured on the demo): with float32's slack it would call the provider's token
    impossible; its own default keeps it. The extract stage's dtype picks the default."""
    logits = torch.tensor([[20.0, 19.9, 5.0]])  # token 1: 0.5 % below the top logit
    greedy = {"sampling": {"temperature": 0}}
    full = ResolveSettings().sampling_of(greedy)
    half = ResolveSettings(judge_dtype="bfloat16").sampling_of(greedy)
    assert full is not None and half is not None
    assert sampled_logprobs(logits, [1], full) == [-math.inf]
    assert sampled_logprobs(logits, [1], half) == [0.0]
    assert sampler_log_table(logits, half)[0, 2] == -math.inf
    assert ResolveSettings(judge_dtype="bfloat16", greedy_slack=1e-4).slacks[1] == 1e-4
    cfg = OmegaConf.create({"resolve": {"min_posterior": 0.999}, "extract": {"dtype": "bfloat16"}})
    assert extract_job(cfg).resolve.judge_dtype == "bfloat16"
    with pytest.raises(ValueError, match="judge_dtype"):
        extract_job(OmegaConf.create({"resolve": {"judge_dtype": "float32"}, "extract": {}}))


def test_prefix_cache_reaches_a_model_that_calls_it_past_key_values(smol: tuple[Any, Any]) -> None:
    """transformers before the `cache` rename (5.8.1, SGLang's venv) takes `past_key_values`
    and swallows an unknown `cache=`: the scorer must hand the prefix cache over by the name
    the model takes, or every suffix is scored without its prefix (found by the sglang_cpu
    tier: -19.6 instead of -4.3 nats)."""
    model, tok = smol

    class PastKeyValuesModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, input_ids: Any, past_key_values: Any = None, **kwargs: Any) -> Any:
            assert "cache" not in kwargs
            return self.inner(input_ids=input_ids, cache=past_key_values, **kwargs)

    prefix = prompt_ids(tok) + encode(tok, "The capital")
    suffixes = [encode(tok, " of France is Paris.\n") + [2], encode(tok, " of France.") + [2]]
    want = HFSuffixScorer(model, "smollm2").score_suffixes(prefix, suffixes, Sampling(1.0))
    got = HFSuffixScorer(PastKeyValuesModel(), "smollm2").score_suffixes(
        prefix, suffixes, Sampling(1.0)
    )
    assert got == pytest.approx(want, abs=1e-4)
