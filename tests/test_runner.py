"""The generic runner (`python -m kimi_pipe run`): order, skipping finished stages, resuming a
stage killed in the middle, one runner per run directory, clear errors; and the shipped
pipelines compose and resolve to real stages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kimi_pipe.config import compose
from kimi_pipe.pipeline.registry import STAGES, SweepStage
from kimi_pipe.pipeline.runner import RunDirBusy, run_dir_lock, run_pipeline, stage_specs
from kimi_pipe.pipeline.stage import Stage, StageContext

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def toy(run_dir: Path, *extra: str, n: int = 5) -> list[str]:
    pipeline = (
        f"+pipeline={{name:toy,run_dir:'{run_dir}',stages:["
        "{stage:'pipeline_toy_stages:Lines'},{stage:'pipeline_toy_stages:Total'}]}"
    )
    return [pipeline, f"+toy.n={n}", *extra]


def run_cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])}
    return subprocess.run(
        [sys.executable, "-m", "kimi_pipe", "run", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_runs_in_order_then_skips_every_finished_stage(tmp_path: Path) -> None:
    first = run_pipeline(compose(toy(tmp_path)), say=lambda _: None)
    assert [(o.name, o.status) for o in first.outcomes] == [("lines", "ran"), ("total", "ran")]
    assert (tmp_path / "total.txt").read_text() == "5\n"
    assert first.results["total"] == {"total": 5, "lines_said": 5}

    said: list[str] = []
    again = run_pipeline(compose(toy(tmp_path)), say=said.append)
    assert [o.status for o in again.outcomes] == ["skipped", "skipped"]
    # A skipped stage's result comes back from its marker, for later stages and summaries.
    assert again.results["total"] == {"total": 5, "lines_said": 5}
    assert sum("complete, skipped" in s for s in said) == 2
    summary = json.loads((tmp_path / "pipeline_summary.json").read_text())
    assert [s["status"] for s in summary["stages"]] == ["skipped", "skipped"]


def test_changed_settings_rerun_the_stage(tmp_path: Path) -> None:
    run_pipeline(compose(toy(tmp_path, n=3)), say=lambda _: None)
    said: list[str] = []
    run = run_pipeline(compose(toy(tmp_path, n=6)), say=said.append)
    assert [o.status for o in run.outcomes] == ["ran", "ran"]
    assert run.results["lines"]["resumed_from"] == 3  # the stage resumed, did not restart
    assert (tmp_path / "lines.txt").read_text().splitlines() == [f"line {i}" for i in range(6)]
    assert any("settings changed" in s for s in said)


def test_a_failed_stage_stops_the_pipeline_and_a_rerun_continues_there(tmp_path: Path) -> None:
    failed = run_cli(toy(tmp_path, "+toy.fail=true"))
    assert failed.returncode == 1, failed.stderr
    assert "total: failed" in failed.stderr and "told to fail" in failed.stderr
    assert "Traceback" not in failed.stderr + failed.stdout
    assert not (tmp_path / "total.txt").exists()

    fixed = run_cli(toy(tmp_path))
    assert fixed.returncode == 0, fixed.stderr
    assert "lines: complete, skipped" in fixed.stderr
    assert "| total | ran " in fixed.stdout and "| lines | skipped" in fixed.stdout


def test_kill_in_the_middle_of_a_stage_then_resume(tmp_path: Path) -> None:
    n = 40
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kimi_pipe", "run", *toy(tmp_path, "+toy.delay_s=0.05", n=n)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    lines = tmp_path / "lines.txt"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if lines.exists() and len(lines.read_text().splitlines()) >= 5:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written = len(lines.read_text().splitlines())
    assert 5 <= written < n, "the kill must land in the middle of the stage"
    assert not (tmp_path / ".pipeline" / "lines.json").exists()  # no marker for a killed stage

    resumed = run_cli(toy(tmp_path, n=n))
    assert resumed.returncode == 0, resumed.stderr
    marker = json.loads((tmp_path / ".pipeline" / "lines.json").read_text())
    assert marker["result"]["resumed_from"] >= written - 1  # continued, not started over
    assert lines.read_text().splitlines() == [f"line {i}" for i in range(n)]
    assert (tmp_path / "total.txt").read_text() == f"{n}\n"


def test_one_runner_per_run_directory(tmp_path: Path) -> None:
    (tmp_path / ".pipeline").mkdir()
    with run_dir_lock(tmp_path):
        done = run_cli(toy(tmp_path))
        assert done.returncode == 2
        assert f"pid {os.getpid()}" in done.stderr  # names the holder
        with pytest.raises(RunDirBusy):
            run_pipeline(compose(toy(tmp_path)), say=lambda _: None)
    assert run_cli(toy(tmp_path)).returncode == 0  # the lock died with its holder's handle


def test_clear_errors_for_bad_pipelines(tmp_path: Path) -> None:
    nothing = run_cli([f"output_dir={tmp_path}"])
    assert nothing.returncode == 2 and "pipeline=demo" in nothing.stderr
    unknown = run_cli([f"+pipeline={{name:x,run_dir:'{tmp_path}',stages:[{{stage:nope}}]}}"])
    assert unknown.returncode == 2 and "unknown stage 'nope'" in unknown.stderr
    broken = run_cli(
        [
            f"+pipeline={{name:x,run_dir:'{tmp_path}',stages:[{{stage:'pipeline_toy_stages:NotAStage'}}]}}"
        ]
    )
    assert broken.returncode == 2 and "does not implement the Stage protocol" in broken.stderr
    for done in (nothing, unknown, broken):
        assert "Traceback" not in done.stderr


def test_a_stage_whose_input_is_missing_says_so(tmp_path: Path) -> None:
    cfg = compose(
        [
            f"+pipeline={{name:x,run_dir:'{tmp_path}',stages:[{{stage:'pipeline_toy_stages:Total'}}]}}"
        ]
    )
    run = run_pipeline(cfg, say=lambda _: None)
    assert not run.ok and "lines.txt" in (run.outcomes[0].error or "")


@pytest.mark.parametrize(
    ("name", "stages"),
    [
        ("demo", ["model", "generate", "reconstruct", "audit", "extract", "export"]),
        ("openrouter_sglang", ["generate", "reconstruct", "extract", "export"]),
        ("sweep", ["probe", "sweep"]),
    ],
)
def test_shipped_pipelines_compose_to_builtin_stages(name: str, stages: list[str]) -> None:
    cfg = compose([f"pipeline={name}", "dataset=B5"] if name != "demo" else ["pipeline=demo"])
    specs = stage_specs(cfg)
    assert [s.name for s in specs] == stages
    assert all(isinstance(s.stage, Stage) for s in specs)
    assert set(stages) <= set(STAGES)


def test_pipeline_settings_yield_to_the_command_line(tmp_path: Path) -> None:
    demo = compose(["pipeline=demo"])
    assert (demo.model.name, demo.provider.name, demo.output_dir) == (
        "smollm2",
        "local",
        "runs/demo",
    )
    assert Path(demo.dataset.path).is_file() and demo.extract.only_ok is False
    mine = compose(["pipeline=demo", f"output_dir={tmp_path}", "dataset.limit=2"])
    assert mine.pipeline.run_dir == str(tmp_path) and mine.dataset.limit == 2
    real = compose(["pipeline=openrouter_sglang", "dataset=B5"])
    assert (real.model.name, real.provider.name, real.extract.backend) == (
        "kimi_k25", "openrouter", "sglang",
    )  # fmt: skip


def test_sweep_stage_runs_the_sweep_as_a_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 18: the sweep stage calls the sweep (no argv strings); the pipeline's own probe
    stage ran the probes, so its sweep stage does not probe again."""
    from kimi_pipe.pipeline.runner import stage_config
    from kimi_pipe.stages import sweep

    seen: list[tuple[str, sweep.SweepSettings, Path | None]] = []

    def fake_sweep(
        cfg: Any, args: sweep.SweepSettings, run_dir: Path | None = None, given: Any = None
    ) -> tuple[int, dict[str, Any]]:
        seen.append((str(cfg.dataset.name), args, run_dir))
        return 0, {}

    monkeypatch.setattr(sweep, "sweep", fake_sweep)
    cfg = compose(["pipeline=sweep", "dataset=B5", "sweep.providers=[a,b]", "sweep.usd=2"])
    SweepStage().run(StageContext(cfg, tmp_path))
    dataset, args, sweep_dir = seen[-1]
    assert (dataset, args.providers, args.n, args.usd) == ("B5", ["a", "b"], 50, 2.0)
    assert args.probes and sweep_dir == tmp_path  # run alone, the sweep probes first
    [probe_spec, sweep_spec] = stage_specs(cfg)
    SweepStage().run(StageContext(stage_config(cfg, sweep_spec.overrides), tmp_path))
    assert not seen[-1][1].probes
    # The probe stage probes the sweep's providers under the sweep's probe budget.
    from kimi_pipe.stages.jobs.probe import probe_settings

    staged = stage_config(
        compose(["pipeline=sweep", "dataset=B5", "sweep.providers=[a,b]", "sweep.probe_usd=0.4"]),
        probe_spec.overrides,
    )
    assert (probe_settings(staged).providers, probe_settings(staged).usd) == (["a", "b"], 0.4)
    missing = compose(["pipeline=sweep", "dataset=B5"])
    with pytest.raises(Exception, match="sweep.providers"):
        SweepStage().run(StageContext(missing, tmp_path))


def test_a_refused_first_stage_leaves_no_run_directory(tmp_path: Path) -> None:
    """A pipeline whose first stage cannot start leaves no empty run directory (nor the
    runner's `.pipeline/`) behind; a directory that existed before stays."""
    run_dir = tmp_path / "new" / "run"
    only_total = (
        f"+pipeline={{name:x,run_dir:'{run_dir}',stages:[{{stage:'pipeline_toy_stages:Total'}}]}}"
    )
    run = run_pipeline(compose([only_total]), say=lambda _: None)
    assert not run.ok and not (tmp_path / "new").exists()
    run_dir.mkdir(parents=True)
    run = run_pipeline(compose([only_total]), say=lambda _: None)
    assert not run.ok and run_dir.is_dir()  # not ours to take away
