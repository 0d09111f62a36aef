"""JSONL run records: append+flush writing, torn-line tolerant reading, resume index.

A record is one JSON object per line. Writers append and flush every line, so a `kill -9`
loses only what had not been written yet; a crash in the middle of a write leaves a torn
last line (no trailing newline), which readers skip and `RecordWriter` cuts off (keeping
the bytes in `<file>.torn`) before it appends again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class ReadStats:
    records: int = 0
    torn_tail: bool = False  # the last line had no newline and was ignored
    bad_lines: list[int] = field(default_factory=list)  # complete lines that are not JSON objects


def iter_records(path: str | Path, stats: ReadStats | None = None) -> Iterator[dict[str, Any]]:
    """Yield every complete record of `path`; a torn last line and bad lines are skipped
    (and counted in `stats`). A missing file yields nothing."""
    stats = stats if stats is not None else ReadStats()
    p = Path(path)
    if not p.exists():
        return
    with p.open("rb") as fh:
        for line_no, raw in enumerate(fh, 1):
            if not raw.endswith(b"\n") and _json_object(raw) is None:
                # Written without its newline: the process died mid-write.
                stats.torn_tail = True
                log.warning("%s: torn last line %d ignored (%d bytes)", p, line_no, len(raw))
                break
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                stats.bad_lines.append(line_no)
                log.warning("%s: line %d is not a JSON object; skipped", p, line_no)
                continue
            stats.records += 1
            yield obj


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def read_records(path: str | Path) -> list[dict[str, Any]]:
    return list(iter_records(path))


def cut_torn_tail(path: str | Path) -> int:
    """Remove a torn last line so appends start on a fresh line; returns bytes removed.
    The removed bytes are appended to `<path>.torn` so nothing is silently destroyed."""
    p = Path(path)
    if not p.exists() or p.stat().st_size == 0:
        return 0
    with p.open("rb+") as fh:
        size = fh.seek(0, os.SEEK_END)
        block = 1 << 16
        pos = size
        # Find the last newline scanning backwards.
        while pos > 0:
            start = max(0, pos - block)
            fh.seek(start)
            chunk = fh.read(pos - start)
            idx = chunk.rfind(b"\n")
            if idx >= 0:
                keep = start + idx + 1
                break
            pos = start
        else:
            keep = 0
        if keep == size:
            return 0
        fh.seek(keep)
        torn = fh.read()
        if _json_object(torn) is not None:
            # A whole record that only lacks its newline (a hand edit): keep it.
            fh.write(b"\n")
            return 0
        with p.with_name(p.name + ".torn").open("ab") as out:
            out.write(torn + b"\n")
        fh.truncate(keep)
    log.warning("%s: cut a torn last line of %d bytes (kept in %s.torn)", p, size - keep, p.name)
    return size - keep


def open_append_fd(path: str | Path) -> int:
    """An append-only descriptor that never follows a symlink at `path` (ELOOP)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags, 0o644)


def append_whole(fd: int, data: bytes, path: str | Path | None = None) -> None:
    """Append `data` (one or more whole lines) or nothing: a write the disk cut short (full,
    over quota) is truncated back off before the error is raised (naming `path`), so no
    torn line is left."""
    start = os.fstat(fd).st_size
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        with contextlib.suppress(OSError):  # else the next open cuts the torn tail
            os.ftruncate(fd, start)
        if exc.filename is None and path is not None:
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise


class RecordWriter:
    """Append-only JSONL writer: one line per record, flushed at once, fsynced at most
    every `fsync_every_s` seconds (the page cache survives a killed process; fsync
    guards against losing the machine)."""

    def __init__(self, path: str | Path, fsync_every_s: float = 1.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cut_torn_tail(self.path)
        self._fd = open_append_fd(self.path)
        self._fsync_every_s = fsync_every_s
        self._last_sync = time.monotonic()

    def append(self, record: Mapping[str, Any]) -> None:
        # One write call per line: the line is either whole in the file or torn at the end.
        text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        try:
            data = text.encode() + b"\n"
        except UnicodeEncodeError:  # a lone surrogate the caller did not repair: never lose
            data = text.encode("utf-8", "replace") + b"\n"  # the line for one character
        append_whole(self._fd, data, self.path)
        now = time.monotonic()
        if now - self._last_sync >= self._fsync_every_s:
            os.fsync(self._fd)
            self._last_sync = now

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.fsync(fd)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, str(self.path)) from None
            finally:
                os.close(fd)

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class ResumeIndex:
    """What earlier runs into the same directory already did."""

    ids: set[str] = field(default_factory=set)
    answered: int = 0  # records without an error (they count against budget.max_samples)
    cost: float = 0.0  # USD already spent (records plus given-up attempts)
    output_tokens: int = 0  # billed completion tokens already bought
    records: int = 0
    torn_tail: bool = False
    bad_lines: int = 0


def record_cost(record: dict[str, Any]) -> float:
    value = record.get("cost")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if math.isfinite(value) and value > 0 else 0.0


def record_output_tokens(record: dict[str, Any]) -> int:
    usage = record.get("usage")
    value = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return int(value) if isinstance(value, int) else 0


def parse_resume_index(records_path: str | Path, *spend_logs: str | Path) -> ResumeIndex:
    """`load_resume_index` by parsing every record (no index of ids, or a stale one)."""
    index = ResumeIndex()
    stats = ReadStats()
    for rec in iter_records(records_path, stats):
        rid = rec.get("id")
        if isinstance(rid, str):
            index.ids.add(rid)
        index.answered += rec.get("error") is None
        index.cost += record_cost(rec)
        index.output_tokens += record_output_tokens(rec)
    index.records = stats.records
    index.torn_tail = stats.torn_tail
    index.bad_lines = len(stats.bad_lines)
    for extra in spend_logs:
        for rec in iter_records(extra):
            index.cost += record_cost(rec)
            index.output_tokens += record_output_tokens(rec)
    return index
