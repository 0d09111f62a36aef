"""Issue 20, host and config: a hostile host (full disk, read-only or dangling run
directories, symlinked outputs) and configs that would mix jobs or write a secret. Each ends
with one clear error and exit 2, nothing torn or lost, or runs as one job per directory.
The stage runs as the user runs it (`python -m kimi_pipe generate`, Hydra and all) against
the fake OpenRouter on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.conftest_generate import (
    FAKE_KEY,
    REPO,
    base_overrides,
    generate_cmd,
    prompts_and_run,
    read_jsonl,
    run_inprocess,
    run_subprocess,
    subprocess_env,
    write_prompts,
)
from tests.support.fake_openrouter import Behaviour

pytestmark = [pytest.mark.kimi, pytest.mark.slow]


def _one_error_line(stderr: str, needle: str) -> None:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], stderr


def _assert_whole_lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), f"{path} ends in a torn line"
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def test_disk_full_mid_run_ends_in_one_line_and_nothing_torn_then_resumes(
    tmp_path: Path, fake_openrouter, kimi_dir: Path
) -> None:
    """A file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) fails a write half-way, as a full
    disk does: the partial line is taken back, the error is one line naming the file."""
    srv = fake_openrouter(default=Behaviour(delay_s=0.05))
    out, overrides, ids = prompts_and_run(tmp_path, srv.url(), kimi_dir, n=24)

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))

    proc = subprocess.run(
        generate_cmd(overrides),
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit_file_size,
    )
    assert proc.returncode == 2, proc.stderr
    _one_error_line(proc.stderr, "records.jsonl: file too large")
    first = _assert_whole_lines(out / "records.jsonl")
    assert 0 < len(first) < len(ids)
    _assert_whole_lines(out / "spend_journal.jsonl")
    again = run_subprocess(overrides, timeout=600)
    assert again.returncode == 0, again.stderr
    records = _assert_whole_lines(out / "records.jsonl")
    assert sorted(r["id"] for r in records) == sorted(ids)  # every id once, none lost
    summary = json.loads((out / "summary.json").read_text())
    assert summary["spend_usd"] >= srv.total_cost() - 1e-12


@contextlib.contextmanager
def _read_only_dir(path: Path) -> Iterator[Path]:
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    # root ignores permission bits: a read-only mount is what refuses it.
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"root without mount rights: {mounted.stderr!r}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_a_read_only_run_directory_is_one_line_and_exit_2(
    tmp_path: Path, fake_openrouter, kimi_dir: Path
) -> None:
    srv = fake_openrouter()
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 2)
    with _read_only_dir(tmp_path / "ro") as ro:
        out = ro / "run"
        proc = run_subprocess(base_overrides(prompts, srv.url(), out, kimi_dir), timeout=600)
        assert proc.returncode == 2, proc.stderr
        _one_error_line(proc.stderr, str(out))
    assert srv.requests == []


def test_a_dangling_symlink_as_run_directory_is_refused(
    tmp_path: Path, fake_openrouter, kimi_dir: Path
) -> None:
    srv = fake_openrouter()
    out, overrides, _ = prompts_and_run(tmp_path, srv.url(), kimi_dir)
    out.symlink_to(tmp_path / "nowhere")
    proc = run_subprocess(overrides, timeout=600)
    assert proc.returncode == 2, proc.stderr
    _one_error_line(proc.stderr, "dangling symlink")
    assert srv.requests == [] and not (tmp_path / "nowhere").exists()


def test_a_symlinked_records_file_is_never_written_through_but_a_symlinked_dir_is_fine(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str
) -> None:
    srv = fake_openrouter()
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 2)
    outside = tmp_path / "outside.jsonl"
    outside.write_text("")
    out = tmp_path / "run"
    out.mkdir()
    (out / "records.jsonl").symlink_to(outside)
    status, _ = run_inprocess(base_overrides(prompts, srv.url(), out, kimi_dir), out)
    assert status == 2 and outside.read_text() == "" and srv.requests == []
    # The run directory itself may be a symlink (to a bigger disk).
    real = tmp_path / "disk" / "run"
    real.mkdir(parents=True)
    link = tmp_path / "linked"
    link.symlink_to(real)
    status, summary = run_inprocess(base_overrides(prompts, srv.url(), link, kimi_dir), link)
    assert status == 0 and len(read_jsonl(real / "records.jsonl")) == 2


@pytest.mark.parametrize("bad", ["hydra.run.dir={other}", "hydra.run.dir=/", "output_dir=/"])
def test_a_run_dir_that_disagrees_or_is_a_system_dir_is_refused(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, bad: str
) -> None:
    srv = fake_openrouter()
    out, overrides, _ = prompts_and_run(tmp_path, srv.url(), kimi_dir)
    other = tmp_path / "other"
    proc = run_subprocess([*overrides, bad.format(other=other)], timeout=600)
    assert proc.returncode == 2, proc.stderr
    _one_error_line(proc.stderr, "run")
    assert not out.exists() and not other.exists() and not Path("/.hydra").exists()
    assert srv.requests == []


SECRET = "tok-0123456789abcdefSECRET"


@pytest.mark.parametrize(
    "override",
    [
        "output_dir={tmp}/r-${{oc.env:OPENROUTER_API_KEY}}",
        "+provider.params.user=${{oc.env:OPENROUTER_API_KEY}}",
        "provider.routing.order=[${{oc.env:OPENROUTER_API_KEY}}]",
        "+provider.extra_body.note=${{oc.env:SOME_TOKEN}}",
    ],
)
def test_a_secret_reaching_the_config_through_interpolation_is_refused_before_any_write(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, override: str
) -> None:
    srv = fake_openrouter()
    out, overrides, _ = prompts_and_run(tmp_path, srv.url(), kimi_dir)
    args = [*overrides, override.format(tmp=tmp_path)]
    env = {**subprocess_env(), "SOME_TOKEN": SECRET}
    proc = subprocess.run(
        generate_cmd(args), cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 2, proc.stderr
    _one_error_line(proc.stderr, "holds the value of $")
    assert FAKE_KEY not in proc.stderr + proc.stdout and SECRET not in proc.stderr
    for path in tmp_path.rglob("*"):  # no file and no name holds a secret
        assert FAKE_KEY not in str(path) and SECRET not in str(path)
        if path.is_file() and not path.is_symlink():
            text = path.read_text(errors="replace")
            assert FAKE_KEY not in text and SECRET not in text, path
    assert not out.exists() and srv.requests == []


def test_a_multirun_over_routing_gives_each_job_its_own_run_directory(
    tmp_path: Path, fake_openrouter, kimi_dir: Path
) -> None:
    srv = fake_openrouter()
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 3)
    overrides = [
        o
        for o in base_overrides(prompts, srv.url(), tmp_path / "x", kimi_dir)
        if not o.startswith("output_dir=")
    ]
    proc = run_subprocess(
        [
            "-m",
            *overrides,
            "provider.routing.only=[novita],[moonshotai]",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    runs = sorted((tmp_path / "sweep").rglob("records.jsonl"))
    assert len(runs) == 2
    for path in runs:  # each job bought its own answers, with its own routing
        records = read_jsonl(path)
        assert sorted(r["id"] for r in records) == sorted(ids)
        assert len({json.dumps(r["request"]["extra_body"], sort_keys=True) for r in records}) == 1
    assert len(srv.requests) == 2 * len(ids)
    routed = {json.dumps(r.body["provider"]["only"]) for r in srv.requests}
    assert routed == {'["novita"]', '["moonshotai"]'}


def test_a_resume_with_other_purchase_settings_is_refused_naming_both(
    tmp_path: Path, fake_openrouter, kimi_dir: Path, api_key_env: str, capsys
) -> None:
    srv = fake_openrouter()
    out, base, _ = prompts_and_run(tmp_path, srv.url(), kimi_dir)
    status, _ = run_inprocess([*base, "provider.params.temperature=1.0"], out)
    assert status == 0
    n = len(srv.requests)
    capsys.readouterr()
    status, _ = run_inprocess([*base, "provider.params.temperature=0.5", "budget.usd=20"], out)
    assert status == 2 and len(srv.requests) == n
    err = capsys.readouterr().err
    assert "temperature: recorded 1.0, now 0.5" in err
