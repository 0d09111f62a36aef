"""Atomic file output: a file (or directory) appears whole or not at all, and survives a crash.

Every output is written to a temporary name in the same directory, fsynced, renamed over
the target (`os.replace`: atomic on POSIX), and the directory is fsynced so the rename
itself is on disk. `write_bytes` (and the text and JSON writers) name the temporary after
the writer's pid: two processes writing one target (the workers of a job array, each writing
the run's summary) never share one, so neither renames the other's half-written file away
from under it. `atomic_path` keeps one name (a writer may record it in its bytes). A failure
(a full disk, a kill) leaves the old target and no temporary.
Files are created with `O_NOFOLLOW`: a symlink planted at the temporary name (or at an
append-only output, see `open_append`) is refused with ELOOP, never written through.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "atomic_path",
    "fsync_dir",
    "open_append",
    "open_new",
    "replace",
    "temporary_name",
    "write_bytes",
    "write_json",
    "write_text",
]

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new file in `path` durable (a no-op where directories can't sync)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory: nothing more can be done
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for child in sorted(path.rglob("*")):
            if child.is_file() and not child.is_symlink():
                with child.open("rb") as fh:
                    os.fsync(fh.fileno())
        for sub in [path, *(p for p in path.rglob("*") if p.is_dir())]:
            fsync_dir(sub)
    elif path.is_file():
        with path.open("rb") as fh:
            os.fsync(fh.fileno())


def temporary_name(path: Path, suffix: str = ".tmp") -> Path:
    """This process's temporary name for `path` in `write_bytes`: beside it, ending in
    `suffix`."""
    return path.with_name(f"{path.name}.{os.getpid()}{suffix}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def replace(tmp: str | Path, target: str | Path, durable: bool = True) -> None:
    """Rename a finished temporary file or directory over `target` (same file system)."""
    tmp, target = Path(tmp), Path(target)
    if durable:
        _fsync_tree(tmp)
    os.replace(tmp, target)
    if durable:
        fsync_dir(target.parent)


def write_bytes(
    path: str | Path, data: bytes, durable: bool = True, suffix: str = ".tmp", mode: int = 0o644
) -> None:
    path = Path(path)
    tmp = temporary_name(path, suffix)
    try:
        fd = os.open(tmp, _CREATE, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.filename is not None:
            raise
        # A write or fsync on a full disk names no file: name the one being written.
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_text(
    path: str | Path, text: str, durable: bool = True, suffix: str = ".tmp", encoding: str = "utf-8"
) -> None:
    write_bytes(path, text.encode(encoding), durable, suffix)


def write_json(
    path: str | Path, obj: Any, durable: bool = True, suffix: str = ".tmp", **dumps: Any
) -> None:
    """`obj` as JSON (keyword arguments go to `json.dumps`), with a final newline."""
    write_text(path, json.dumps(obj, **dumps) + "\n", durable, suffix)


@contextmanager
def atomic_path(path: str | Path, durable: bool = True, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary path for a writer that wants a file name (torch.save, safetensors, a
    datasets directory): renamed over `path` when the block succeeds, removed when not."""
    path = Path(path)
    # The name is the same in every process: a writer may record it in the file (torch.save
    # names its archive after it), and the bytes must not depend on the pid.
    tmp = path.with_name(path.name + suffix)
    if tmp.is_symlink():
        tmp.unlink()  # never let a writer follow a planted link
    elif tmp.exists():
        _remove(tmp)
    try:
        yield tmp
        replace(tmp, path, durable)
    except BaseException:
        _remove(tmp)
        raise


def open_append(path: str | Path) -> BinaryIO:
    """Open an append-only output without following a symlink at its name (ELOOP)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o644)
    return os.fdopen(fd, "ab")


def open_new(path: str | Path) -> BinaryIO:
    """Create (or truncate) a file for writing without following a symlink at its name."""
    return os.fdopen(os.open(path, _CREATE, 0o644), "wb")
