"""Every stage answers a user's mistake with one line naming it and exit 2, never a traceback
(issue 18). Each case runs the real command line in a subprocess, as a user would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cases import load_or_skip

REPO = Path(__file__).resolve().parent.parent
# A model config whose <|im_end|> is 163533 (`chas`), in a config dir of the user's own.
WRONG_END = ["model=kimi_wrong_end", "hydra.searchpath=[file://{conf}]"]
FAKE_KEY = "sk" + "-test-not-a-real-key"


def wrong_end_model(tmp: Path) -> Path:
    conf = tmp / "conf"
    (conf / "model").mkdir(parents=True)
    text = (REPO / "conf" / "model" / "kimi_k25.yaml").read_text(encoding="utf-8")
    assert '"<|im_end|>": 163586' in text
    (conf / "model" / "kimi_wrong_end.yaml").write_text(
        text.replace('"<|im_end|>": 163586', '"<|im_end|>": 163533'), encoding="utf-8"
    )
    return conf


def run_stage(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    env["OPENROUTER_API_KEY"] = FAKE_KEY  # a key that works nowhere: no stage gets that far
    return subprocess.run(
        [sys.executable, "-m", "kimi_pipe", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def records_file(tmp: Path) -> Path:
    path = tmp / "records.jsonl"
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    return path


def broken_files(tmp: Path, conf: Path) -> dict[str, Path]:
    """An empty file, and a YAML file that is not YAML (as a model config and a battery)."""
    (tmp / "empty.jsonl").write_text("")
    (conf / "model" / "not_yaml.yaml").write_text("tokenizer: [unclosed\n")
    (tmp / "not_yaml.yaml").write_text("quirks: [unclosed\n")
    return {"empty": tmp / "empty.jsonl", "not_yaml": tmp / "not_yaml.yaml"}


CASES: list[tuple[str, list[str], str]] = [
    ("export: missing store", ["export", "stores=[/missing/store]", "output=out"],
     "/missing/store"),
    ("export: unknown format", ["export", "format=nosuch", "stores=[/missing]", "output=o"],
     "nosuch"),
    ("export: no store", ["export", "output=out"], "store"),
    ("extract: missing run dir", ["extract", "extract.run_dir=/missing/run",
                                  "extract.model_path=/missing/model"], "/missing"),
    ("audit: wrong special id", ["audit", *WRONG_END, "audit.records={records}"], "163533"),
    ("reconstruct: wrong special id", ["reconstruct", *WRONG_END, "input={records}",
                                       "output=out.jsonl"], "163533"),
    ("generate: wrong special id", ["generate", *WRONG_END, "dataset.path={records}",
                                    "output_dir=run", "provider.api_base=http://127.0.0.1:9/v1"],
     "163533"),
    ("generate: local provider, remote model", ["generate", "provider=local",
                                                "dataset.path={records}", "output_dir=run"],
     "local_model"),
    ("generate: unknown dataset", ["generate", "dataset=nosuch"], "nosuch"),
    ("generate: unknown key", ["generate", "colour=red"], "colour"),
    ("sweep: no providers", ["sweep", "sweep.providers=[]"], "providers"),
    ("sweep: no providers (old form)", ["sweep", "providers="], "providers"),
    ("sweep: no providers at all", ["sweep", "dataset=B5"], "sweep.providers"),
    ("sweep: unknown dataset", ["sweep", "dataset=nosuch", "sweep.providers=[a]", "sweep.n=1",
                                "sweep.usd=1"], "nosuch"),
    ("sweep: unknown dataset (old form)", ["sweep", "dataset=nosuch", "providers=a", "n=1",
                                           "usd=1"], "nosuch"),
    ("sweep: n not a number", ["sweep", "sweep.providers=[a]", "sweep.n=many"], "sweep.n"),
    ("sweep: unknown sweep key", ["sweep", "sweep.providers=[a]", "sweep.colour=red"],
     "colour"),
    ("sweep: wrong special id", ["sweep", *WRONG_END, "sweep.providers=[a]",
                                 "dataset.path={records}", "sweep.sweep_dir=sw"], "163533"),
    ("probe: no providers", ["probe"], "providers"),
    ("probe: missing battery", ["probe", "probe.providers=[a]", "probe.battery=/missing.yaml"],
     "/missing.yaml"),
    ("probe: usd not a number", ["probe", "probe.providers=[a]", "probe.usd=lots"], "probe.usd"),
    ("probe: wrong special id", ["probe", *WRONG_END, "probe.providers=[a]",
                                 "probe.output_dir=pr"], "163533"),
    ("run: unknown pipeline", ["run", "pipeline=nosuch"], "nosuch"),
    ("run: no pipeline", ["run"], "pipeline"),
    ("reconstruct: missing input", ["reconstruct", "input=/missing/in.jsonl",
                                    "output=out.jsonl"], "/missing/in.jsonl"),
    ("report: missing dir", ["report", "report.sweep_dir=/missing/sweep"], "/missing/sweep"),
    ("report: missing dir (old form)", ["report", "sweep_dir=/missing/sweep"], "sweep_dir"),
    ("report: unknown argument", ["report", "report.sweep_dir=.", "colour=red"], "colour"),
    ("report: no dir", ["report"], "report.sweep_dir"),
    ("report: dir without runs", ["report", "report.sweep_dir=conf"], "records.jsonl"),
    ("report: rate not a number", ["report", "report.sweep_dir=.", "report.min_ok_rate=high"],
     "report.min_ok_rate"),
    ("unknown stage", ["nosuch"], "nosuch"),
    # More than the issue named: bad kinds of values, files that are empty, directories,
    # config files that are not YAML, group options that do not exist (issue 18, reviewers).
    ("generate: missing prompt file", ["generate", "dataset.path=/missing.jsonl",
                                       "output_dir=run"], "/missing.jsonl"),
    ("generate: empty prompt file", ["generate", "dataset.path={empty}", "output_dir=run"],
     "empty"),
    ("generate: prompt file is a directory", ["generate", "dataset.path={conf}",
                                              "output_dir=run"], "is a directory"),
    ("generate: usd not a number", ["generate", "budget.usd=lots", "dataset.path={records}",
                                    "output_dir=run"], "budget.usd"),
    ("generate: limit not a number", ["generate", "dataset.limit=some", "serving=unknown",
                                      "dataset.path={records}", "output_dir=run"],
     "dataset.limit"),
    ("generate: model config not YAML", ["generate", "model=not_yaml",
                                         "hydra.searchpath=[file://{conf}]",
                                         "dataset.path={records}"], "not_yaml.yaml"),
    ("generate: unknown serving option", ["generate", "serving=nosuch"], "nosuch"),
    ("reconstruct: empty input", ["reconstruct", "input={empty}", "output=out.jsonl"], "empty"),
    ("reconstruct: input is a directory", ["reconstruct", "input={conf}", "output=out.jsonl"],
     "is a directory"),
    ("reconstruct: tolerance not a number", ["reconstruct", "input={records}", "output=o.jsonl",
                                             "validation.billing_tolerance=some"],
     "validation.billing_tolerance"),
    ("audit: limit not a number", ["audit", "audit.records={records}", "audit.limit=some"],
     "audit.limit"),
    ("audit: unknown audit key", ["audit", "audit.records={records}", "+audit.colour=red"],
     "colour"),
    ("extract: unknown engine option", ["extract", "extract=nosuch"], "nosuch"),
    ("export: seed not a number", ["export", "seed=some", "stores=[/missing]", "output=o"],
     "seed"),
    ("export: max_length not a number", ["export", "max_length=some", "stores=[/missing]",
                                         "output=o"], "max_length"),
    ("export: unknown format option", ["export", "export=nosuch"], "nosuch"),
    ("sweep: missing prompt file", ["sweep", "sweep.providers=[a]", "sweep.probes=false",
                                    "dataset.path=/missing.jsonl", "sweep.sweep_dir=sw"],
     "/missing.jsonl"),
    ("sweep: probes not a bool", ["sweep", "sweep.providers=[a]", "sweep.probes=maybe"],
     "sweep.probes"),
    ("probe: battery not YAML", ["probe", "probe.providers=[a]", "probe.battery={not_yaml}"],
     "not_yaml.yaml"),
    ("run: wrong special id", ["run", "pipeline=openrouter_sglang", *WRONG_END, "dataset=jsonl",
                               "dataset.path={records}", "output_dir=run",
                               "provider.api_base=http://127.0.0.1:9/v1"], "163533"),
    ("run: missing prompt file", ["run", "pipeline=openrouter_sglang", "dataset=jsonl",
                                  "dataset.path=/missing.jsonl", "output_dir=run"],
     "/missing.jsonl"),
    ("run: sweep without providers", ["run", "pipeline=sweep", "dataset=B5"], "providers"),
    ("demo: unknown model option", ["demo", "model=nosuch"], "nosuch"),
    # A flag a composed-only command does not take is named (was Hydra's lexer error).
    ("report: a flag it does not take", ["report", "--foo"], "--foo: not a flag"),
    ("audit: no multirun", ["audit", "-m", "audit.limit=1,2"], "-m: not a flag"),
    ("demo: not a local provider", ["demo", "provider=openrouter"], "local"),
    # Issue 30: values of the right kind that cannot buy anything. They used to run: a
    # negative or zero budget stopped at once and exited 0, concurrency 0 became 1 (and an
    # unreachable provider was retried until killed).
    ("generate: negative budget", ["generate", "budget.usd=-1", "dataset.path={records}",
                                   "output_dir=run", "provider.api_base=http://127.0.0.1:9/v1",
                                   "serving=unknown"], "budget.usd=-1"),
    ("generate: zero budget", ["generate", "budget.usd=0", "dataset.path={records}",
                               "output_dir=run", "provider.api_base=http://127.0.0.1:9/v1",
                               "serving=unknown"], "budget.usd=0"),
    ("generate: zero budget, serving=auto", ["generate", "budget.usd=0",
                                             "dataset.path={records}", "output_dir=run",
                                             "provider.api_base=http://127.0.0.1:9/v1"],
     "budget.usd=0"),
    ("generate: concurrency 0", ["generate", "provider.concurrency=0", "dataset.path={records}",
                                 "output_dir=run", "provider.api_base=http://127.0.0.1:9/v1",
                                 "serving=unknown"], "provider.concurrency=0"),
    ("generate: negative concurrency", ["generate", "provider.concurrency=-4",
                                        "dataset.path={records}", "output_dir=run"],
     "provider.concurrency=-4"),
    ("generate: zero timeout", ["generate", "provider.timeout_s=0", "dataset.path={records}",
                                "output_dir=run"], "provider.timeout_s=0"),
    ("generate: reserve factor below 1", ["generate", "budget.reserve_factor=0.5",
                                          "dataset.path={records}", "output_dir=run"],
     "budget.reserve_factor=0.5"),
    ("generate: zero max_samples", ["generate", "budget.max_samples=0",
                                    "dataset.path={records}", "output_dir=run"],
     "budget.max_samples=0"),
    ("generate: zero key poll", ["generate", "budget.key_poll_s=0", "dataset.path={records}",
                                 "output_dir=run"], "budget.key_poll_s=0"),
    ("run: negative budget", ["run", "pipeline=openrouter_sglang", "dataset=jsonl",
                              "dataset.path={records}", "output_dir=run", "budget.usd=-1"],
     "budget.usd=-1"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "named"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_and_exit_2(args: list[str], named: str, tmp_path: Path) -> None:
    if WRONG_END[0] in args:  # the wrong id is found only by loading the Kimi tokenizer
        load_or_skip("kimi_k25")
    records, conf = records_file(tmp_path), wrong_end_model(tmp_path)
    paths = {"records": records, "conf": conf, **broken_files(tmp_path, conf)}
    for name, path in paths.items():
        args = [a.replace("{" + name + "}", str(path)) for a in args]
    done = run_stage(args, tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr and "HYDRA_FULL_ERROR" not in done.stderr
    assert "--- Logging error ---" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-2000:]
    assert named in errors[0], errors[0]


# Every command, not only generate: a key typed as an override is refused in one line before
# anything is composed or written (the cwd stays empty), and the key is never echoed.
KEY_STAGES = ["generate", "extract", "export", "reconstruct", "audit", "probe", "sweep",
              "report", "run", "demo"]  # fmt: skip


@pytest.mark.parametrize("stage", KEY_STAGES)
def test_a_key_on_the_command_line_is_refused_by_every_stage(stage: str, tmp_path: Path) -> None:
    key = "sk" + "-or-v1-TYPED-ON-THE-COMMAND-LINE-0123"
    done = run_stage([stage, f"+provider.api_key={key}", "output_dir=run"], tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "provider.api_key must not be in the config" in lines[0], lines
    assert key not in done.stdout + done.stderr
    assert not list(tmp_path.iterdir())  # nothing written: no run directory, no log


def test_a_bug_keeps_its_traceback() -> None:
    """Only user-facing failures are shortened: anything else is a bug and says where."""
    from kimi_pipe.stages.command import compose_command

    def broken(cfg: object) -> int:
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError):
        compose_command(broken, [])


@pytest.mark.parametrize("stage", ["reconstruct", "audit", "probe", "sweep", "report"])
def test_help_is_the_stage_usage(stage: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--help` of a composed stage prints its usage and runs nothing (exit 0)."""
    import importlib

    module = importlib.import_module(f"kimi_pipe.stages.{stage}")
    assert module.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert f"python -m kimi_pipe {stage}" in out  # was the alias spelling `kimi_pipe.{stage}`


