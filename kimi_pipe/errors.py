"""One tree for every failure a user can cause or fix, and the one handler that reports it.

Every user-facing failure raises a `KimiPipeError` subclass; the command line turns it into
one line on stderr (`error: ...`, naming the path or value) and exit 2. Anything else is a
bug and keeps its traceback. Each class is also the builtin kind it replaces (a `ConfigError`
is a `ValueError`, a `MissingFile` a `FileNotFoundError`, ...), so `raise ValueError` at a
user-facing site becomes `raise ConfigError` without breaking an `except ValueError`.
"""

from __future__ import annotations

import errno
import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

# Every exit status the package's commands return, in one place (0: done).
EXIT_FAILED = 1  # the work itself failed (a pipeline stage, unfinished shards): not the user's
EXIT_USER_ERROR = 2  # a mistake in the config, the input or the command line
EXIT_STOPPED = 3  # generate: the provider or the budget stopped the run (resume to go on)
EXIT_ALL_FAILED = 4  # generate: every request failed
EXIT_INTERRUPTED = 130  # Ctrl-C: finished work is on disk

__all__ = [
    "EXIT_ALL_FAILED",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_STOPPED",
    "EXIT_USER_ERROR",
    "BudgetError",
    "ConfigError",
    "InputError",
    "KimiPipeError",
    "MissingFile",
    "ProviderError",
    "StoreError",
    "UsageError",
    "exit_on_user_error",
    "host_error",
    "one_line",
    "user_errors",
]


class KimiPipeError(Exception):
    """A failure the user can act on: reported as one line, exit 2."""


class ConfigError(KimiPipeError, ValueError):
    """A config value, group choice or override is wrong (or a config file is missing)."""


class InputError(KimiPipeError, ValueError):
    """An input file or record the stage was given is unusable."""


class UsageError(ConfigError, SystemExit):
    """A command-line argument is wrong. Also a SystemExit(2): a command that used to exit on
    it still does, with the usage in the message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = EXIT_USER_ERROR


class MissingFile(InputError, FileNotFoundError):
    """A file or directory the stage needs is not there (the message says how to make it)."""


class ProviderError(KimiPipeError, RuntimeError):
    """The provider (or the local server) refused, failed or answered something unusable."""


class BudgetError(KimiPipeError, RuntimeError):
    """The USD cap, a listed price or the key's credit stops the job."""


class StoreError(KimiPipeError, RuntimeError):
    """A run directory, record file or hidden-state store cannot be used as asked."""


# OS errors a user fixes (a path, a permission, a full disk), not bugs.
_HOST_ERRNOS = {
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "not a directory",
    errno.EISDIR: "is a directory",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (a file size limit)",
    errno.ELOOP: "too many levels of symbolic links (or a symlink refused)",
    errno.EEXIST: "file exists",
}


def one_line(exc: BaseException) -> str | None:
    """The one-line message for a user-facing failure; None for a bug (keep the traceback)."""
    if isinstance(exc, KimiPipeError):
        return " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.errno in _HOST_ERRNOS and exc.filename is not None:
        where = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 else "")
        return f"{where}: {_HOST_ERRNOS[exc.errno]}"
    return None


def host_error(exc: BaseException, where: object) -> OSError | None:
    """The host's OSError (a full disk, a read-only directory) that `exc` is or was raised
    from (`raise ... from`), naming `where` when it names no file (a write or a flush names
    none); None when there is none (a bug)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _HOST_ERRNOS:
            if cause.filename is None:
                return OSError(cause.errno, _HOST_ERRNOS[cause.errno], str(where))
            return cause
        # `raise ... from` only: an exception raised while handling another may be a bug.
        cause = cause.__cause__
    return None


@contextmanager
def user_errors(prefix: str = "error") -> Iterator[None]:
    """Turn a user-facing failure raised inside into one stderr line and SystemExit(2)."""
    try:
        yield
    except (KimiPipeError, OSError) as exc:
        message = one_line(exc)
        if message is None:
            raise
        print(f"{prefix}: {message}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None


P = ParamSpec("P")
R = TypeVar("R")


def exit_on_user_error(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator form of `user_errors` for a stage's `main()`."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with user_errors():
            return fn(*args, **kwargs)

    return wrapper


@contextmanager
def dependencies_installed() -> Iterator[None]:
    """Around the command's first import: a Python without the dependencies (the system
    python3, not the checkout's .venv) is told so in one line naming the missing package and
    what to run instead, exit 2, not a ModuleNotFoundError traceback."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "kimi_pipe":
            raise
        print(
            f"error: {exc.name} is not installed in this Python ({sys.executable}): run "
            "`make setup`, then `.venv/bin/python -m kimi_pipe ...` (or `pip install` the "
            "wheel and run `kimi-pipe ...`; README, Install)",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_USER_ERROR) from None
