"""An index of completed ids beside `records.jsonl`: a resume reads it, not the records.

`records.jsonl.ids` holds one short line per record (id, error or not, cost, output
tokens, the byte offset where the record ends, and its digest: the few fields generate's
summary counts, as JSON), written by `IndexedRecordWriter` right after the record itself.
A resume (`load_indexed`) reads these lines and parses only the records past the last
offset they name (those appended after it: a writer killed between the record and its
index line). At 100x the seeds a records file is about 12 GB and its
index about 3 % of that.

The index is trusted only while it describes the file it was written for: its first line
names the records file's device and inode (a rewrite by rename, as target resolution does,
makes a new inode), every offset must lie inside the file and the last one must end a line.
Otherwise `load_indexed` returns None (the caller parses the whole file) and the next
`IndexedRecordWriter` rebuilds it. `iter_digests` gives the summary's fields of every record
the same way (the index's digests plus the records past it; the whole file parsed when the
index does not describe it). Known limit: an edit in place (same inode) of a record
already indexed is not seen.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import inspect
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kimi_pipe.core import evidence, prefix, token_yield
from kimi_pipe.core.evidence import UNRESOLVED, evidence_of
from kimi_pipe.core.prefix import exact_output_tokens
from kimi_pipe.core.token_yield import completion_tokens_bought
from kimi_pipe.store import atomic
from kimi_pipe.store.records import (
    RecordWriter,
    ResumeIndex,
    _json_object,
    append_whole,
    iter_records,
    open_append_fd,
    parse_resume_index,
    record_cost,
    record_output_tokens,
)

log = logging.getLogger(__name__)

SUFFIX = ".ids"
FORMAT = "kimi_pipe.records_ids"
VERSION = 2  # 2: each line ends with the record's digest (version 1 indexes are rebuilt)


def index_path(records_path: str | Path) -> Path:
    p = Path(records_path)
    return p.with_name(p.name + SUFFIX)


def _derivation() -> str:
    """A fingerprint of the code that derives a digest from a record (the rung, exact and
    bought tokens): digests written by other code are not trusted, the index is rebuilt."""
    parts = [repr((evidence.LADDER, sorted(evidence.NEVER_USABLE)))]
    for fn in (
        digest,
        evidence.evidence_of,
        evidence.whole_engine_ids,
        evidence.has_prefix,
        prefix.exact_output_tokens,
        token_yield.completion_tokens_bought,
    ):
        try:
            parts.append(inspect.getsource(fn))
        except (OSError, TypeError):  # no source shipped: the bytecode says the same
            parts.append(repr(fn.__code__.co_code) + repr(fn.__code__.co_consts))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


derivation = functools.cache(_derivation)


def _header(records_path: Path) -> dict[str, Any]:
    st = os.stat(records_path)
    return {
        "format": FORMAT,
        "version": VERSION,
        "dev": st.st_dev,
        "ino": st.st_ino,
        "digest": derivation(),
    }


# An index line: end offset, kind, cost, output tokens, id, digest; tab-separated, because a
# resume splits a line several times faster than json.loads parses one
# (benchmarks/bench_resume.py), and never parses the digest.
OK, ERROR, BAD = 0, 1, 2  # kinds: an answer, an error record, a line that is not a record
Entry = tuple[int, int, float, int, "str | None", "dict[str, Any] | None"]
_PLAIN = frozenset(b"\t\n\r\\")


def _count(value: Any) -> int:
    """A token count as a summary adds it (0 where the record holds none or no number)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return 0
    try:
        return int(value or 0)
    except (ValueError, OverflowError):
        return 0


