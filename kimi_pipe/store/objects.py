"""Object-store primitives on fsspec: conditional create, write-once records, hashed streams.

The unit store (`kimi_pipe.store.units`) runs on anything fsspec opens that can create an
object only if it does not exist yet, which is the one primitive an object store offers in
place of rename, flock and hard links:

* local disk (``file://`` or a plain path): ``open(O_CREAT | O_EXCL)``;
* S3 and S3-compatible stores (``s3://``, s3fs): ``PutObject`` with ``If-None-Match: *``;
* Google Cloud Storage (``gs://``, gcsfs): an upload with ``ifGenerationMatch=0``.

Both object stores answer HTTP 412 to a second create, which s3fs and gcsfs raise as
`FileExistsError`, like ``O_EXCL`` does. Any other filesystem is refused: fsspec's generic
``mode="create"`` checks and then writes, which two writers can both pass.

On an object store a conditional create is atomic: the object appears whole or not at all.
On local disk the file exists from the ``open`` on, before its bytes are written, so a writer
killed in between (or a power cut) leaves an empty or torn file. Records written once are
therefore self-checking (`encode_record` puts a sha256 of the body in it) and stored in
numbered slots (`create_once`): a reader trusts the lowest slot that checks out, and a writer
that finds a slot torn and older than a grace period takes the next one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from kimi_pipe.errors import ConfigError
from kimi_pipe.store import atomic

log = logging.getLogger(__name__)

LOCAL_PROTOCOLS = frozenset({"file", "local"})
# Filesystems whose create-if-absent is a server-side condition (HTTP 412 -> FileExistsError).
CONDITIONAL_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})
SELF_HASH = "self_sha256"
SLOT_SUFFIX = ".json"


def protocols(fs: AbstractFileSystem) -> frozenset[str]:
    proto = fs.protocol
    return frozenset([proto] if isinstance(proto, str) else proto)


def is_local(fs: AbstractFileSystem) -> bool:
    return bool(protocols(fs) & LOCAL_PROTOCOLS)


def check_conditional_create(fs: AbstractFileSystem) -> None:
    """Refuse a filesystem without an atomic create-if-absent (the protocol's only primitive)."""
    if is_local(fs) or protocols(fs) & CONDITIONAL_PROTOCOLS:
        return
    raise ConfigError(
        f"filesystem {sorted(protocols(fs))} has no conditional create that the unit store "
        f"trusts; use local disk or one of {sorted(CONDITIONAL_PROTOCOLS)}"
    )


def open_fs(url: str, **storage_options: Any) -> tuple[AbstractFileSystem, str]:
    """(filesystem, root path) of a URL: a local path, ``s3://bucket/prefix``, ``gs://...``."""
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    check_conditional_create(fs)
    return fs, str(root).rstrip("/")


def join(root: str, *parts: str) -> str:
    """Object paths use '/' on every filesystem (fsspec's convention, local included)."""
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)])


