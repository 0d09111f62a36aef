"""Benchmark: what slow start costs in wall time at real latencies.

The generate stage buys N answers from a local fake OpenRouter (tests/support/fake_openrouter.py)
whose every answer takes a uniformly drawn 2-20 s (`--min-s`, `--max-s`), as long Kimi
K2.5 reasoning answers do, at `provider.concurrency` C: once with slow start (1 request in
flight at first, doubled per settled window: budget.slow_start=true, the default) and
once without. Arms alternate (on, off, off, on, ...) with the same seed for the delays, so
a drift of the shared machine hits both. Prints each arm's time from the first request
to the last answer (`this_run.wall_s`: start-up excluded) and the ratio
on / off (no threshold: a ratio measured in one run).

    .venv/bin/python -m benchmarks.bench_slow_start --n 64 --concurrency 32 [--rounds 1] \
        [--tokenizer /work/shared/tokenizers/kimi-k2.5]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from kimi_pipe.config import compose  # noqa: E402
from kimi_pipe.stages.generate import generate  # noqa: E402
from tests.support.conftest_generate import FAKE_KEY, base_overrides, write_prompts  # noqa: E402
from tests.support.fake_openrouter import Behaviour, FakeOpenRouter  # noqa: E402


def one_run(
    work: Path,
    n: int,
    concurrency: int,
    slow_start: bool,
    tokenizer: str,
    min_s: float,
    max_s: float,
    seed: int,
) -> tuple[float, dict]:
    beh = Behaviour(delay_range_s=(min_s, max_s), seed=seed)
    with FakeOpenRouter(default=beh) as srv:
        prompts = work / "p.jsonl"
        write_prompts(prompts, n)
        out = work / f"run-{'on' if slow_start else 'off'}-{seed}"
        overrides = base_overrides(
            prompts, srv.url(), out, Path(tokenizer), usd=10.0, concurrency=concurrency
        )
        overrides += [f"budget.slow_start={str(slow_start).lower()}", "provider.timeout_s=60"]
        status, summary = generate(compose(overrides), out)
    assert status == 0 and summary is not None, status
    assert summary["counts"]["answered"] == n, summary["counts"]
    # From the first request to the last answer: the start-up (the first run of a process
    # imports LiteLLM and loads the tokenizer, minutes on a loaded machine) is not slow start.
    return float(summary["this_run"]["wall_s"]), summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--min-s", type=float, default=2.0)
    ap.add_argument("--max-s", type=float, default=20.0)
    ap.add_argument(
        "--tokenizer",
        default=os.environ.get(
            "KIMI_TOKENIZER_DIR", str(REPO.parent / "shared" / "tokenizers" / "kimi-k2.5")
        ),
    )
    args = ap.parse_args()
    os.environ["OPENROUTER_API_KEY"] = FAKE_KEY
    logging.basicConfig(level=logging.WARNING)
    walls: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_no in range(args.rounds):
            # on, off, then off, on: a one-time cost of the first run hits both arms.
            for slow_start in (True, False) if round_no % 2 == 0 else (False, True):
                wall, summary = one_run(
                    Path(tmp),
                    args.n,
                    args.concurrency,
                    slow_start,
                    args.tokenizer,
                    args.min_s,
                    args.max_s,
                    seed=round_no,
                )
                walls[slow_start].append(wall)
                startup = summary["this_run"]["startup_s"]
                print(
                    f"round {round_no} slow_start={slow_start}: {wall:.1f} s from first "
                    f"request to last answer (start-up {startup:.1f} s), "
                    f"concurrency reached {summary['this_run']['concurrency_reached']}",
                    flush=True,
                )
    on, off = statistics.median(walls[True]), statistics.median(walls[False])
    print(
        f"n={args.n} concurrency={args.concurrency} answers {args.min_s:g}-{args.max_s:g} s: "
        f"slow start {on:.1f} s, without {off:.1f} s, ratio {on / off:.2f} "
        f"(+{on - off:.1f} s)"
    )


if __name__ == "__main__":
    main()
