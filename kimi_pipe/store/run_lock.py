"""One process per run directory: an exclusive OS lock on `<run_dir>/.lock`.

Two processes appending to the same records and spend journal would buy every id twice
and each count only its own spend. `flock` is released by the kernel when the holder
dies (kill -9 included), so a crashed run never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
import socket
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
