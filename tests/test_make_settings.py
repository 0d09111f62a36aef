"""Every make target that runs a stage passes each `key=value` typed on make's command line to
the stage; any other target refuses it by name (issue 42: `make generate dataset=B5
budget.usd=5` used to run with the default $1 cap, the setting dropped without a word)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cases import load_or_skip

REPO = Path(__file__).resolve().parent.parent


def make(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    found = shutil.which("make")
    if found is None:
        pytest.fail("make is needed: the documented commands are make targets")
    # -o setup: the venv is this test's interpreter (PYTHON=), not set up again.
    return subprocess.run(
        [found, "-s", "-C", str(REPO), "-o", "setup", f"PYTHON={sys.executable}", *args],
        capture_output=True, text=True, check=False, timeout=300, cwd=cwd, env=env,
    )  # fmt: skip


def stage_line(done: subprocess.CompletedProcess[str], stage: str) -> str:
    assert done.returncode == 0, done.stderr
    commands = done.stdout.replace("\\\n", " ").splitlines()
    return next(x for x in commands if f"kimi_pipe {stage}" in x)


@pytest.mark.parametrize(
    ("target", "given", "passed"),
    [
        ("generate", ["dataset=B5", "budget.usd=5"], ["'dataset=B5'", "'budget.usd=5'"]),
        ("demo", ["dataset.limit=4", "provider.params.max_tokens=16"],
         ["'dataset.limit=4'", "'provider.params.max_tokens=16'"]),
        ("run", ["pipeline=demo", "dataset.limit=2"], ["'pipeline=demo'", "'dataset.limit=2'"]),
        ("sweep", ["dataset=B5", "providers=a,b", "n=50", "usd=6", "budget.reserve_factor=1.1"],
         ["'sweep.providers=[a,b]'", "sweep.n=50", "sweep.usd=6", "'dataset=B5'",
          "'budget.reserve_factor=1.1'"]),
        ("probe", ["providers=a", "usd=0.3", "model=kimi_k25"],
         ["'probe.providers=[a]'", "probe.usd=0.3", "'model=kimi_k25'"]),
        ("report", ["sweep_dir=runs/x", "report.min_ok_rate=0.5"],
         ["report.sweep_dir=runs/x", "'report.min_ok_rate=0.5'"]),
        # A value with spaces or a quote stays one shell word, as typed.
        ("generate", ["output_dir=it's a dir", "+extra.note=x"],
         ["'output_dir=it'\\''s a dir'", "'+extra.note=x'"]),
    ],
)  # fmt: skip
def test_every_setting_typed_reaches_the_stage(
    target: str, given: list[str], passed: list[str]
) -> None:
    line = stage_line(make("-n", target, *given), target)
    for word in passed:
        assert word in line, (word, line)
    # The short names are translated, never passed on as they are as well.
    for short in ("providers=", "'n=", "'usd=", "sweep_dir="):
        assert f" '{short.strip(chr(39))}" not in line, line


def test_capitals_are_makes_own_variables() -> None:
    line = stage_line(
        make("-n", "generate", "TORCH=cpu", "ARGS=seed=3", "budget.usd=2"), "generate"
    )
    assert "TORCH" not in line and "'budget.usd=2'" in line and line.rstrip().endswith("seed=3")


@pytest.mark.parametrize("goals", [["test"], ["lint"], [], ["setup"]])
def test_a_target_that_runs_no_stage_refuses_a_setting_by_name(goals: list[str]) -> None:
    done = make("-n", *goals, "dataset.limt=4")
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "takes no settings: dataset.limt" in done.stderr, done.stderr


def test_the_budget_typed_to_make_is_the_runs_budget(tmp_path: Path) -> None:
    """The documented friction, run for real: the plan line of `make generate ...
    budget.usd=5` says $5 (no request sent: the one prompt's worst case is over its cap; the
    prices given, as nothing listens at the api_base)."""
    load_or_skip("kimi_k25")  # the default model: its tokenizer renders the prompt
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    env["OPENROUTER_API_KEY"] = "sk" + "-test-not-a-real-key"
    done = make(
        "generate", "dataset=jsonl", f"dataset.path={prompts}", "budget.usd=5",
        f"output_dir={tmp_path / 'run'}", "provider.api_base=http://127.0.0.1:9/v1",
        "serving=unknown", "budget.max_usd_per_sample=0.000001",
        "provider.pricing.input_usd_per_mtok=1", "provider.pricing.output_usd_per_mtok=1",
        env=env,
    )  # fmt: skip
    said = done.stdout + done.stderr  # the log goes to stdout, the last line to stderr
    plan = [line for line in said.splitlines() if "generate: 1 prompts" in line]
    assert plan and "budget $5.0 " in plan[0], said[-3000:]
