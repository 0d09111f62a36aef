"""What may be a run directory, and what may be in one.

A run directory holds the records, the spend journal and the lock of one job. It is never
`/`, the home directory or a system directory (a typo there would scatter a run over the
host); it may itself be a symlink (to a bigger disk), but not a dangling one, and the
files a run writes inside it are never symlinks (records would be appended into whatever
file the link names).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from kimi_pipe.errors import StoreError
from kimi_pipe.store.layout import JOURNAL, LOCK, PROBE_PROMPTS, SERVING_AUTO_DIR
from kimi_pipe.store.spend_journal import SpendJournal

SYSTEM_DIRS = frozenset(
    {
        "/",
        "/bin",
        "/boot",
        "/dev",
        "/etc",
        "/lib",
        "/lib32",
        "/lib64",
        "/opt",
        "/proc",
        "/root",
        "/run",
        "/sbin",
        "/srv",
        "/sys",
        "/tmp",
        "/usr",
        "/var",
        "/home",
    }
)


class RunDirRefused(StoreError, ValueError):
    pass


def _is_system(path: Path) -> bool:
    text = str(path)
    if text in SYSTEM_DIRS or path == Path.home().resolve():
        return True
    # Below /proc, /sys and /dev nothing is a file system for outputs.
    return any(text.startswith(top + "/") for top in ("/proc", "/sys", "/dev"))


def check_run_dir(run_dir: str | Path, files: Iterable[str] = ()) -> Path:
    """Refuse a run directory that must not be one; returns it unchanged."""
    run_dir = Path(run_dir)
    resolved = Path(os.path.realpath(run_dir))
    if _is_system(resolved):
        raise RunDirRefused(
            f"run directory {run_dir} is {resolved}, the root, home or a system directory; "
            "set output_dir to a directory of its own (e.g. runs/NAME)"
        )
    if run_dir.is_symlink() and not run_dir.exists():
        raise RunDirRefused(
            f"run directory {run_dir} is a dangling symlink (-> {os.readlink(run_dir)}); "
            "create its target or set output_dir elsewhere"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirRefused(f"run directory {run_dir} exists and is not a directory")
    for name in files:
        path = run_dir / name
        if path.is_symlink():
            raise RunDirRefused(
                f"{path} is a symlink (-> {os.readlink(path)}); a run never writes through "
                "one: replace it by the file itself"
            )
    return run_dir


def same_dir(a: str | Path, b: str | Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def remove_if_unused(fresh: Sequence[Path], job: str) -> None:
    """After a start that failed: the run directory a command made (`fresh`: it, then the
    parents it made) goes, with them, if nothing in it was used (`_never_used`)."""
    with contextlib.suppress(OSError, IndexError):  # what cannot go stays; the error was said
        if _never_used(fresh[0], job):
            shutil.rmtree(fresh[0])
            for parent in fresh[1:]:
                parent.rmdir()  # only an empty one: another run may have begun beside it


# What a start writes before its first request, besides Hydra's files and the locks.
_BEFORE_BUYING = frozenset({Path(SERVING_AUTO_DIR, PROBE_PROMPTS)})


def _never_used(run_dir: Path, job: str) -> bool:
    """`run_dir` holds only what Hydra's job `job` wrote first (`.hydra/<job>/`, `<job>.log`),
    locks, the probe prompts and spend journals that book nothing (a start refused, or one
    that failed before any request reached the provider: no network). Anything else (a
    record, an attempt's error, a journal with money or an attempt in it) keeps it all."""
    for path in run_dir.rglob("*"):
        if path.is_dir() and not path.is_symlink():
            continue
        rel = path.relative_to(run_dir)
        if path.is_symlink():
            return False
        if rel.parts[0] == ".hydra":
            if len(rel.parts) < 3 or rel.parts[1] != job:
                return False
        elif path.name == JOURNAL:
            if not SpendJournal.read_only(path).books_nothing():
                return False
        elif rel != Path(f"{job}.log") and path.name != LOCK and rel not in _BEFORE_BUYING:
            return False
    return True
