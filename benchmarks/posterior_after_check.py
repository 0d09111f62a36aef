"""The posterior rung on the calibration after the prefix check, as the records pass draws it.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.posterior_after_check \
        --records runs/calib/records-part0.jsonl runs/calib/records-part1.jsonl \
        --truths runs/calibration_truths500.json [--seed 0] [--json OUT]

Reads the final records of `benchmarks/calibrate_resolution.py --records-out` (resolution,
split check and prefix check done) and draws, for each record the target left unresolved,
one option as `extraction/records_pass.py` does after the prefix check
(`core.posterior.sample_posterior`, `resolve.posterior_seed`): a record whose prefix the
check withdrew (`prefix_split_ambiguous`) is not drawn. Compares each drawn option with the
sampled answer: in bins of the drawn option's posterior, how often it is the truth against
the sum of the posteriors. No model runs: the posteriors are the ones resolution stored.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

from kimi_pipe.core.issue_codes import PREFIX_SPLIT_AMBIGUOUS, TARGET_UNRESOLVED
from kimi_pipe.core.posterior import sample_posterior
from kimi_pipe.extraction.resolve import blocking_issues, covered_issues

BINS = ((0.0, 0.5), (0.5, 0.9), (0.9, 0.999), (0.999, 1.0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=Path, nargs="+", required=True)
    ap.add_argument("--truths", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    truths = json.loads(args.truths.read_text())["truths"]
    counts: Counter[str] = Counter()
    drawn: list[tuple[float, bool]] = []
    for path in args.records:
        for line in path.read_text().splitlines():
            rec: dict[str, Any] = json.loads(line)
            issues = rec.get("issues") or []
            if TARGET_UNRESOLVED not in issues:
                continue
            counts["target_unresolved"] += 1
            covered = covered_issues(rec["candidates"])
            out = sample_posterior(rec, args.seed, blocking_issues(issues), covered)
            if out is None:
                why = "prefix_withdrawn" if PREFIX_SPLIT_AMBIGUOUS in issues else "no_drawable"
                counts[f"not_drawn_{why}"] += 1
                continue
            truth = truths[int(str(rec["id"]).lstrip("a"))]
            right = out["output_ids"] == truth
            drawn.append((float(out["posterior_sample"]["posterior"]), right))
            counts["drawn"] += 1
            counts["drawn_is_truth"] += right
    bins = []
    for low, high in BINS:
        inside = [(p, r) for p, r in drawn if low <= p < high or (high == 1.0 and p == 1.0)]
        bins.append({"bin": f"[{low}, {high})", "records": len(inside),
                     "drawn_is_truth": sum(r for _, r in inside),
                     "predicted": round(sum(p for p, _ in inside), 3)})  # fmt: skip
    figures = {"counts": dict(counts), "predicted": round(sum(p for p, _ in drawn), 3),
               "bins": bins}  # fmt: skip
    print("| drawn option's posterior | records | drawn = truth | predicted |")
    print("| --- | --- | --- | --- |")
    for b in bins:
        print(f"| {b['bin']} | {b['records']} | {b['drawn_is_truth']} | {b['predicted']} |")
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
