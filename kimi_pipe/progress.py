"""Progress of a long run: a live one-line bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import TextIO

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    done: int  # samples finished (answered or failed) out of `total`
    total: int
    spent_usd: float
    cap_usd: float | None
    output_tokens: int  # billed completion tokens of this session
    retries: int
    failures: int
    in_flight: int


def render(s: Snapshot, elapsed_s: float, width: int = 24) -> str:
    frac = s.done / s.total if s.total else 1.0
    filled = int(round(frac * width))
    bar = "#" * filled + "-" * (width - filled)
    cap = f"${s.cap_usd:.2f}" if s.cap_usd is not None else "no cap"
    tps = s.output_tokens / elapsed_s if elapsed_s > 0 else 0.0
    return (
        f"[{bar}] {s.done}/{s.total} | ${s.spent_usd:.4f} of {cap} | {tps:,.0f} out tok/s"
        f" | in flight {s.in_flight} | retries {s.retries} | failed {s.failures}"
    )


class Progress:
    """Call `update` as often as you like: a TTY is redrawn at most `tty_every_s`, a log
    gets one line every `log_every_s`. `close` prints the final state."""

    def __init__(
        self,
        stream: TextIO | None = None,
        tty_every_s: float = 0.2,
        log_every_s: float = 10.0,
        force_tty: bool | None = None,
    ) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if force_tty is None else force_tty
        self.every = tty_every_s if self.tty else log_every_s
        self.start = time.monotonic()
        self._last = float("-inf")  # the first update always shows
        self._snap: Snapshot | None = None

    def update(self, snap: Snapshot, force: bool = False) -> None:
        self._snap = snap
        now = time.monotonic()
        if not force and now - self._last < self.every:
            return
        self._last = now
        line = render(snap, now - self.start)
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
            self.stream.flush()
        else:
            log.info("progress %s", line)

    def close(self) -> None:
        if self._snap is not None:
            self.update(self._snap, force=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
