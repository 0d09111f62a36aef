"""The generate job's user-facing error (exit status 2)."""

from __future__ import annotations

from kimi_pipe.errors import KimiPipeError


class GenerateError(KimiPipeError, RuntimeError):
    """A start-up problem with a message for the user (exit status 2)."""
