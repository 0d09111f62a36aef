"""Several datasets in one generate job under one USD cap (generation/datasets.py).

Against the fake OpenRouter over real HTTP: the second dataset stops where the job's shared
cap is reached, each dataset keeps its own run directory, a restart counts what every run
directory of the job spent (a killed process's open requests at their worst case), and
what the provider billed in all stays under the cap.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_pipe.config import compose
from kimi_pipe.errors import ConfigError
from kimi_pipe.generation.datasets import dataset_nodes, run_dir_spend
from kimi_pipe.stages.generate import generate, is_complete
from tests.support.conftest_generate import (
    base_overrides,
    read_jsonl,
    run_subprocess,
    write_prompts,
)
from tests.support.fake_openrouter import Behaviour

pytestmark = pytest.mark.usefixtures("api_key_env")


def job(tmp_path: Path, url: str, kimi_dir: Path, cap: float, n_b: int = 40) -> list[str]:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_prompts(a, 12, prefix="a")
    write_prompts(b, n_b, prefix="b")
    out = tmp_path / "job"
    overrides = base_overrides(a, url, out, kimi_dir, usd=cap, concurrency=2)
    overrides += ["provider.params.max_tokens=128", "budget.slow_start=false"]
    return [*overrides, f"datasets=[{{name: a, path: '{a}'}},{{name: b, path: '{b}'}}]"]


def run(overrides: list[str], out: Path) -> tuple[int, dict]:
    status, summary = generate(compose(overrides), out)
    assert summary is not None
    return status, summary


def test_the_second_dataset_stops_at_the_shared_cap_and_a_restart_keeps_the_spend(
    tmp_path: Path, fake_openrouter, kimi_dir: Path
) -> None:
    srv = fake_openrouter(default=Behaviour())
    # One answer here costs about $0.00013 (worst case $0.00035): the first dataset's
    # twelve take about half the cap, the second's forty would take more than all of it.
    cap = 0.003
    out = tmp_path / "job"
    overrides = job(tmp_path, srv.url(), kimi_dir, cap)
    status, summary = run(overrides, out)
    assert status == 0
    billed = srv.total_cost()
    assert billed <= cap
    a, b = summary["datasets"]["a"], summary["datasets"]["b"]
    assert a["stop_reason"] == "done" and a["counts"]["answered"] == 12
    assert b["stop_reason"] == "budget_usd" and 0 < b["counts"]["answered"] < 40
    # The second dataset was given what the first left, not the whole cap.
    assert b["usd"] == pytest.approx(cap - a["spend_usd"], rel=1e-9)
    # Each dataset has its own run directory, records and summary.
    for name, prefix in (("a", "a"), ("b", "b")):
        recs = read_jsonl(out / name / "records.jsonl")
        assert recs and all(r["id"].startswith(prefix) for r in recs)
        assert json.loads((out / name / "summary.json").read_text())["run_dir"] == str(out / name)
    assert summary["spend_usd"] >= billed - 1e-12 and summary["spend_usd"] <= cap
    assert set(summary["spend_usd_by_run_dir"]) == {"a", "b"}

    # The same command again: the first dataset's spend still counts against the cap, so
    # the second gets no more than the cap left (alone it would buy past the cap).
    n = len(srv.requests)
    status, again = run(overrides, out)
    assert srv.total_cost() <= cap
    assert len(srv.requests) - n <= 2  # at most one window of requests that still fit
    assert again["datasets"]["a"]["counts"]["answered"] == 12
    assert again["datasets"]["b"]["counts"]["answered"] < 40

    # A larger cap lets the second dataset go on from where it stopped.
    status, more = run([*overrides, "budget.usd=0.05"], out)
    assert status == 0 and more["datasets"]["b"]["stop_reason"] == "done"
    assert len(read_jsonl(out / "b" / "records.jsonl")) == 40
    assert srv.total_cost() <= 0.05
    # The runner's completeness check reads each dataset's run directory.
    assert is_complete(compose(overrides), out)
    (out / "b" / "records.jsonl").write_text("")
    assert not is_complete(compose(overrides), out)


def test_a_killed_runs_open_requests_and_a_dropped_dataset_count_against_the_cap(
    tmp_path: Path, fake_openrouter, kimi_dir: Path
) -> None:
    srv = fake_openrouter(default=Behaviour())
    cap = 0.003
    out = tmp_path / "job"
    # A dataset of an earlier run of this job, no longer listed, whose process was killed
    # with requests in flight: its journal holds intents never settled.
    old = out / "old"
    old.mkdir(parents=True)
    with (old / "spend_journal.jsonl").open("w") as fh:
        for n in range(1, 6):
            fh.write(json.dumps({"k": "i", "n": n, "id": f"x{n}", "a": 1, "usd": 0.0005}) + "\n")
        fh.write(json.dumps({"k": "s", "n": 1, "usd": 0.0001, "b": True}) + "\n")
    held = 0.0001 + 4 * 0.0005
    assert run_dir_spend(old) == pytest.approx(held)
    status, summary = run(job(tmp_path, srv.url(), kimi_dir, cap), out)
    assert srv.total_cost() <= cap - held + 1e-12
    assert summary["spend_usd_by_run_dir"]["old"] == pytest.approx(held)
    assert summary["datasets"]["a"]["usd"] == pytest.approx(cap - held)
    assert summary["spend_usd"] <= cap


def test_the_datasets_setting_is_checked(tmp_path: Path) -> None:
    cfg = compose(["datasets=[B5,B6]"])
    assert [n["name"] for n in dataset_nodes(cfg) or []] == ["B5", "B6"]
    assert dataset_nodes(compose([])) is None
    for bad, says in (
        ("datasets=[B5,nope]", "no dataset 'nope'"),
        ("datasets=[B5,B5]", "named twice"),
        ("datasets=[]", "give a list"),
        ("datasets=[{path: x.jsonl}]", "plain name"),
    ):
        with pytest.raises(ConfigError, match=says):
            dataset_nodes(compose([bad]))
    node = dataset_nodes(compose(["datasets=[{name: mine, path: p.jsonl}]"]))
    assert node is not None and node[0]["source"] == "jsonl"


def test_the_command_line_runs_a_job_of_two_datasets(
    tmp_path: Path, fake_openrouter, kimi_dir: Path
) -> None:
    """Through Hydra (`python -m kimi_pipe generate 'datasets=[...]'`): the job's directory
    is the Hydra run directory, each dataset a run directory in it."""
    srv = fake_openrouter(default=Behaviour())
    out = tmp_path / "job"
    proc = run_subprocess(job(tmp_path, srv.url(), kimi_dir, cap=0.05, n_b=3))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [d["stop_reason"] for d in summary["datasets"].values()] == ["done", "done"]
    assert len(read_jsonl(out / "a" / "records.jsonl")) == 12
    assert len(read_jsonl(out / "b" / "records.jsonl")) == 3
    assert (out / ".hydra").is_dir() and summary["spend_usd"] == pytest.approx(srv.total_cost())
    bad = run_subprocess([*job(tmp_path, srv.url(), kimi_dir, cap=0.05), "datasets=[a,a]"])
    assert bad.returncode == 2 and "datasets" in bad.stderr
