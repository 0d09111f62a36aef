"""store/atomic.py: outputs appear whole or not at all and never write through a symlink."""

from __future__ import annotations

import errno
import json
import multiprocessing
from pathlib import Path

import pytest

from kimi_pipe.store import atomic


def test_write_json_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "summary.json"
    target.write_text("old\n")
    atomic.write_json(target, {"a": 1}, indent=2)
    assert json.loads(target.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_failed_writer_keeps_the_old_file_and_removes_the_temporary(tmp_path: Path) -> None:
    target = tmp_path / "shard.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic.atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("disk full")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.bin"]


def test_a_symlink_planted_at_the_temporary_name_is_never_written_through(
    tmp_path: Path,
) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    atomic.temporary_name(run / "summary.json").symlink_to(outside)
    with pytest.raises(OSError) as info:
        atomic.write_text(run / "summary.json", "{}\n")
    assert info.value.errno == errno.ELOOP
    assert outside.read_text() == "precious\n"


def test_open_append_refuses_a_symlinked_output(tmp_path: Path) -> None:
    outside = tmp_path / "outside.jsonl"
    outside.write_text("")
    link = tmp_path / "records.jsonl"
    link.symlink_to(outside)
    with pytest.raises(OSError) as info:
        atomic.open_append(link)
    assert info.value.errno == errno.ELOOP
    assert outside.read_text() == ""


def test_a_directory_is_renamed_over_its_target(tmp_path: Path) -> None:
    target = tmp_path / "tokens"
    with atomic.atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "data.arrow").write_bytes(b"x")
    assert (target / "data.arrow").read_bytes() == b"x"
    assert not tmp.exists()


def _write_often(target: str, tag: str, times: int) -> None:
    for i in range(times):
        atomic.write_json(target, {"writer": tag, "i": i}, durable=False)


def test_two_processes_writing_one_target_never_break_each_other(tmp_path: Path) -> None:
    """The workers of a job array each write the run's summary: with one shared temporary
    name, one renamed the other's file away and the other's rename failed (ENOENT)."""
    target = tmp_path / "extract_summary.json"
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_write_often, args=(str(target), tag, 400)) for tag in ("a", "b")]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=120)
    assert [w.exitcode for w in writers] == [0, 0]
    assert json.loads(target.read_text())["i"] == 399
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extract_summary.json"]