# ---------------------------------------------------------------------------------------
# A full disk (issue 30): whatever write fails first (Hydra's saved config, the log, the
# lock, the journal, the records, the summary), the run ends in one line naming the path,
# exit 2: never Hydra's traceback, nor the logging module's "--- Logging error ---".


def _mount_tmpfs(where: Path, kib: int) -> bool:
    """A `kib` KiB tmpfs on `where` (root can mount one); False where the host refuses."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)],
            capture_output=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _one_line_full(done: subprocess.CompletedProcess[str], under: Path) -> str:
    """The one line a run on a full disk ends in: exit 2, nothing else on stderr."""
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr and "--- Logging error ---" not in done.stderr
    assert "--- Logging error ---" not in done.stdout
    assert "Unclosed" not in done.stdout + done.stderr  # asyncio's "Unclosed client session"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith(f"error: {under}") and "no space left on device" in lines[0], lines
    return lines[0]


def _generate_into(out: Path, tmp: Path, url: str, kimi_dir: Path) -> list[str]:
    from tests.support.conftest_generate import base_overrides, write_prompts

    prompts = tmp / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts, 2)
    return base_overrides(prompts, url, out, kimi_dir)


# Free space (KiB) left on a 64 KiB tmpfs: the first write to fail was, on this machine,
# Hydra's saved config (0-12), the lock (16), the journal (20-24), the records (28-32),
# summary.json (36); the run fits from about 40 on.
FREE_KIB = (0, 8, 16, 24, 28, 36)


@pytest.mark.kimi
@pytest.mark.slow
def test_a_full_disk_is_one_line_whatever_write_fails_first(
    tmp_path: Path, fake_openrouter, kimi_dir: Path
) -> None:
    from tests.support.conftest_generate import run_subprocess

    srv = fake_openrouter()
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, 64):
        # No mount here: the kernel's /dev/full, where Hydra saves the run's config, refuses
        # every write with ENOSPC as a full disk does.
        out = tmp_path / "run"
        (out / ".hydra" / "generate").mkdir(parents=True)
        (out / ".hydra" / "generate" / "config.yaml").symlink_to("/dev/full")
        _one_line_full(run_subprocess(_generate_into(out, tmp_path, srv.url(), kimi_dir)), out)
        return
    failed: list[str] = []
    try:
        for free in FREE_KIB:
            for path in disk.iterdir():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            (disk / "fill").write_bytes(b"\0" * (64 - free) * 1024)
            out = disk / "run"
            done = run_subprocess(_generate_into(out, tmp_path, srv.url(), kimi_dir))
            if done.returncode == 0 and (out / "summary.json").exists():
                continue  # it fitted (longer paths elsewhere move where it stops fitting)
            failed.append(_one_line_full(done, out))
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, check=False)
    assert len(failed) >= len(FREE_KIB) - 1, failed
    assert any(line.startswith(f"error: {out}/") for line in failed), failed  # a file named


@pytest.mark.kimi
@pytest.mark.slow
def test_a_log_that_cannot_be_written_is_one_line(
    tmp_path: Path, fake_openrouter, kimi_dir: Path
) -> None:
    """The run's log (Hydra's generate.log) on a device that is full: the logging module's
    own traceback used to come first. The run buys and writes its records; it ends in one
    line naming the log, exit 2."""
    from tests.support.conftest_generate import run_subprocess

    srv = fake_openrouter()
    out = tmp_path / "run"
    out.mkdir()
    (out / "generate.log").symlink_to("/dev/full")  # every write: ENOSPC, from the kernel
    done = run_subprocess(_generate_into(out, tmp_path, srv.url(), kimi_dir))
    line = _one_line_full(done, out / "generate.log")
    assert "log is incomplete" in line
    assert json.loads((out / "summary.json").read_text())["counts"]["answered"] == 2


def test_python_without_the_dependencies_is_told_to_use_the_venv() -> None:
    """`python -m kimi_pipe` from a Python that lacks the dependencies (README's friction:
    the system python3, not .venv's) is one line naming the missing package and the venv's
    command, exit 2, no traceback. `-S` leaves site-packages out: only the stdlib is there."""
    done = subprocess.run(
        [sys.executable, "-S", "-m", "kimi_pipe", "generate", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not installed in this Python" in lines[0]
    assert ".venv/bin/python -m kimi_pipe" in lines[0] and "make setup" in lines[0]
