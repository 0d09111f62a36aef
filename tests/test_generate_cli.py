"""`python -m kimi_pipe generate` as a real process: kill -9 and resume, multirun, secrets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.conftest_generate import (
    FAKE_KEY,
    REPO,
    base_overrides,
    generate_cmd,
    read_jsonl,
    run_subprocess,
    subprocess_env,
    write_prompts,
)
from tests.support.fake_openrouter import Behaviour

pytestmark = [pytest.mark.kimi, pytest.mark.slow]


def _count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_kill_9_mid_run_then_resume_keeps_every_id_once_and_the_spend(
    tmp_path: Path, fake_openrouter, kimi_dir: Path
) -> None:
    # Slow answers, and some billed failures (empty answers) so failed attempts cost money.
    script = {"Question s3:": ["empty", "500"], "Question s40:": ["empty"]}
    srv = fake_openrouter(default=Behaviour(delay_s=0.3, script=script))
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 60, tools_every=9)
    out = tmp_path / "run"
    overrides = base_overrides(prompts, srv.url(), out, kimi_dir, concurrency=8)
    records = out / "records.jsonl"
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen(
        generate_cmd(overrides),
        cwd=REPO,
        env=subprocess_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 240
        while _count_lines(records) < 12:
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "generate wrote too few records"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL
    first = read_jsonl(records)
    assert 12 <= len(first) < len(ids)
    # Simulate dying in the middle of a write as well: a torn last line.
    with records.open("ab") as fh:
        fh.write(b'{"id": "s59", "ok": tr')
    billed_before_resume = srv.total_cost()

    done = run_subprocess(overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    final = read_jsonl(records)  # also proves every line is whole JSON again
    final_ids = [r["id"] for r in final]
    assert sorted(final_ids) == sorted(ids)
    assert len(final_ids) == len(set(final_ids))
    assert (out / "records.jsonl.torn").read_bytes().startswith(b'{"id": "s59", "ok": tr')
    # Nothing answered before the kill was bought again.
    for rec in first:
        answers = [
            b
            for b in srv.bills
            if b.marker.startswith(f"Question {rec['id']}:") and b.completion_tokens
        ]
        assert len(answers) == 1, rec["id"]
    summary = json.loads((out / "summary.json").read_text())
    stored = sum(r["cost"] for r in final) + sum(
        r["cost"] for r in read_jsonl(out / "attempt_errors.jsonl")
    )
    assert summary["counts"]["answered"] == len(ids)
    # The requests in flight at the kill were billed and never answered to us: the spend
    # journal booked them on resume at their worst case, so the spend is never below what
    # the server billed (before the journal: the stored costs alone, up to 8 answers less).
    assert summary["journal"]["recovered_requests"] >= 1
    assert summary["spend_usd"] == pytest.approx(summary["spend_usd_journal"], rel=1e-9)
    assert summary["spend_usd"] >= srv.total_cost() - 1e-12
    assert summary["spend_usd"] >= stored - 1e-12
    assert srv.total_cost() > billed_before_resume


def _provider_file(conf: Path, name: str, url: str) -> None:
    (conf / "provider").mkdir(parents=True, exist_ok=True)
    (conf / "provider" / f"{name}.yaml").write_text(
        f"defaults:\n  - openrouter\n  - _self_\nname: {name}\napi_base: {url}\n"
    )


def test_multirun_providers_get_their_own_dirs_and_the_key_is_never_written(
    tmp_path: Path, fake_openrouter, kimi_dir: Path
) -> None:
    srv = fake_openrouter(
        behaviours={
            "a": Behaviour(
                provider_name="Vendor-A", script={"Question s1:": ["429", "400"]}, retry_after="0"
            ),
            "b": Behaviour(
                provider_name="Vendor-B",
                reasoning_field="reasoning_content",
                tool_call_ids="call",
                script={"Question s2:": ["500"]},
            ),
        }
    )
    conf = tmp_path / "conf"
    _provider_file(conf, "a", srv.url("a"))
    _provider_file(conf, "b", srv.url("b"))
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 5, tools_every=2)
    sweep = tmp_path / "sweep"
    overrides = [
        o
        for o in base_overrides(prompts, "unused", tmp_path / "unused", kimi_dir)
        if not o.startswith(("provider=", "provider.api_base=", "output_dir="))
    ]
    overrides = [
        "-m",
        "provider=a,b",
        f"hydra.searchpath=[file://{conf}]",
        f"hydra.sweep.dir={sweep}",
        *overrides,
    ]
    done = run_subprocess(overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, vendor in (("a", "Vendor-A"), ("b", "Vendor-B")):
        # Each job's directory: <provider>-<digest of what it buys> (issue 20).
        (run,) = sweep.glob(f"{name}-*")
        records = read_jsonl(run / "records.jsonl")
        assert sorted(r["id"] for r in records) == sorted(ids)
        answered = [r for r in records if r["error"] is None]
        assert {r["provider"] for r in answered} == {vendor}
        assert (run / "summary.json").exists() and list((run / ".hydra").rglob("config.yaml"))
        assert all(r["request"]["api_base"] == srv.url(name) for r in records)
    assert {r.behaviour for r in srv.requests} == {"a", "b"}
    # The key was really used...
    assert all(r.headers.get("authorization") == f"Bearer {FAKE_KEY}" for r in srv.requests)
    # ...and appears in nothing the run wrote, nor in its console output.
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(".hydra" in p.parts for p in written)
    assert any(p.name == "generate.log" for p in written)
    for path in written:
        assert FAKE_KEY.encode() not in path.read_bytes(), path
    assert FAKE_KEY not in done.stdout + done.stderr


def test_a_key_in_the_config_is_refused(tmp_path: Path, kimi_dir: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 1)
    out = tmp_path / "run"
    overrides = base_overrides(prompts, "http://127.0.0.1:9/api/v1", out, kimi_dir)
    done = run_subprocess([*overrides, ("+provider.api_key=sk" + "-or-v1-INCONFIG")], key=None)
    assert done.returncode == 2
    assert "must not be in the config" in done.stderr
    assert not out.exists()  # refused before Hydra saved anything


def test_a_key_given_as_api_key_env_is_refused_before_anything_is_saved(tmp_path: Path) -> None:
    out = tmp_path / "run"
    key = "sk" + "-or-v1-GIVEN-AS-AN-OVERRIDE-0123456789"
    done = run_subprocess(
        [f"provider.api_key_env={key}", f"output_dir={out}"], key=None, timeout=120
    )
    assert done.returncode == 2
    assert "must name an environment variable" in done.stderr
    assert key not in done.stderr and key not in done.stdout
    assert not out.exists()
