"""Prefixes the check withdrew at its near-readings limit, checked again with a larger one.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.prefix_recheck --branches 4096 \
        --records runs/calib/records-part0.jsonl runs/calib/records-part1.jsonl \
        --truths runs/calibration_truths500.json [--only 33,80]

Reads the final records of `benchmarks/calibrate_resolution.py --records-out`. For every
record whose prefix check stopped at `resolve.near_reading_branches` (`closed: false`),
restores the proven prefix as it stood before the check and runs the prefix check again
(`extraction.prefix_check`) with `--branches` as that setting, on the demo's SmolLM2 under
the calibration's settings. Prints one JSON line per record: kept or not, whether the prefix
is the sampled answer's, the posterior, the seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import calibrate_resolution as cal
from kimi_pipe.core.issue_codes import PREFIX_SPLIT_AMBIGUOUS
from kimi_pipe.core.prefix import with_prefix
from kimi_pipe.extraction.prefix_check import check_prefix, checkable_prefix
from kimi_pipe.extraction.resolve import ResolveSettings
from kimi_pipe.extraction.split_check import vocabulary_of


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=Path, nargs="+", required=True)
    ap.add_argument("--truths", type=Path, required=True)
    ap.add_argument("--branches", type=int, default=4096)
    ap.add_argument("--only", default="", help="comma-separated answer indices")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    only = {int(x) for x in args.only.split(",") if x}
    truths = json.loads(args.truths.read_text())["truths"]
    model, _path, backend, tok, _end = cal.load_target()
    _spaces, gaps = cal.hidden_gaps(tok)
    settings = ResolveSettings(
        min_posterior=0.999,
        max_options=len(gaps),
        billing_splits=True,
        near_reading_branches=args.branches,
    )
    vocab = vocabulary_of(model.tokenizer)
    for path in args.records:
        for line in path.read_text().splitlines():
            rec: dict[str, Any] = json.loads(line)
            facts = rec.get("prefix_split_check") or {}
            i = int(str(rec["id"]).lstrip("a"))
            if rec.get("evidence") != "unresolved" or facts.get("closed") is not False:
                continue
            if only and i not in only:
                continue
            before = {k: v for k, v in rec.items() if k != "prefix_split_check"}
            before["issues"] = [c for c in before["issues"] if c != PREFIX_SPLIT_AMBIGUOUS]
            before = dict(with_prefix(before))  # type: ignore[arg-type]
            if not checkable_prefix(before):
                continue
            started = time.monotonic()
            checked, cost = check_prefix(before, backend.model, vocab, settings, "smollm2")
            assert checked is not None
            k = int(before["prefix"]["prefix_tokens"])
            after = checked.get("prefix_split_check") or checked["prefix"]["split_check"]
            row = {
                "answer": i,
                "prefix_tokens": k,
                "right": before["output_ids"][:k] == truths[i][:k],
                "kept": checked["evidence"] == "prefix_proven",
                "posterior": after.get("posterior"),
                "limits": after.get("limits"),
                "seconds": round(time.monotonic() - started, 1),
                "forward_tokens": cost,
            }
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
