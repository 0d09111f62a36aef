"""`python -m kimi_pipe demo` end to end on a handful of bundled prompts: a real server on
127.0.0.1, real SmolLM2 weights, real greedy ground truth, a loadable SpecForge export.
Then the same command again: every stage resumes and nothing is duplicated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kimi_pipe.store.conventions import final_state_as

REPO = Path(__file__).resolve().parent.parent
PROMPTS = REPO / "data" / "demo_prompts.jsonl"
N = 3


def test_bundled_prompts_are_varied_and_well_formed() -> None:
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    assert 24 <= len(rows) <= 60
    assert len({r["id"] for r in rows}) == len(rows)
    kinds = {r["id"].split("-")[0] for r in rows}
    assert {"chat", "code", "math", "ml", "long"} <= kinds
    for r in rows:
        assert r["messages"][-1]["role"] == "user" and r["messages"][-1]["content"].strip()
    text = "".join(m["content"] for r in rows for m in r["messages"])
    assert any(ord(c) > 0x3000 for c in text)  # CJK among the multilingual prompts


def run_demo(run_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OPENROUTER_API_KEY"}  # no key at all
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kimi_pipe",
            "demo",
            f"dataset.limit={N}",
            "provider.params.max_tokens=12",
            f"output_dir={run_dir}",
        ],  # fmt: skip
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )


@pytest.mark.slow
def test_demo_end_to_end_and_resume(tmp_path: Path) -> None:
    from kimi_pipe.store.hidden_store import HiddenStore

    run_dir = tmp_path / "demo"
    done = run_demo(run_dir)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert "fidelity exact-match rate" in out and str(run_dir / "audit.json") in out

    records = [json.loads(x) for x in (run_dir / "records.jsonl").read_text().splitlines()]
    assert len(records) == N and all(r["error"] is None for r in records)
    assert not any("other_model" in r["issues"] for r in records)  # the server's own name
    for r in records:  # the server's own usage agrees with the reconstructed ids
        assert r["usage"]["completion_tokens"] == len(r["output_ids"])
    assert "/v1/chat/completions" in (run_dir / "local_server.log").read_text()

    audit = json.loads((run_dir / "audit.json").read_text())
    assert audit["audited"] == N and audit["truth"] == "hf_greedy"
    # Greedy on both sides with the same weights and threads: every id must agree.
    assert audit["exact"] == N, (run_dir / "audit.md").read_text()
    assert f"100.0% ({N} of {N})" in out
    # Yield in tokens and dollars (issue 33), as generate's summary.json has it.
    from kimi_pipe.core.token_yield import yield_line

    block = json.loads((run_dir / "summary.json").read_text())["yield"]
    billed = sum(r["usage"]["completion_tokens"] for r in records)
    assert block["completion_tokens_bought"] == billed
    assert 0 < block["exact_accepted"] <= block["completion_tokens_bought"]
    assert yield_line(block) in out

    export = run_dir / "export_specforge"
    index = [json.loads(x) for x in (export / "export_index.jsonl").read_text().splitlines()]
    assert len(index) == N
    by_id = {r["id"]: r for r in records}
    store = HiddenStore(run_dir / "hidden_hf")
    for row in index:
        sample = torch.load(export / row["file"], weights_only=True)
        rec = by_id[row["id"]]
        ids = rec["prompt_ids"] + rec["output_ids"]
        assert sample["input_ids"].tolist() == ids  # never re-tokenised
        assert sample["loss_mask"].tolist() == rec["loss_mask"]
        length = len(ids)
        assert sample["hidden_state"].shape == (1, length, 576)
        assert sample["aux_hidden_state"].shape == (1, length, 3 * 576)
        # The store keeps the pre-norm state; SpecForge gets it through the recorded norm.
        assert store.manifest["final_state"] == "pre_norm"
        post = final_state_as(store.manifest, store[row["id"]]["hidden_state"], "post_norm")
        assert torch.equal(post, sample["hidden_state"][0])
    card = (export / "README.md").read_text()
    assert "exact_match_rate" in card

    saved_config = (run_dir / "demo_config.yaml").read_text()
    assert "api_key:" not in saved_config

    again = run_demo(run_dir)  # resume: nothing new to buy, nothing duplicated
    assert again.returncode == 0, again.stderr[-4000:]
    assert len((run_dir / "records.jsonl").read_text().splitlines()) == N
    assert len((run_dir / "audit_truth.jsonl").read_text().splitlines()) == N
    assert "all answered already" in again.stderr  # the server was not even started
    assert again.stderr.count("complete, skipped") == 6  # the runner skipped every stage
    assert len(HiddenStore(run_dir / "hidden_hf")) == N
