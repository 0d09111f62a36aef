"""Progress of a long run: a live tqdm bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

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


def details(s: Snapshot, elapsed_s: float) -> str:
    """Everything after the bar and the count: money, speed, requests."""
    cap = f"${s.cap_usd:.2f}" if s.cap_usd is not None else "no cap"
    tps = s.output_tokens / elapsed_s if elapsed_s > 0 else 0.0
    return (
        f"${s.spent_usd:.4f} of {cap} | {tps:,.0f} out tok/s"
        f" | in flight {s.in_flight} | retries {s.retries} | failed {s.failures}"
    )


def render(s: Snapshot, elapsed_s: float, width: int = 24) -> str:
    """The plain-log form of the bar (a TTY gets tqdm's drawing of the same fields)."""
    frac = s.done / s.total if s.total else 1.0
    filled = int(round(frac * width))
    bar = "#" * filled + "-" * (width - filled)
    return f"[{bar}] {s.done}/{s.total} | {details(s, elapsed_s)}"


class Progress:
    """Call `update` as often as you like: a TTY gets a tqdm bar redrawn at most every
    `tty_every_s` (log records print above it, `logging_redirect_tqdm`), a log gets one
    line every `log_every_s`. `close` prints the final state."""

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
        self._bar: Any = None
        self._redirect: Any = None

    def _draw(self, snap: Snapshot, elapsed_s: float) -> None:
        from tqdm import tqdm  # optional dep
        from tqdm.contrib.logging import logging_redirect_tqdm  # optional dep

        if self._bar is None:  # made at the first update: it draws once, with its fields
            self._bar = tqdm(
                total=snap.total,
                initial=snap.done,
                file=self.stream,
                desc=details(snap, elapsed_s),
                bar_format="[{bar:24}] {n_fmt}/{total_fmt} | {desc}",
                ascii=" #",
                mininterval=0,
                dynamic_ncols=self.stream.isatty(),
            )
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
            return
        self._bar.total = snap.total
        self._bar.n = snap.done
        self._bar.set_description_str(details(snap, elapsed_s), refresh=True)

    def update(self, snap: Snapshot, force: bool = False) -> None:
        self._snap = snap
        now = time.monotonic()
        if not force and now - self._last < self.every:
            return
        self._last = now
        if self.tty:
            self._draw(snap, now - self.start)
        else:
            log.info("progress %s", render(snap, now - self.start))

    def close(self) -> None:
        if self._bar is not None and self._snap is not None:
            # The final state, drawn once by tqdm's own close.
            self._bar.n = self._snap.done
            elapsed = time.monotonic() - self.start
            self._bar.set_description_str(details(self._snap, elapsed), refresh=False)
        elif self._snap is not None:
            self.update(self._snap, force=True)
        if self._bar is not None:
            self._bar.close()
            self._redirect.__exit__(None, None, None)
            self._bar = self._redirect = None
        elif self.tty:
            self.stream.write("\n")
            self.stream.flush()
