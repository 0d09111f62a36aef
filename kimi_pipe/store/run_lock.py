"""One process per run directory: an exclusive OS lock on `<run_dir>/.lock`.

Two processes appending to the same records and spend journal would buy every id twice
and each count only its own spend. `flock` is released by the kernel when the holder
dies (kill -9 included), so a crashed run never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from kimi_pipe.errors import StoreError
from kimi_pipe.store.layout import LOCK as LOCK  # re-exported: the lock's file name


class RunDirLocked(StoreError):
    """Another live process holds the run directory."""


class RunLock:
    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK
        self._fd = -1

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirLocked(
                f"{self.path.parent} is in use by another process ({holder}); wait for it to "
                "finish or stop it, or use another output_dir"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        except OSError as exc:  # a full disk: the write names no file, the message must
            os.close(fd)
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def run_dir_lock(run_dir: str | Path, timeout_s: float, why: str) -> Iterator[None]:
    """Hold the run directory's lock (the one `RunLock` takes and `generate` holds while it
    appends), waiting up to `timeout_s` for another holder (another extract shard, seconds);
    a holder that outlasts it (a generate still running) raises StoreError naming `why`, the
    work that waits. Nothing is written into the lock file: its holder's line stays."""
    path = Path(run_dir) / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                    raise StoreError(
                        f"{path.parent}: locked by another process ({holder or 'unknown'}) "
                        f"for over {timeout_s:.0f}s; {why}"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