def create_exclusive(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Create `path` holding `data` only if nothing is there; FileExistsError if something is.

    Two writers racing on one path: exactly one succeeds, on every supported filesystem.
    """
    if is_local(fs):
        local = fs._strip_protocol(path)
        parent = os.path.dirname(local)
        os.makedirs(parent, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(local, flags, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        atomic.fsync_dir(parent)
        return
    check_conditional_create(fs)
    fs.pipe_file(path, data, mode="create")


def overwrite(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Replace an object the caller owns (a lease renewal). Not atomic on local disk: readers
    of such objects must accept a torn one (see `Leases` in units.py)."""
    if is_local(fs):
        local = fs._strip_protocol(path)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        with atomic.open_new(local) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return
    fs.pipe_file(path, data)


def read_bytes(fs: AbstractFileSystem, path: str) -> bytes | None:
    """The object's bytes, or None when it does not exist."""
    try:
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        return None


def modified_s(fs: AbstractFileSystem, path: str) -> float | None:
    """Last-modified time of an object (unix seconds), None when it is gone."""
    try:
        return float(fs.modified(path).timestamp())
    except FileNotFoundError:
        return None


def listing(fs: AbstractFileSystem, prefix: str) -> list[str]:
    """Every object under `prefix` (recursive), fresh: no cached listing of an earlier call."""
    fs.invalidate_cache()
    try:
        return sorted(str(p) for p in fs.find(prefix))
    except FileNotFoundError:
        return []


# --- self-checking records ------------------------------------------------------------------
def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def encode_record(body: dict[str, Any]) -> bytes:
    """Canonical JSON of `body` plus the sha256 of that JSON: a torn copy cannot check out."""
    if SELF_HASH in body:
        raise ValueError(f"a record body may not hold {SELF_HASH!r}")
    digest = hashlib.sha256(_canonical(body)).hexdigest()
    return _canonical({**body, SELF_HASH: digest}) + b"\n"


def decode_record(data: bytes | None) -> dict[str, Any] | None:
    """The body of a record, or None when it is missing, torn or does not match its hash."""
    if not data:
        return None
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    digest = obj.pop(SELF_HASH, None)
    if digest != hashlib.sha256(_canonical(obj)).hexdigest():
        return None
    return obj


def slot_path(base: str, slot: int) -> str:
    return f"{base}.c{slot}{SLOT_SUFFIX}"


def slot_of(path: str, base: str) -> int | None:
    """The slot number of `path` when it is a slot of `base`, else None."""
    head = base + ".c"
    if not (path.startswith(head) and path.endswith(SLOT_SUFFIX)):
        return None
    number = path[len(head) : -len(SLOT_SUFFIX)]
    return int(number) if number.isdigit() else None


def first_valid(fs: AbstractFileSystem, base: str, paths: Iterable[str]) -> dict[str, Any] | None:
    """The record in the lowest slot of `base` that checks out (None: no trusted record)."""
    slots = sorted((s, p) for p in paths if (s := slot_of(p, base)) is not None)
    for _, path in slots:
        body = decode_record(read_bytes(fs, path))
        if body is not None:
            return body
    return None


def read_once(fs: AbstractFileSystem, base: str) -> dict[str, Any] | None:
    """The trusted record written by `create_once` at `base`, or None."""
    fs.invalidate_cache()
    return first_valid(fs, base, (str(p) for p in fs.glob(base + ".c*" + SLOT_SUFFIX)))


def _settled(fs: AbstractFileSystem, path: str, grace_s: float) -> dict[str, Any] | None:
    """Wait (at most `grace_s` past the object's last write) for a slot being written to check
    out; None when it stays torn. Only local disk can show a slot half-written."""
    while True:
        body = decode_record(read_bytes(fs, path))
        if body is not None:
            return body
        written = modified_s(fs, path)
        age = time.time() - written if written is not None else grace_s
        if age >= grace_s:
            log.warning("%s is torn (%.0f s old): it is passed over", path, age)
            return None
        time.sleep(min(0.05, grace_s - age))


def create_once(
    fs: AbstractFileSystem, base: str, body: dict[str, Any], grace_s: float
) -> tuple[dict[str, Any], bool]:
    """Write `body` as the record of `base` unless one is there: (the record that stands,
    True if it is ours). The first record to land is kept; later calls change nothing."""
    data = encode_record(body)
    slot = 0
    while True:
        path = slot_path(base, slot)
        try:
            create_exclusive(fs, path, data)
            return body, True
        except FileExistsError:
            pass
        standing = _settled(fs, path, grace_s)
        if standing is not None:
            return standing, False
        slot += 1


# --- hashed streaming writes -----------------------------------------------------------------
class HashingWriter:
    """Stream bytes into one new object, counting its size and sha256 as they go by.

    Local files are fsynced on close (the index that names them comes after). On an object
    store the object appears at close (a single PUT or the multipart upload's completion).
    """

    def __init__(self, fs: AbstractFileSystem, path: str) -> None:
        self.path = path
        self.size = 0
        self._hash = hashlib.sha256()
        self._local = is_local(fs)
        if self._local:
            local = fs._strip_protocol(path)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            self._file: Any = atomic.open_new(local)
        else:
            self._file = fs.open(path, "wb")

    def write(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.size += len(data)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def close(self) -> None:
        if self._local:
            self._file.flush()
            os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        """Drop what was written. An object-store file must not be closed here: closing it
        uploads it (a partial object nobody names is harmless, but a waste)."""
        with contextlib.suppress(Exception):
            discard = getattr(self._file, "discard", None)
            if discard is not None and not self._local:
                discard()
                self._file.closed = True  # else its __del__ would upload what is left
            else:
                self._file.close()


@contextlib.contextmanager
def hashing_writer(fs: AbstractFileSystem, path: str) -> Iterator[HashingWriter]:
    w = HashingWriter(fs, path)
    try:
        yield w
    except BaseException:
        w.abort()
        raise
    w.close()
