"""Every stage answers a user's mistake with one line naming it and exit 2, never a traceback
(issue 18). Each case runs the real command line in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
]  # fmt: skip


@pytest.mark.parametrize(("args", "named"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_and_exit_2(args: list[str], named: str, tmp_path: Path) -> None:
    records, conf = records_file(tmp_path), wrong_end_model(tmp_path)
    args = [a.replace("{records}", str(records)).replace("{conf}", str(conf)) for a in args]
    done = run_stage(args, tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr and "HYDRA_FULL_ERROR" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-2000:]
    assert named in errors[0], errors[0]


def test_a_bug_keeps_its_traceback() -> None:
    """Only user-facing failures are shortened: anything else is a bug and says where."""
    from kimi_pipe.stages.command import compose_command

    def broken(cfg: object) -> int:
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError):
        compose_command(broken, [])
