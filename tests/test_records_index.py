"""The index of completed ids beside records.jsonl: a resume from it equals a full parse.

Written by IndexedRecordWriter; read with the records past its last line (a writer killed
between a record and its index line), a torn record or index line, bad lines, a file
replaced by a rewrite (target resolution's rename): the resume figures are those of the
full parse in every case, and a stale index is never trusted.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from kimi_pipe.store.records import RecordWriter, parse_resume_index
from kimi_pipe.store.records_index import (
    IndexedRecordWriter,
    index_path,
    load_indexed,
    load_resume_index,
)


def record(i: int, error: bool = False) -> dict[str, Any]:
    rec: dict[str, Any] = {"id": f"s{i:05d}", "cost": 0.001 * (i % 7) + 1e-7, "ok": i % 3 != 0}
    if error:
        rec["error"] = {"class": "RateLimitError"}
    else:
        rec["usage"] = {"completion_tokens": 10 + i % 13, "prompt_tokens": 5}
    return rec


def write(path: Path, recs: list[dict[str, Any]]) -> None:
    with IndexedRecordWriter(path) as w:
        for rec in recs:
            w.append(rec)


def same(path: Path, *spend: Path) -> None:
    fast = load_indexed(path, *spend)
    assert fast is not None, "the index was not trusted"
    assert fast == parse_resume_index(path, *spend)


def test_index_equals_full_parse_with_errors_odd_ids_and_spend_logs(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    recs = [record(i, error=i % 5 == 0) for i in range(200)]
    recs.append({"id": 7, "cost": 0.5})  # not a str id: counted, its id not kept
    for odd in ("a\tb", "-", '"quoted', "back\\slash", "üñí", "line\nbreak"):
        recs.append({"id": odd, "cost": 1e-9})  # ids the index must quote or keep as is
    write(path, recs)
    spend = tmp_path / "attempt_errors.jsonl"
    with RecordWriter(spend) as w:
        w.append({"id": "x", "cost": 0.25, "usage": {"completion_tokens": 3}})
    same(path, spend)
    fast = load_indexed(path)
    assert fast is not None and len(fast.ids) == 206 and fast.records == 207
    assert fast.answered == 207 - 40 and "a\tb" in fast.ids and "-" in fast.ids
    # The resume goes through the index, and the index is small beside the records.
    assert load_resume_index(path) == fast
    assert index_path(path).stat().st_size < path.stat().st_size


def test_records_past_the_index_bad_lines_and_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    write(path, [record(i) for i in range(20)])
    # A writer killed between a record and its index line: records the index does not name.
    with RecordWriter(path) as w:
        w.append(record(20))
        w.append(record(21, error=True))
    with open(path, "ab") as fh:
        fh.write(b"not json\n\n")
        fh.write(b'{"id": "s00022", "co')  # torn: killed mid-line
    same(path)
    fast = load_indexed(path)
    assert fast is not None and fast.torn_tail and fast.bad_lines == 1 and fast.records == 22
    # The next writer cuts the torn line, indexes the records past the index, goes on.
    write(path, [record(23)])
    same(path)
    lines = index_path(path).read_text().splitlines()
    assert len(lines) == 1 + 22 + 1 + 1  # header, 22 records, the bad line, the new record
    assert lines[-1].split("\t")[4] == "s00023"


def test_a_torn_index_line_is_cut_and_the_resume_still_right(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    write(path, [record(i) for i in range(10)])
    with open(index_path(path), "ab") as fh:
        fh.write(b'{"id":"s00010","e":0,"c"')  # the index write of a killed writer
    same(path)  # the torn part is not read; nothing past the last whole line is missing
    write(path, [record(10)])
    same(path)
    assert not index_path(path).read_bytes().endswith(b'"c"')


def test_a_replaced_or_truncated_records_file_is_not_read_through_its_old_index(
    tmp_path: Path,
) -> None:
    path = tmp_path / "records.jsonl"
    write(path, [record(i) for i in range(30)])
    # Target resolution rewrites the file (tmp + rename): same ids, other bytes.
    text = path.read_text().replace('"ok":false', '"ok":true,"resolved":"target"')
    tmp = tmp_path / "records.jsonl.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)
    assert load_indexed(path) is None  # another inode: parse it whole
    assert load_resume_index(path) == parse_resume_index(path)
    write(path, [record(30)])  # the next writer rebuilds the index
    same(path)
    # Cut in place (same inode) below what the index names: not trusted either.
    with open(path, "rb+") as fh:
        fh.truncate(path.stat().st_size // 2)
    assert load_indexed(path) is None
    assert load_resume_index(path) == parse_resume_index(path)


def test_a_run_without_an_index_gets_one_from_its_first_writer(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    with RecordWriter(path) as w:  # written before the index existed
        for i in range(15):
            w.append(record(i))
    assert load_indexed(path) is None
    write(path, [record(15)])
    same(path)
    fast = load_indexed(path)
    assert fast is not None and fast.records == 16


def test_an_index_that_is_a_symbolic_link_is_not_written_through(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me\n")
    index_path(path).symlink_to(target)
    with pytest.raises(OSError) as exc:
        IndexedRecordWriter(path)
    assert exc.value.errno == errno.ELOOP
    assert target.read_text() == "keep me\n"
