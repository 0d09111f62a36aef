"""The DFlash-family and DSpark exports of the miniature Kimi K2.5 (docs/miniature.md), loaded
by SpecForge's own offline reader per strategy and ModelOpt's, every layer against the store.

Builds the miniature (kimi_pipe/store/miniature.py), writes token records in Kimi's real
prompt format and marker ids, and takes SpecForge's Kimi drafter configs' layer facts
(configs/kimi-k25-eagle3.json: aux [2, 30, 58]; configs/kimi-k2.7-code-dflash.json: target
layers [1, 12, 24, 35, 47, 58]) from benchmarks/drafter_configs/, the files
tests/test_export_dflash.py reads too, then runs benchmarks/drafters_demo.py on that run with
`model=kimi_k25` and the miniature's weights.

    PYTHONPATH=. .venv/bin/python -m benchmarks.drafters_miniature --work DIR \
        --trainer-python VENV/bin/python --out docs/measured/drafters_miniature.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import drafters_demo
from kimi_pipe.config import compose
from kimi_pipe.core.models import load_model
from kimi_pipe.store import miniature
from tests.support.miniature import kimi_records

QUESTIONS = ("What is 2 + 2?", "Name a prime number.", "Say hello.", "Why is the sky blue?")


def records(n: int) -> list[dict]:
    return kimi_records(load_model(compose(["model=kimi_k25"]).model), n, QUESTIONS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--trainer-python", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--samples", type=int, default=6)
    args = parser.parse_args()
    work = args.work.resolve()
    weights = work / "kimi-mini"
    if not (weights / "config.json").exists():
        miniature.build(miniature.load_spec("kimi_k25"), weights)
    run = work / "run"
    run.mkdir(parents=True, exist_ok=True)
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(args.samples)))
    eagle3 = drafters_demo.CONFIGS / "kimi-k25-eagle3.json"
    dflash = drafters_demo.CONFIGS / "kimi-k2.7-code-dflash.json"
    return drafters_demo.main(
        [
            "--run", str(run), "--trainer-python", args.trainer_python, "--out", str(args.out),
            "--model", "kimi_k25", "--model-path", str(weights),
            "--eagle3", str(eagle3), "--dflash", str(dflash),
        ]
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
