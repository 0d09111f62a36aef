"""Export with 1 and 2 worker processes over the same unit store, in one run.

    .venv/bin/python -m benchmarks.bench_export [--samples 192] [--hidden 1024] [--rounds 2]
        [--format specforge] [--json OUT]

Writes a local unit store (the unit protocol, units of 16 samples, about two data objects a
unit) of synthetic float32 states: `--samples` samples of 128-640 tokens, 3 auxiliary states
and the final one of `--hidden` each (pre-norm, with its norm recorded, so every format
exports). Then exports it `--rounds` times with `export.workers=1` and `=2` alternately, into
fresh directories, and checks the two outputs are the same bytes. Prints seconds, MB/s of
written files and the ratio 2 / 1 (best round against best round, and round by round).
No assertion: figures for docs/distributed.md. The spawned workers' start (importing torch)
is inside the timed export, as it is for a user.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kimi_pipe.exporters import export
from kimi_pipe.store.conventions import final_norm_spec
from kimi_pipe.store.hidden_store import make_manifest
from kimi_pipe.store.units import UnitStore, run_units

LAYERS = (1, 3, 4)


def build_store(root: Path, samples: int, hidden: int, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    lengths = {f"s{i:06d}": rng.randint(128, 640) for i in range(samples)}
    manifest = make_manifest(
        model="synthetic",
        num_layers=8,
        layer_ids=list(LAYERS),
        final_state="pre_norm",
        hidden_size=hidden,
        dtype="float32",
        loss_mask="prompt=0 output=1",
        source_runs=[],
        backend="bench",
        extra={"final_norm": final_norm_spec(torch.ones(hidden), 1e-5, "norm")},
    )
    store = UnitStore.open(str(root))
    store.ensure_plan(sorted(lengths), unit_size=16, manifest=manifest)
    per_token = (len(LAYERS) + 1) * hidden * 4

    def fill(writer: Any) -> None:
        for sid in writer.unit.ids:
            n = lengths[sid]
            g = torch.Generator().manual_seed(int(sid[1:]))
            writer.add(
                sid,
                [(int(sid[1:]) * 7 + k) % 163840 for k in range(n)],
                [0] * 8 + [1] * (n - 8),
                torch.randn(n, len(LAYERS) * hidden, generator=g),
                torch.randn(n, hidden, generator=g),
            )

    run_units(store, "bench", fill, part_bytes=8 * 400 * per_token)
    return {"samples": samples, "tokens": sum(lengths.values()), "hidden": hidden}


def tree_digest(root: Path) -> str:
    skip = {"README.md", "export_summary.json", "specforge_train.yaml", "state.json"}
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name not in skip:
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _noop() -> int:
    return os.getpid()


def worker_start_s(store: Path, fmt: str, workers: int = 2) -> float:
    """Seconds to start `workers` spawned processes as the export does (import, open the
    stores and the exporter) and get one answer from each: the fixed cost of workers > 1."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from kimi_pipe.exporters import parallel

    job = parallel.Job([str(store.resolve())], {}, fmt, {}, str(store), None, False)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(
        workers, mp_context=get_context("spawn"), initializer=parallel._setup, initargs=(job,)
    ) as pool:
        pids = {f.result() for f in [pool.submit(_noop) for _ in range(4 * workers)]}
    assert pids
    return time.perf_counter() - t0


def written_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=192)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--format", default="specforge")
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_export_", dir=args.dir))
    try:
        shape = build_store(work / "units", args.samples, args.hidden)
        times: dict[int, list[float]] = {1: [], 2: []}
        digests: set[str] = set()
        size = 0
        for r in range(args.rounds):
            for workers in (1, 2) if r % 2 == 0 else (2, 1):
                out = work / f"out-{workers}-{r}"
                t0 = time.perf_counter()
                export([work / "units"], out, args.format, seed=0, workers=workers)
                times[workers].append(time.perf_counter() - t0)
                digests.add(tree_digest(out))
                size = written_bytes(out)
                shutil.rmtree(out)
        start = worker_start_s(work / "units", args.format)
        same = len(digests) == 1
        best = {w: min(t) for w, t in times.items()}
        result = {
            **shape,
            "format": args.format,
            "written_bytes": size,
            "seconds": times,
            "mb_per_s_best": {w: round(size / best[w] / 1e6, 1) for w in best},
            "ratio_2_over_1_best": round(best[1] / best[2], 3),
            "ratio_by_round": [round(a / b, 3) for a, b in zip(times[1], times[2], strict=True)],
            "outputs_identical": same,
            "two_worker_start_s": round(start, 2),
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
        }
        print(json.dumps(result, indent=2))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return 0 if same else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
