"""The posterior rung (`posterior_sampled`, issue 33): opt-in, labelled, never exact.

A record target resolution left unresolved gets one option drawn from the target's
posterior (the numbers resolution stored), reproducibly; no record of an exact rung is
changed; under the default policy nothing drawn reaches a training file (a drawn record
counts as its proven prefix, exactly what it was before the draw), in extraction and in
every export format; named in the policy, the drawn ids do, and every row says so.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kimi_pipe.core.evidence import (
    DEFAULT_ACCEPT,
    EXACT_RUNGS,
    POSTERIOR_SAMPLED,
    PREFIX_PROVEN,
    UNRESOLVED,
    parse_accept,
    usable,
)
from kimi_pipe.core.posterior import draw, draw_seed, posteriors_of, sample_posterior
from kimi_pipe.core.prefix import exact_output_tokens, training_ids, with_prefix
from kimi_pipe.core.token_yield import token_yield
from kimi_pipe.extraction.records_pass import resolve_records
from kimi_pipe.extraction.resolve import (
    ResolveSettings,
    blocking_issues,
    covered_issues,
    decide,
)
from kimi_pipe.extraction.token_samples import read_token_records
from kimi_pipe.stages.jobs.extract import extract_job
from kimi_pipe.store.atomic import temporary_name

PROMPT = [5, 6]
TAIL = "reasoning_tail_unverifiable"
MODEL = "judge"


def _unresolved(sid: str, options: list[list[int]], logprobs: list[float]) -> dict[str, Any]:
    """A record target resolution scored and left unresolved, as apply_resolution leaves it."""
    numbers = decide(logprobs, 0.999)
    assert not numbers["resolved"]
    diverge = next(
        (j for j in range(min(map(len, options))) if len({o[j] for o in options}) > 1),
        min(map(len, options)),
    )
    record: dict[str, Any] = {
        "id": sid,
        "ok": False,
        "evidence": UNRESOLVED,
        "issues": [TAIL, "target_unresolved"],
        "notes": [],
        "prompt_ids": PROMPT,
        "output_ids": list(options[0]),
        "loss_mask": [0, 0] + [1] * len(options[0]),
        "sampling": {"temperature": 1.0, "top_p": 0.9},
        "completion_tokens_reported": len(options[0]),
        "candidates": {
            "closed": True,
            "why_open": None,
            "classes": ["reasoning_tail"],
            "diverge_at": diverge,
            "options": [{"output_ids": o, "loss_mask": [1] * len(o), "label": ""} for o in options],
        },
        "resolution": {
            "method": "target",
            "model": MODEL,
            "min_posterior": 0.999,
            **{k: v for k, v in numbers.items() if k != "resolved"},
        },
    }
    return dict(with_prefix(record))  # type: ignore[arg-type]


def _exact(sid: str, rung: str, ids: list[int]) -> dict[str, Any]:
    return {
        "id": sid,
        "ok": True,
        "evidence": rung,
        "issues": [],
        "notes": [],
        "prompt_ids": PROMPT,
        "output_ids": ids,
        "loss_mask": [0, 0] + [1] * len(ids),
        "completion_tokens_reported": len(ids),
    }


def _records() -> list[dict[str, Any]]:
    with_prefix_ = _unresolved("p", [[7, 8, 9, 2], [7, 8, 10, 2]], [-0.4, -1.1])
    no_prefix = _unresolved("n", [[11, 2], [12, 2], [13, 2]], [-0.9, -1.0, -math.inf])
    # A prefix the target's split check withdrew: never drawn.
    withdrawn = _unresolved("w", [[7, 8, 9, 2], [7, 8, 10, 2]], [-0.4, -1.1])
    withdrawn.pop("prefix", None)
    withdrawn["evidence"] = UNRESOLVED
    withdrawn["issues"] = [*withdrawn["issues"], "prefix_split_ambiguous"]
    # A prefix_proven record the target cannot score (its request sent no temperature), so
    # no target_unresolved: not drawn.
    unscored = _unresolved("u", [[7, 8, 9, 2], [7, 8, 10, 2]], [-0.4, -1.1])
    unscored["issues"] = [TAIL]
    unscored["sampling"] = {"temperature": None, "top_p": None}
    del unscored["resolution"]
    exact = [
        _exact("e", "engine_ids", [20, 21, 2]),
        _exact("t", "text_proven", [22, 2]),
        {**_exact("r", "target_resolved", [7, 8, 9, 2]), "notes": ["resolved_by_target"]},
    ]
    assert with_prefix_["evidence"] == PREFIX_PROVEN and no_prefix["evidence"] == UNRESOLVED
    return [with_prefix_, no_prefix, withdrawn, unscored, *exact]


def _write(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _read(path: Path) -> dict[str, dict[str, Any]]:
    return {str(r["id"]): r for r in map(json.loads, path.read_text().splitlines())}


class _NeverScores:
    """The records were scored by this model before: the pass must not score them again."""

    model_name = MODEL

    def score_suffixes(self, *args: Any) -> list[float]:
        raise AssertionError("scored again")


def _pass(path: Path, seed: int = 0) -> dict[str, Any]:
    settings = ResolveSettings(posterior_sampled=True, posterior_seed=seed, split_check=False)
    return resolve_records(path, _NeverScores(), settings)


def test_the_draw_follows_the_posterior_and_is_reproducible() -> None:
    posteriors = posteriors_of([-0.4, -1.1, None])
    assert posteriors is not None and posteriors[2] == 0.0
    assert posteriors[0] == pytest.approx(1 / (1 + math.exp(-0.7)))
    picks = [draw(posteriors, draw_seed(f"id{i}", 0)) for i in range(4000)]
    assert 2 not in picks  # an impossible option is never drawn
    assert picks.count(0) / len(picks) == pytest.approx(posteriors[0], abs=0.03)
    # Same id and seed: the same draw; the setting's seed changes the draws.
    assert [draw(posteriors, draw_seed(f"id{i}", 0)) for i in range(4000)] == picks
    assert [draw(posteriors, draw_seed(f"id{i}", 1)) for i in range(4000)] != picks
    assert posteriors_of([None, -math.inf]) is None


def test_a_drawn_record_says_what_it_is(tmp_path: Path) -> None:
    record = _records()[0]
    cands = record["candidates"]
    blocking = blocking_issues(record["issues"])
    drawn = sample_posterior(record, 7, blocking, covered_issues(cands))
    assert drawn is not None
    sample = drawn["posterior_sample"]
    chosen = cands["options"][sample["option"]]
    assert drawn["evidence"] == POSTERIOR_SAMPLED and drawn["ok"] is False
    assert drawn["output_ids"] == chosen["output_ids"]
    assert drawn["loss_mask"] == [0, 0] + chosen["loss_mask"]
    assert drawn["issues"] == record["issues"]  # its flags stay: not proven
    assert sample["posterior"] == pytest.approx(posteriors_of([-0.4, -1.1])[sample["option"]])  # type: ignore[index]
    assert sample["seed"] == 7 and sample["options"] == 2 and "not the ids bought" in sample["rule"]
    assert drawn["prefix"] == record["prefix"]  # the proven prefix it had stays
    again = sample_posterior(record, 7, blocking, covered_issues(cands))
    assert again == drawn
    # A drawn record is not drawn again, nor is one with another blocking code.
    assert sample_posterior(drawn, 7, blocking, covered_issues(cands)) is None
    withdrawn = _records()[2]
    assert (
        sample_posterior(withdrawn, 7, blocking_issues(withdrawn["issues"]), covered_issues(cands))
        is None
    )


def test_the_pass_changes_no_exact_record_and_no_default_training_row(tmp_path: Path) -> None:
    """0 silent: with the rung on, every record of an exact rung is byte for byte as it was,
    and what the default policy trains on (ids, masks, exact tokens) is the same."""
    records = _records()
    path = tmp_path / "records.jsonl"
    _write(path, records)
    before_lines = {json.loads(line)["id"]: line for line in path.read_text().splitlines()}
    before_rows, _ = read_token_records(path)
    before_yield = token_yield(records)
    untouched = path.read_bytes()
    off = resolve_records(path, _NeverScores(), ResolveSettings(split_check=False))
    assert POSTERIOR_SAMPLED not in off["counts"] and path.read_bytes() == untouched  # default
    summary = _pass(path)
    assert summary["counts"][POSTERIOR_SAMPLED] == 2
    after = _read(path)
    after_lines = {json.loads(line)["id"]: line for line in path.read_text().splitlines()}
    for sid in ("e", "t", "r", "w", "u"):
        assert after_lines[sid] == before_lines[sid]  # exact rungs, and the undrawable ones
    assert {sid for sid, r in after.items() if r["evidence"] == POSTERIOR_SAMPLED} == {"p", "n"}
    assert all(r["evidence"] in EXACT_RUNGS for sid, r in after.items() if r.get("ok"))
    assert not any(r.get("ok") for r in after.values() if r["evidence"] == POSTERIOR_SAMPLED)
    after_rows, counts = read_token_records(path)
    assert [(s.id, s.input_ids, s.loss_mask) for s in after_rows] == [
        (s.id, s.input_ids, s.loss_mask) for s in before_rows
    ]
    assert "drawn_posterior_sampled" not in counts
    after_yield = token_yield(after.values())
    assert after_yield["exact_accepted"] == before_yield["exact_accepted"]
    assert after_yield["drawn_accepted"] == 0
    # A rerun draws nothing new and leaves the file as it is.
    again = path.read_bytes()
    _pass(path)
    assert path.read_bytes() == again
    assert not list(tmp_path.glob("*.tmp"))


def test_the_rewrite_goes_through_the_stores_atomic_writer(tmp_path: Path) -> None:
    """A link planted at the rewrite's temporary name is refused (store/atomic.py's
    O_NOFOLLOW), never written through; the records file stays as it was."""
    path = tmp_path / "records.jsonl"
    _write(path, _records())
    before = path.read_bytes()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, temporary_name(path, ".resolve.tmp"))
    with pytest.raises(OSError):
        _pass(path)
    assert victim.read_text() == "keep" and path.read_bytes() == before


def test_extraction_takes_drawn_ids_only_when_named(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    _write(path, _records())
    _pass(path)
    after = _read(path)
    drawn_p, drawn_n = after["p"], after["n"]
    k = drawn_p["prefix"]["prefix_tokens"]
    for kw in ({}, {"accept": DEFAULT_ACCEPT}):
        by_id = {s.id: s for s in read_token_records(path, **kw)[0]}  # type: ignore[arg-type]
        assert "n" not in by_id  # no prefix: nothing of it
        assert (
            by_id["p"].input_ids == PROMPT + drawn_p["candidates"]["options"][0]["output_ids"][:k]
        )
        assert not usable(drawn_n)
    named = parse_accept([*DEFAULT_ACCEPT, POSTERIOR_SAMPLED], "extract.accept")
    samples, counts = read_token_records(path, accept=named)
    by_id = {s.id: s for s in samples}
    assert by_id["n"].input_ids == PROMPT + drawn_n["output_ids"]
    assert by_id["p"].input_ids == PROMPT + drawn_p["output_ids"]
    assert counts["drawn_posterior_sampled"] == 2
    assert POSTERIOR_SAMPLED not in DEFAULT_ACCEPT and POSTERIOR_SAMPLED not in EXACT_RUNGS
    # Yield: drawn ids are counted apart, never as exact.
    block = token_yield(after.values(), named)
    assert block["drawn_accepted"] == len(drawn_n["output_ids"]) + len(drawn_p["output_ids"]) - k
    assert block["exact_by_rung"][POSTERIOR_SAMPLED] == k == exact_output_tokens(drawn_p)
    assert "DRAWN" in __import__("kimi_pipe.core.token_yield", fromlist=["x"]).yield_line(block)


@pytest.mark.parametrize("fmt", ["tokens", "speculators", "specforge", "modelopt"])
def test_every_export_leaves_drawn_rows_out_unless_named(tmp_path: Path, fmt: str) -> None:
    from kimi_pipe.exporters import FORMATS, export
    from kimi_pipe.store.conventions import final_norm_spec
    from kimi_pipe.store.hidden_store import StoreWriter, make_manifest

    assert fmt in FORMATS
    run = tmp_path / "run"
    run.mkdir()
    path = run / "records.jsonl"
    _write(path, _records())
    _pass(path)
    after = _read(path)
    manifest = make_manifest(
        model="m", num_layers=8, layer_ids=[1, 3, 4], layer_convention="output_of_layer",
        final_state="pre_norm", hidden_size=4, dtype="float32", loss_mask="test",
        source_runs=[str(run)], backend="test",
        extra={"final_norm": final_norm_spec(torch.full((4,), 1.5), 1e-5, "norm")},
    )  # fmt: skip
    named = (*DEFAULT_ACCEPT, POSTERIOR_SAMPLED)
    rows = {sid: training_ids(after[sid], named) for sid in ("p", "n", "t")}
    gen = torch.Generator().manual_seed(0)
    with StoreWriter(tmp_path / "store", manifest, shard_samples=2) as w:
        for sid, (ids, mask) in rows.items():
            w.add(sid, ids, mask, torch.randn(len(ids), 12, generator=gen),
                  torch.randn(len(ids), 4, generator=gen))  # fmt: skip
    default = export([tmp_path / "store"], tmp_path / "out", fmt, seed=0)
    index = [json.loads(line) for line in (tmp_path / "out" / "export_index.jsonl").open()]
    assert [e["id"] for e in index] == ["t"]  # drawn rows stored whole: left out
    assert not any(e.get("drawn") for e in index)
    assert default["policy"]["excluded_by_evidence"] == {POSTERIOR_SAMPLED: 2}
    assert "DRAWN" not in (tmp_path / "out" / "README.md").read_text()
    taken = export([tmp_path / "store"], tmp_path / "named", fmt, seed=0, accept=list(named))
    index = [json.loads(line) for line in (tmp_path / "named" / "export_index.jsonl").open()]
    by_id = {e["id"]: e for e in index}
    assert sorted(by_id) == ["n", "p", "t"]
    assert by_id["p"]["drawn"] is True and by_id["p"]["evidence"] == POSTERIOR_SAMPLED
    assert by_id["n"]["drawn"] is True and "drawn" not in by_id["t"]
    assert taken["policy"]["exported_by_evidence"][POSTERIOR_SAMPLED] == 2
    card = (tmp_path / "named" / "README.md").read_text()
    assert "**2 samples" in card and "DRAWN, not bought" in card


def test_the_rung_is_off_unless_asked_for() -> None:
    from kimi_pipe.config import compose

    assert extract_job(compose([])).resolve.posterior_sampled is False
    on = extract_job(compose(["resolve.posterior_sampled=true"])).resolve
    assert on.posterior_sampled is True and on.posterior_seed == 0
    assert parse_accept(None) == DEFAULT_ACCEPT and POSTERIOR_SAMPLED not in parse_accept(None)