def digest(rec: dict[str, Any]) -> dict[str, Any]:
    """What generate's summary (generation/summary.py) reads of a record, in few bytes (the
    index stays small beside the records): `e` its error class, or `k` ok, `r` its rung,
    `i` issues, `v` provider, `p` prompt tokens, `c` completion tokens reported, `n`
    reconstructed, `b` bought and `x` exact (core/token_yield.py), `o` it has output ids,
    `f` it has a proven prefix and `d` its output ids when they were drawn (posterior_sampled);
    a field at its default is left out (`undigest` restores it). The id is the index line's
    own field; one that is not a string is kept here (`nid`): the yield keys by any id."""
    out: dict[str, Any] = {}
    rid = rec.get("id")
    if rid is not None and not isinstance(rid, str):
        out["nid"] = rid
    err = rec.get("error")
    if err:
        out["e"] = str(err.get("class", "unknown")) if isinstance(err, dict) else "unknown"
        return out
    usage = rec.get("usage")
    issues = rec.get("issues")
    reported = rec.get("completion_tokens_reported")
    provider = rec.get("provider")
    rung = evidence_of(rec)
    full = {
        "k": 1 if rec.get("ok") else 0,
        "r": rung,
        "i": [str(i) for i in issues] if isinstance(issues, list) else [],
        "v": None if provider is None else str(provider),
        "p": _count(usage.get("prompt_tokens")) if isinstance(usage, dict) else 0,
        "c": reported if isinstance(reported, int) else None,
        "n": _count(rec.get("completion_tokens_reconstructed")),
        "b": completion_tokens_bought(rec),
        "x": exact_output_tokens(rec),
        "o": 1 if rec.get("output_ids") else 0,
        "f": 1 if evidence.has_prefix(rec) else 0,
        "d": len(rec.get("output_ids") or []) if rung == evidence.POSTERIOR_SAMPLED else 0,
    }
    out |= {k: v for k, v in full.items() if v != _DEFAULTS[k]}
    return out


_DEFAULTS: dict[str, Any] = {
    "k": 0,
    "r": UNRESOLVED,
    "i": [],
    "v": None,
    "p": 0,
    "c": None,
    "n": 0,
    "b": 0,
    "x": 0,
    "o": 0,
    "f": 0,
    "d": 0,
}


def undigest(dig: dict[str, Any]) -> dict[str, Any]:
    """A digest with every field (an error record's: `e` alone)."""
    return dig if "e" in dig else {**_DEFAULTS, **dig}


def _entry(rec: dict[str, Any] | None, end: int) -> Entry:
    if rec is None:  # a whole line that is not a JSON object: counted, as a full read does
        return (end, BAD, 0.0, 0, None, None)
    rid = rec.get("id")
    kind = ERROR if rec.get("error") is not None else OK
    sid = rid if isinstance(rid, str) else None
    return (end, kind, record_cost(rec), record_output_tokens(rec), sid, digest(rec))


def _id_field(sid: str | None) -> bytes:
    if sid is None:
        return b"-"
    raw = sid.encode("utf-8", "surrogatepass")
    if raw == b"-" or raw.startswith(b'"') or _PLAIN.intersection(raw):
        return json.dumps(sid).encode()  # quoted: an id a tab, newline or '-' would break
    return raw


def _line(entry: Entry) -> bytes:
    end, kind, cost, tokens, sid, dig = entry
    # JSON escapes every control character: a digest holds no tab or newline.
    body = b"-" if dig is None else json.dumps(dig, separators=(",", ":")).encode()
    return b"%d\t%d\t%s\t%d\t%s\t%s\n" % (
        end,
        kind,
        repr(cost).encode(),
        tokens,
        _id_field(sid),
        body,
    )


def _parse(raw: bytes) -> tuple[int, int, float, int, str | None, bytes]:
    """An index line's fields; its digest left as bytes (a resume never reads it)."""
    end, kind, cost, tokens, rid, dig = raw.split(b"\t", 5)
    if rid == b"-":
        sid = None
    elif rid.startswith(b'"'):
        sid = json.loads(rid)
    else:
        sid = rid.decode("utf-8", "surrogatepass")
    return (int(end), int(kind), float(cost), int(tokens), sid, dig)


def _header_line(header: dict[str, Any]) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode() + b"\n"


