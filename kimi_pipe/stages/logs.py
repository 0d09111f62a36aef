"""The commands' logging: a line a library printed already is not printed again, and a Hydra
job's log file keeps a write the host refused (a full disk) instead of printing the logging
module's "--- Logging error ---" traceback (the command then ends in one line, exit 2)."""

from __future__ import annotations

import contextlib
import logging
import sys

from kimi_pipe.errors import host_error


def _terminal(handler: logging.Handler) -> bool:
    stream = isinstance(handler, logging.StreamHandler)
    return stream and not isinstance(handler, logging.FileHandler)


def file_logs() -> list[logging.FileHandler]:
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


class SaidAlready(logging.Filter):
    """On the root's terminal handlers: a record a library's own terminal handler printed
    already (huggingface_hub's retries) is not printed twice; the log file still gets it."""

    def filter(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None and logger.parent is not None:  # up to the root, not it
            if any(_terminal(h) for h in logger.handlers):
                return False
            logger = logger.parent if logger.propagate else None
        return True


def say_each_line_once() -> None:
    """Install `SaidAlready` on the root logger's terminal handlers (once each)."""
    for handler in filter(_terminal, logging.getLogger().handlers):
        if not any(isinstance(f, SaidAlready) for f in handler.filters):
            handler.addFilter(SaidAlready())


class JobLog(logging.FileHandler):
    """A Hydra job's log file (conf/hydra/job_logging/guarded.yaml): the first write the
    host refuses is kept in `failure`, and nothing more goes to the disk that refused."""

    failure: OSError | None = None

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        failure = host_error(sys.exc_info()[1] or Exception(), self.baseFilename)
        if failure is None:  # a bad log call (a format error): a bug, keep its traceback
            super().handleError(record)
            return
        self.failure = self.failure or failure
        self.setLevel(logging.CRITICAL + 1)


def log_failure() -> OSError | None:
    """The write a job's log file could not make, if any."""
    return next((h.failure for h in file_logs() if isinstance(h, JobLog) and h.failure), None)


def close_file_logs() -> None:
    """Close the root's log files (before their directory may go)."""
    for handler in file_logs():
        logging.getLogger().removeHandler(handler)
        with contextlib.suppress(OSError):  # a full disk: said already
            handler.close()
