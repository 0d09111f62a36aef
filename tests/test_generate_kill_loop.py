"""Kill loop: `generate` killed with SIGKILL at random points, many times, against a slow
server that logs every answer it bills, then resumed. The money and the files hold:
every id once, what the server billed <= budget.usd, the client's spend >= what the
server billed (issue 10, F1)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.conftest_generate import (
    FAKE_KEY,
    REPO,
    base_overrides,
    read_jsonl,
    write_prompts,
)
from tests.support.fake_openrouter import Behaviour

pytestmark = [pytest.mark.kimi, pytest.mark.slow]

KILLS = 10


class ForkServer:
    def __init__(self) -> None:
        env = {
            **os.environ,
            "OPENROUTER_API_KEY": FAKE_KEY,
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "generate_forkserver.py")],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._read() == "ready"

    def _read(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def _send(self, line: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._read()

    def start(self, overrides: list[str], out: Path, log: Path) -> int:
        job = {"overrides": overrides, "out": str(out), "log": str(log)}
        return int(self._send("run " + json.dumps(job)).split()[1])

    def wait(self, pid: int) -> int:
        return int(self._send(f"wait {pid}").split()[1])

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_kill_9_loop_keeps_every_id_once_and_the_spend_above_the_bill(
    tmp_path: Path, fake_openrouter, kimi_dir: Path
) -> None:
    srv = fake_openrouter(default=Behaviour(delay_s=0.4))
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 400, tools_every=11)
    out = tmp_path / "run"
    log = tmp_path / "children.log"
    cap = 0.08  # binds during the kills: every kill leaves up to 32 requests billed unseen
    overrides = base_overrides(prompts, srv.url(), out, kimi_dir, usd=cap, concurrency=32)
    overrides += ["provider.params.max_tokens=64"]
    rng = random.Random(10)
    server = ForkServer()
    try:
        kills = 0
        while kills < KILLS:
            before = len(srv.requests)
            pid = server.start(overrides, out, log)
            # A random point once requests are going out (start-up takes a second or two).
            deadline = time.monotonic() + 30
            while len(srv.requests) <= before:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.9))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            status = server.wait(pid)
            if status == -signal.SIGKILL:
                kills += 1
            else:  # it finished first (the cap reached): nothing more to kill
                assert status == 0, log.read_text()[-3000:]
                break
        # Settle what the last kill left in flight, then check the cap held.
        time.sleep(0.5)
        billed_capped = srv.total_cost()
        assert billed_capped <= cap
        # Resume with a budget that covers the rest: every id is answered, once.
        final = [o for o in overrides if not o.startswith("budget.usd=")] + ["budget.usd=1.0"]
        pid = server.start(final, out, log)
        assert server.wait(pid) == 0, log.read_text()[-3000:]
    finally:
        server.close()
    assert kills >= KILLS
    records = read_jsonl(out / "records.jsonl")
    got = [r["id"] for r in records]
    assert len(got) == len(set(got)), "an id was written twice"
    assert sorted(got) == sorted(ids), "an id is missing"
    assert all(r["error"] is None for r in records)
    summary = json.loads((out / "summary.json").read_text())
    time.sleep(0.5)
    print(
        f"kills {kills}, requests {len(srv.requests)}, billed ${srv.total_cost():.5f} "
        f"(${billed_capped:.5f} under the cap ${cap}), spend ${summary['spend_usd']:.5f}"
    )
    assert summary["spend_usd"] >= srv.total_cost() - 1e-12
    journal = read_jsonl(out / "spend_journal.jsonl")
    recovered = [j for j in journal if str(j.get("how", "")).startswith("recovered")]
    print(f"recovered {len(recovered)} requests")
    # The kills really hit requests in flight, and the journal booked them.
    assert len(recovered) >= KILLS
    # No torn or broken line anywhere.
    for name in ("records.jsonl", "attempt_errors.jsonl", "spend_journal.jsonl"):
        path = out / name
        if path.exists():
            assert path.read_bytes().endswith(b"\n") or path.stat().st_size == 0
