"""Benchmark: the whole generate stage vs a bare httpx async client, same server, same run.

Both send the same N chat requests at the same concurrency to one local fake OpenRouter
server (tests/support/fake_openrouter.py) that answers instantly. The stage arm is everything
`python -m kimi_pipe generate` does per sample (render + budget reservation + LiteLLM +
retry bookkeeping + reconstruction with the real tokenizer + flushed JSONL record); the
bare arm only sends the request and parses the JSON answer. Prints samples/s of each
and the ratio stage / bare (no timing thresholds: a ratio measured in one run).

The stage is also run without its write-ahead spend journal (a null journal swapped in,
which the stage never allows itself): the ratio with / without is what the journal costs.
Arms alternate (with, without, with, without) so drift on a shared machine hits both.

    .venv/bin/python -m benchmarks.bench_generate --n 1000 --concurrency 64 [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from kimi_pipe.config import compose  # noqa: E402
from kimi_pipe.generation import buying as generate_stage  # noqa: E402
from kimi_pipe.providers.calls import get_litellm  # noqa: E402
from kimi_pipe.providers.settings import ProviderSettings  # noqa: E402
from kimi_pipe.stages.generate import generate  # noqa: E402
from tests.support.fake_openrouter import Behaviour, FakeOpenRouter  # noqa: E402


class NullJournal:
    """The spend journal's interface with no file and no bookkeeping (benchmark only)."""

    def __init__(self, path: Path) -> None:
        self.seq = 0

    def __enter__(self) -> NullJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    async def recover(self, lookup: object = None) -> tuple[int, float]:
        return 0, 0.0

    def spent(self) -> float:
        return 0.0

    def billed_attempts(self) -> Counter[str]:
        return Counter()

    def intent(self, rid: str, attempt: int, usd: float) -> int:
        self.seq += 1
        return self.seq

    def generation(self, seq: int, generation_id: str | None, usd: float = 0.0) -> None:
        pass

    def settle(self, seq: int, cost: float, billed: bool, how: str = "") -> None:
        pass


def journal_arm(overrides: list[str], out: Path, n: int, journal: bool) -> float:
    """Samples/s of the stage's dispatch phase, with or without the spend journal."""
    real = generate_stage.SpendJournal
    if not journal:
        generate_stage.SpendJournal = NullJournal  # type: ignore[misc,assignment]
    try:
        status, summary = generate(compose(overrides + [f"output_dir={out}"]), out)
    finally:
        generate_stage.SpendJournal = real  # type: ignore[misc]
    assert status == 0 and summary is not None, "the stage failed"
    assert summary["counts"]["answered"] == n, summary["counts"]
    return n / summary["this_run"]["wall_s"]


def write_prompts(path: Path, n: int) -> list[dict]:
    rows = []
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            row = {
                "id": f"b{i}",
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {
                        "role": "user",
                        "content": f"Benchmark question {i}: explain item {i} briefly.",
                    },
                ],
            }
            fh.write(json.dumps(row) + "\n")
            rows.append(row)
    return rows


async def bare_httpx(
    url: str, key: str, rows: list[dict], settings: ProviderSettings, concurrency: int
) -> float:
    """Seconds for a plain httpx client to send every request and parse every answer."""
    import httpx

    model = settings.model.split("/", 1)[1]
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def one(row: dict) -> None:
            body = {
                "model": model,
                "messages": row["messages"],
                **settings.params,
                **settings.extra_body,
                "usage": {"include": True},
            }
            async with sem:
                resp = await client.post(
                    f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                )
                resp.raise_for_status()
                assert resp.json()["choices"]

        start = time.perf_counter()
        await asyncio.gather(*(one(r) for r in rows))
        return time.perf_counter() - start


