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
from kimi_pipe.store.layout import LOCK

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
    """After a refused start: the run directory a command made (`fresh`: it, then the parents
    it made) goes, with them, if it holds only what Hydra's job `job` wrote first (`.hydra/`
    with the job's own config folder, `<job>.log`) and the lock."""
    with contextlib.suppress(OSError, IndexError):  # what cannot go stays; the error was said
        ours = {p.name for p in fresh[0].iterdir()} <= {".hydra", f"{job}.log", LOCK}
        if ours and {p.name for p in fresh[0].glob(".hydra/*")} <= {job}:
            shutil.rmtree(fresh[0])
            for parent in fresh[1:]:
                parent.rmdir()  # only an empty one: another run may have begun beside it
