"""Write-ahead spend journal of a generate run directory (`spend_journal.jsonl`).

Every request is preceded by a flushed *intent* line (id, attempt, the USD reserved for its
worst case) and followed, once its answer or failure is booked, by a *settle* line (what it
really cost). Between the two the provider may bill a request whose answer a killed
process never saw; on the next start those intents are booked at their reservation, or at
their true cost where the provider can be asked (`GET /generation?id=` once the generation
id is journalled). So the spend a run resumes from is never below what the provider billed,
however many times the process died, and the journal counts every attempt an id was bought
over all runs.

Lines (one JSON object each, appended with one `write` call, so a kill leaves at most a
torn last line, which is ignored and cut):
    {"k": "i", "n": SEQ, "id": ID, "a": ATTEMPT, "usd": RESERVED}     intent
    {"k": "g", "n": SEQ, "gen": GENERATION_ID, "usd": BOOKED}          answer arrived
    {"k": "s", "n": SEQ, "usd": COST, "b": BILLED, "how": HOW}          settled
    {"k": "x", "usd": EXTRA}              an outside count (the key's usage) proved EXTRA
                                          more spent than the intents book
`g` carries what the answer was booked at (its stated cost, never below its tokens at the
listed prices): a lookup after a kill that says less (a `/generation` answering $0) cannot
lower it. `b` is false only for an attempt the provider refused before generating (HTTP 4xx/5xx
with no cost).

An id counts against `retry.max_attempts` over all runs for each attempt that was billed
and failed in its own run (an unreadable answer, a timeout), and for each request open at a
kill *whose answer had arrived* (its generation id is journalled: handling that answer may
be what killed the process). A request merely in flight when the process was killed is
booked but not held against its id: a kill is not the sample's fault, and counting it would
give up the first `concurrency` ids after a few kills at start-up.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from kimi_pipe.store.layout import JOURNAL as JOURNAL  # re-exported: the journal's file name
from kimi_pipe.store.records import append_whole, cut_torn_tail, iter_records, open_append_fd

log = logging.getLogger(__name__)


# How an intent was settled: by its own run, or on resume.
SETTLED = "run"
RECOVERED_WORST_CASE = "recovered_worst_case"
RECOVERED_LOOKUP = "recovered_lookup"

# Looks up what the provider billed for a generation id (None: unknown).
CostLookup = Callable[[str], Awaitable[float | None]]


@dataclass
class Intent:
    seq: int
    id: str
    attempt: int
    usd: float
    generation_id: str | None = None
    answered_usd: float | None = None  # set once its answer arrived: what it was booked at
    cost: float | None = None  # set once settled
    billed: bool = True
    how: str = SETTLED


def _finite_usd(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


class SpendJournal:
    """The journal of one run directory; single writer (the run lock guarantees it)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.intents: dict[int, Intent] = {}
        self.extra_usd = 0.0  # spend proven by an outside count beyond the intents
        self.bad_lines = 0
        for line in iter_records(self.path):
            self._apply(line)
        cut_torn_tail(self.path)
        self._next = max(self.intents, default=0) + 1
        self._fd = open_append_fd(self.path)

    @classmethod
    def read_only(cls, path: str | Path) -> SpendJournal:
        """The journal read without opening it for writing (another run directory's, which
        its own process may hold): for `spent()` and `books_nothing()`, not for booking."""
        reader = cls.__new__(cls)
        reader.path, reader.intents, reader.extra_usd = Path(path), {}, 0.0
        reader.bad_lines, reader._fd = 0, -1
        for line in iter_records(reader.path):
            reader._apply(line)
        return reader

    @classmethod
    def booked(cls, path: str | Path) -> float:
        """`spent()` of a journal read without opening it for writing."""
        return cls.read_only(path).spent()

    def books_nothing(self) -> bool:
        """No money and no attempt: every request it opened was settled at $0 as refused
        before generating (not billed, no answer arrived), no outside count proved spend, no
        line unread."""
        return (
            self.bad_lines == 0
            and self.extra_usd == 0
            and all(
                i.cost == 0 and not i.billed and i.generation_id is None and i.answered_usd is None
                for i in self.intents.values()
            )
        )

    def _apply(self, line: dict) -> None:
        seq = line.get("n")
        kind = line.get("k")
        if kind == "x":
            self.extra_usd += _finite_usd(line.get("usd")) or 0.0
            return
        if not isinstance(seq, int):
            self.bad_lines += 1
            return
        if kind == "i":
            usd = _finite_usd(line.get("usd"))
            self.intents[seq] = Intent(
                seq, str(line.get("id")), int(line.get("a") or 0), usd if usd is not None else 0.0
            )
            return
        intent = self.intents.get(seq)
        if intent is None:
            self.bad_lines += 1
        elif kind == "g":
            if isinstance(line.get("gen"), str):
                intent.generation_id = line["gen"]
            if "usd" in line:
                usd = _finite_usd(line.get("usd"))
                intent.answered_usd = usd if usd is not None else intent.usd
        elif kind == "s":
            cost = _finite_usd(line.get("usd"))
            # A settle line that does not hold a valid cost cannot lower the booking.
            intent.cost = cost if cost is not None else intent.usd
            intent.billed = bool(line.get("b", True))
            intent.how = str(line.get("how") or SETTLED)

    def _write(self, line: dict) -> None:
        data = json.dumps(line, separators=(",", ":")).encode() + b"\n"
        append_whole(self._fd, data, self.path)  # a whole line, or nothing (a full disk)

    # --- the run's side -------------------------------------------------------------
    def intent(self, rid: str, attempt: int, usd: float) -> int:
        """Journal a request about to be sent; returns its sequence number."""
        seq = self._next
        self._next += 1
        self.intents[seq] = Intent(seq, rid, attempt, usd)
        self._write({"k": "i", "n": seq, "id": rid, "a": attempt, "usd": usd})
        return seq

    def generation(self, seq: int, generation_id: str | None, usd: float | None = None) -> None:
        """The answer of `seq` arrived, booked at `usd` (settled once it is on disk)."""
        intent = self.intents[seq]
        intent.generation_id, intent.answered_usd = generation_id, usd
        line: dict = {"k": "g", "n": seq, "gen": generation_id}
        if usd is not None:
            line["usd"] = usd
        self._write(line)

    def settle(self, seq: int, cost: float, billed: bool, how: str = SETTLED) -> None:
        intent = self.intents[seq]
        if intent.cost is not None:
            return
        intent.cost, intent.billed, intent.how = cost, billed, how
        self._write({"k": "s", "n": seq, "usd": cost, "b": billed, "how": how})

    def raise_floor(self, total_usd: float) -> None:
        """Record that the directory's spend is at least `total_usd` now (never lowers it);
        the difference stays added to everything booked later."""
        extra = total_usd - self.spent()
        if extra > 1e-12:
            self.extra_usd += extra
            self._write({"k": "x", "usd": extra})

    # --- resume ---------------------------------------------------------------------
    def unsettled(self) -> list[Intent]:
        return [i for i in self.intents.values() if i.cost is None]

    async def recover(self, lookup: CostLookup | None = None) -> tuple[int, float]:
        """Book every intent an earlier process left open; returns (count, USD booked)."""
        booked = 0.0
        open_intents = self.unsettled()
        for intent in open_intents:
            cost: float | None = None
            if intent.generation_id and lookup is not None:
                try:
                    cost = _finite_usd(await lookup(intent.generation_id))
                except Exception as exc:  # noqa: BLE001 - unknown: book the worst case
                    log.warning("cost lookup of %s failed: %s", intent.generation_id, exc)
            if cost is not None and intent.answered_usd is not None:
                cost = max(cost, intent.answered_usd)  # a lookup never books below the answer
            if cost is None:
                self.settle(intent.seq, intent.usd, True, RECOVERED_WORST_CASE)
            else:
                self.settle(intent.seq, cost, True, RECOVERED_LOOKUP)
            booked += intent.cost or 0.0
        if open_intents:
            log.warning(
                "%d requests of an earlier process were never settled (killed?): "
                "booked $%.6f for them",
                len(open_intents),
                booked,
            )
        return len(open_intents), booked

    def spent(self) -> float:
        """USD booked: settled costs, reservations of requests still open, and what an
        outside count proved beyond them."""
        booked = sum(i.usd if i.cost is None else i.cost for i in self.intents.values())
        return booked + self.extra_usd

    def billed_attempts(self) -> Counter[str]:
        """Per id, the attempts held against it over all runs (see the module doc)."""
        counted: Counter[str] = Counter()
        for i in self.intents.values():
            if i.cost is None or i.how != SETTLED:  # open at a kill
                counted[i.id] += i.answered_usd is not None or i.generation_id is not None
            elif i.billed:
                counted[i.id] += 1
        return counted

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SpendJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