def scan(records_path: Path, start: int = 0) -> Iterator[tuple[dict[str, Any] | None, int]]:
    """(record or None for a bad line, offset after its line) of every whole line from
    `start`; a last line without its newline (torn) is not yielded."""
    with open(records_path, "rb") as fh:
        fh.seek(start)
        offset = start
        for raw in fh:
            if not raw.endswith(b"\n"):
                return
            offset += len(raw)
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError:
                obj = None
            yield (obj if isinstance(obj, dict) else None), offset


def _add(index: ResumeIndex, entry: tuple[int, int, float, int, str | None, Any]) -> None:
    _, kind, cost, tokens, sid, _dig = entry
    if kind == BAD:
        index.bad_lines += 1
        return
    if sid is not None:
        index.ids.add(sid)
    index.answered += kind == OK
    index.cost += cost
    index.output_tokens += tokens
    index.records += 1


def _read_entries(
    records_path: Path,
    into: ResumeIndex | None = None,
    digests: list[tuple[str | None, float, bytes]] | None = None,
    check_digests: bool = False,
) -> int | None:
    """Check the index against `records_path` as it is now (adding its entries to `into`,
    and (id, cost, digest) of each record's line to `digests`); the offset its last entry
    ends at, or None when it is missing or does not describe the file (then nothing may be
    taken from it). Digests (collected, or `check_digests`) must come from this code's
    derivation, else None as well."""
    side = index_path(records_path)
    try:
        data = side.read_bytes()
        st = os.stat(records_path)
    except FileNotFoundError:
        return None
    lines = data.split(b"\n")
    try:
        header = json.loads(lines[0])
    except ValueError:
        return None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        return None
    if header.get("version") != VERSION:
        return None  # another layout of lines (rebuilt by the next writer)
    if (digests is not None or check_digests) and header.get("digest") != derivation():
        return None  # digests derived by other code (a resume does not read them)
    if (header.get("dev"), header.get("ino")) != (st.st_dev, st.st_ino):
        return None  # the records file was replaced (a rewrite): another file
    scratch = ResumeIndex()
    found: list[tuple[str | None, float, bytes]] = []
    end = 0
    for raw in lines[1:-1]:  # the part after the last newline is empty or a torn line
        try:
            entry = _parse(raw)
        except ValueError:
            return None
        if not end < entry[0] <= st.st_size:
            return None
        _add(scratch, entry)
        if digests is not None and entry[1] != BAD:
            found.append((entry[4], entry[2], entry[5]))
        end = entry[0]
    if end:
        with open(records_path, "rb") as fh:
            fh.seek(end - 1)
            if fh.read(1) != b"\n":
                return None
    if into is not None:
        into.ids, into.answered, into.cost = scratch.ids, scratch.answered, scratch.cost
        into.output_tokens, into.records = scratch.output_tokens, scratch.records
        into.bad_lines = scratch.bad_lines
    if digests is not None:
        digests.extend(found)
    return end


def _tail(path: Path, end: int) -> Iterator[dict[str, Any] | None]:
    """Records past offset `end` as a full read takes them: whole lines, then a last line
    without its newline that is a whole JSON object (a torn one is left out)."""
    last = end
    for rec, offset in scan(path, end):
        last = offset
        yield rec
    with open(path, "rb") as fh:
        fh.seek(last)
        rest = fh.read()
    if rest:
        obj = _json_object(rest)
        if obj is not None:
            yield obj


_BATCH = 8192


def iter_digests(records_path: str | Path) -> Iterator[tuple[Any, float, dict[str, Any]]]:
    """(id, cost, digest) of every record of `records_path`, in file order, as a full read
    (`iter_records`) would give them: from the index where it describes the file (only the
    records past it parsed), else from every record parsed. A missing file gives none."""
    path = Path(records_path)
    if not path.exists():
        return
    found: list[tuple[str | None, float, bytes]] = []
    end = _read_entries(path, digests=found)
    if end is None:
        for rec in iter_records(path):
            yield rec.get("id"), record_cost(rec), undigest(digest(rec))
        return
    for start in range(0, len(found), _BATCH):
        batch = found[start : start + _BATCH]
        # One JSON array a batch: the C decoder once, not a Python call per line.
        parsed = json.loads(b"[" + b",".join(raw for _, _, raw in batch) + b"]")
        for (sid, cost, _), dig in zip(batch, parsed, strict=True):
            full = undigest(dig)
            yield (sid if sid is not None else full.get("nid")), cost, full
    for late in _tail(path, end):
        if late is not None:
            yield late.get("id"), record_cost(late), undigest(digest(late))