async def bare_aiohttp(
    url: str, key: str, rows: list[dict], settings: ProviderSettings, concurrency: int
) -> float:
    """The same with aiohttp (the transport LiteLLM itself uses for async calls)."""
    import aiohttp

    model = settings.model.split("/", 1)[1]
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one(row: dict) -> None:
            body = {
                "model": model,
                "messages": row["messages"],
                **settings.params,
                **settings.extra_body,
                "usage": {"include": True},
            }
            async with (
                sem,
                session.post(
                    f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                ) as resp,
            ):
                resp.raise_for_status()
                assert (await resp.json())["choices"]

        start = time.perf_counter()
        await asyncio.gather(*(one(r) for r in rows))
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokenizer", default=None, help="Kimi tokenizer dir (default: ../shared)")
    ap.add_argument(
        "--journal-pairs",
        type=int,
        default=3,
        help="alternating runs with and without the spend journal",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    key = "sk" + "-or-v1-BENCHMARK"
    os.environ["OPENROUTER_API_KEY"] = key
    srv = FakeOpenRouter(default=Behaviour()).start()
    tmp = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    try:
        prompts = tmp / "p.jsonl"
        rows = write_prompts(prompts, args.n)
        overrides = [
            "dataset=jsonl",
            f"dataset.path={prompts}",
            "model=kimi_k25",
            "provider=openrouter",
            f"provider.api_base={srv.url()}",
            f"provider.concurrency={args.concurrency}",
            "budget.usd=1000",
            "provider.params.max_tokens=256",
        ]
        if args.tokenizer:
            overrides.append(f"model.tokenizer.path={args.tokenizer}")
        cfg = compose(overrides + [f"output_dir={tmp / 'warm'}"])
        settings = ProviderSettings.from_config(cfg.provider)
        get_litellm()  # import cost is start-up, not throughput
        # Warm-up: first LiteLLM call, tokenizer load, connection pool.
        warm = tmp / "warm.jsonl"
        write_prompts(warm, 16)
        generate(
            compose(
                overrides[:1]
                + [f"dataset.path={warm}"]
                + overrides[2:]
                + [f"output_dir={tmp / 'warm'}"]
            ),
            tmp / "warm",
        )
        asyncio.run(bare_httpx(srv.url(), key, rows[:16], settings, args.concurrency))
        asyncio.run(bare_aiohttp(srv.url(), key, rows[:16], settings, args.concurrency))

        bare_s = asyncio.run(bare_httpx(srv.url(), key, rows, settings, args.concurrency))
        aio_s = asyncio.run(bare_aiohttp(srv.url(), key, rows, settings, args.concurrency))
        start = time.perf_counter()
        status, summary = generate(compose(overrides + [f"output_dir={tmp / 'run'}"]), tmp / "run")
        stage_total_s = time.perf_counter() - start
        assert status == 0 and summary is not None, "the stage failed"
        assert summary["counts"]["answered"] == args.n, summary["counts"]
        stage_s = summary["this_run"]["wall_s"]
        bare_rate, stage_rate = args.n / bare_s, args.n / stage_s
        print(
            f"requests: {args.n}, concurrency: {args.concurrency}, server: fake OpenRouter "
            f"on 127.0.0.1 answering instantly, CPUs: {os.cpu_count()}"
        )
        print(f"bare httpx async client : {bare_rate:8.1f} samples/s ({bare_s:.2f} s)")
        print(f"bare aiohttp client     : {args.n / aio_s:8.1f} samples/s ({aio_s:.2f} s)")
        print(
            f"generate stage (dispatch): {stage_rate:8.1f} samples/s ({stage_s:.2f} s; "
            f"{stage_total_s:.2f} s with start-up)"
        )
        print(f"ratio stage / bare httpx: {stage_rate / bare_rate:.2f}")
        print(f"ratio stage / bare aiohttp: {stage_rate / (args.n / aio_s):.2f}")
        with_j, without_j = [], []
        for rep in range(args.journal_pairs):
            with_j.append(journal_arm(overrides, tmp / f"with{rep}", args.n, True))
            without_j.append(journal_arm(overrides, tmp / f"without{rep}", args.n, False))
        ratio = sum(with_j) / sum(without_j)
        pairs = sorted(w / wo for w, wo in zip(with_j, without_j, strict=True))
        print(
            f"generate with spend journal   : {sum(with_j) / len(with_j):8.1f} samples/s "
            f"({', '.join(f'{r:.1f}' for r in with_j)})"
        )
        print(
            f"generate without spend journal: {sum(without_j) / len(without_j):8.1f} "
            f"samples/s ({', '.join(f'{r:.1f}' for r in without_j)})"
        )
        print(
            f"per-pair ratios with / without: {', '.join(f'{r:.3f}' for r in pairs)} "
            f"(median {pairs[len(pairs) // 2]:.3f})"
        )
        print(f"ratio with / without journal: {ratio:.3f}")
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
