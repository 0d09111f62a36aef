"""The public contract: `python -m kimi_pipe reconstruct ... input=IN output=OUT`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import TAIL_KEPT_OVERRIDES, expected_output_ids

REPO = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kimi_pipe", "reconstruct", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.kimi
def test_contract_reproduces_every_case(
    tmp_path: Path, kimi_dir: Path, kimi: Any, kimi_cases: list[dict[str, Any]]
) -> None:
    source = tmp_path / "in.jsonl"
    lines = [
        json.dumps({k: c[k] for k in ("id", "messages", "tools", "response") if k in c})
        for c in kimi_cases
    ]
    lines.insert(3, "{not json")  # a bad record is reported in its own line; the batch goes on
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    target = tmp_path / "out" / "out.jsonl"
    done = _run(
        "model=kimi_k25",
        f"model.tokenizer.path={kimi_dir}",
        f"input={source}",
        f"output={target}",
        *TAIL_KEPT_OVERRIDES,  # the hand-written answers keep the tail and argument edges
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines()]
    assert len(records) == len(kimi_cases) + 1
    bad = records.pop(3)
    assert bad["ok"] is False and bad["issues"] == ["malformed_record"]
    keys = [
        "id",
        "ok",
        "issues",
        "prompt_ids",
        "output_ids",
        "loss_mask",
        "completion_tokens_reported",
        "completion_tokens_reconstructed",
    ]
    for case, record in zip(kimi_cases, records, strict=True):
        # The contract's keys first, then the evidence ladder's (issue 19).
        assert list(record)[: len(keys)] == keys
        assert set(list(record)[len(keys) :]) <= {"evidence", "sampling", "candidates"}
        assert record["evidence"] == ("text_proven" if record["ok"] else "unresolved")
        assert record["id"] == case["id"]
        expected = expected_output_ids(kimi, case)
        assert record["output_ids"] == expected, case["id"]
        assert sorted(record["issues"]) == sorted(case["expect"]["issues"]), case["id"]
        assert len(record["loss_mask"]) == len(record["prompt_ids"]) + len(expected)
    codes = {code for r in records for code in r["issues"]}
    assert {"truncated", "billing_mismatch", "malformed_response"} <= codes


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["input=/no/such/file.jsonl", "output=/tmp/x.jsonl"], "/no/such/file.jsonl"),
        (["model=no_such_model", "input=x", "output=y"], "no_such_model"),
        (
            ["model.tokenizer.path=/no/tokenizer", "input=pyproject.toml", "output=/tmp/x.jsonl"],
            "/no/tokenizer",
        ),
        (["output=/tmp/x.jsonl"], "input="),
    ],
)
def test_clear_errors_exit_nonzero(args: list[str], message: str) -> None:
    done = _run(*args)
    assert done.returncode == 2
    assert message in done.stderr