def load_indexed(records_path: str | Path, *spend_logs: str | Path) -> ResumeIndex | None:
    """`load_resume_index` from the index plus the records past it; None when there
    is no index that describes the file (then parse it whole)."""

    path = Path(records_path)
    index = ResumeIndex()
    end = _read_entries(path, index)
    if end is None:
        return None
    last = end
    for rec, offset in scan(path, end):  # records written after the index's last line
        last = offset
        _add(index, _entry(rec, offset))
    with open(path, "rb") as fh:  # a last line without its newline, as iter_records reads it
        fh.seek(last)
        rest = fh.read()
    if rest:
        obj = _json_object(rest)
        if obj is None:
            index.torn_tail = True
        else:
            _add(index, _entry(obj, last + len(rest)))
    for extra in spend_logs:
        for rec in iter_records(extra):
            index.cost += record_cost(rec)
            index.output_tokens += record_output_tokens(rec)
    return index


def rebuild(records_path: str | Path) -> int:
    """Write the index of the whole records file (one full parse); returns its entries."""
    path = Path(records_path)
    lines = [_header_line(_header(path))]
    for rec, offset in scan(path):
        lines.append(_line(_entry(rec, offset)))
    atomic.write_bytes(index_path(path), b"".join(lines))
    return len(lines) - 1


class IndexedRecordWriter(RecordWriter):
    """`RecordWriter` that also appends each record's index line, after the record."""

    def __init__(self, path: str | Path, fsync_every_s: float = 1.0) -> None:
        super().__init__(path, fsync_every_s)  # creates the file, cuts a torn last line
        self._index_fd = -1
        if index_path(self.path).is_symlink():  # as the records file: never written through
            self.close()
            raise OSError(errno.ELOOP, "a symbolic link is not followed", str(index_path(path)))
        # A writer also needs digests derived by this code: else the index is rebuilt.
        end = _read_entries(self.path, check_digests=True)
        if end is None:
            n = rebuild(self.path)
            log.info("%s: index of %d records rebuilt", index_path(self.path), n)
        else:
            # Records appended after the last index line (a kill between the two writes):
            # index them now, from their offsets.
            tail = b"".join(_line(_entry(r, o)) for r, o in scan(self.path, end))
            if tail:
                with open(index_path(self.path), "ab") as fh:
                    fh.write(tail)
        side = index_path(self.path)
        self._cut_torn_index(side)
        self._index_fd = open_append_fd(side)

    @staticmethod
    def _cut_torn_index(side: Path) -> None:
        """Drop an index line cut short by a kill, so appends start on a fresh line."""
        data = side.read_bytes()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            with open(side, "rb+") as fh:
                fh.truncate(keep)

    def append(self, record: Any) -> None:
        super().append(record)
        end = os.fstat(self._fd).st_size  # one writer per run directory: our own append
        append_whole(self._index_fd, _line(_entry(dict(record), end)), index_path(self.path))

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._index_fd >= 0:
                fd, self._index_fd = self._index_fd, -1
                os.close(fd)


def load_resume_index(records_path: str | Path, *spend_logs: str | Path) -> ResumeIndex:
    """Ids already answered in `records_path`; spend counted over it and `spend_logs`
    (records of money spent on samples that were given up and will be tried again).
    Read from the records' index of ids when one describes the file."""
    fast = load_indexed(records_path, *spend_logs)
    return fast if fast is not None else parse_resume_index(records_path, *spend_logs)
