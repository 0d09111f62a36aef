"""store/atomic.py: outputs appear whole or not at all and never write through a symlink."""

from __future__ import annotations

import errno
import json
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
    (run / "summary.json.tmp").symlink_to(outside)
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
    assert not (tmp_path / "tokens.tmp").exists()
