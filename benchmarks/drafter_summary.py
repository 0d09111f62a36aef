"""Summary of benchmarks/drafter_cpu.py runs: fp8 stores against the spread of the bf16 seeds.

    .venv/bin/python -m benchmarks.drafter_summary runs/fp8/drafter [--out summary.json]

Reads every DIR/*.json. Runs named `bf16-seed*` are the yardstick: for each held-out figure
(validation loss, accuracy of draft steps 0-2: the draft's argmax = the teacher's) the spread is
max - min over the bf16 seeds, and another run is "within" when its distance from the bf16 mean
is at most that spread. The figures are those on the reference export's held-out rows
(`val_on_eval_export`, drafter_cpu.py --eval-export: one teacher for every drafter) when the
runs have them, else on each run's own export.
Prints a markdown table and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

FIGURES = ("loss", "full_acc_0", "full_acc_1", "full_acc_2")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(args.runs.glob("*.json"))}
    for r in runs.values():
        r["own_val"] = r["val"]
        r["val"] = r.get("val_on_eval_export") or r["val"]
    base = [r for name, r in runs.items() if name.startswith("bf16-seed")]
    if len(base) < 2:
        print("need at least two bf16-seed* runs (the yardstick)", file=sys.stderr)
        return 2
    yardstick: dict[str, dict[str, float]] = {}
    for f in FIGURES:
        values = [r["val"][f] for r in base]
        yardstick[f] = {"mean": sum(values) / len(values), "spread": max(values) - min(values)}
    rows: dict[str, Any] = {}
    print(
        "| run | hidden states read | steps | train loss first 50 -> last 50 | val loss | "
        "val next-token acc (draft steps 0 / 1 / 2) | within bf16 spread |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        v = r["val"]
        within = {
            f: abs(v[f] - yardstick[f]["mean"]) <= yardstick[f]["spread"] + 1e-12 for f in FIGURES
        }
        rows[name] = {
            "export": r["export"],
            "backend": r["backend"],
            "seed": r["seed"],
            "steps": r["steps"],
            "train_s": r["train_s"],
            "train_loss_first50": r["train_loss_first50"],
            "train_loss_last50": r["train_loss_last50"],
            "train_loss_per_100": r["train_loss_per_100"],
            "eval_export": r.get("eval_export"),
            "val": {f: v[f] for f in FIGURES},
            "val_on_own_export": {f: r["own_val"][f] for f in FIGURES},
            "minus_bf16_mean": {f: v[f] - yardstick[f]["mean"] for f in FIGURES},
            "within_bf16_spread": within,
        }
        acc = " / ".join(f"{100 * v[f]:.2f} %" for f in FIGURES[1:])
        verdict = (
            "yardstick"
            if name.startswith("bf16-seed")
            else (
                "yes"
                if all(within.values())
                else "no (" + ", ".join(f for f, ok in within.items() if not ok) + ")"
            )
        )
        print(
            f"| {name} | {r['backend']} | {r['steps']} | {r['train_loss_first50']:.3f} -> "
            f"{r['train_loss_last50']:.3f} | {v['loss']:.4f} | {acc} | {verdict} |"
        )
    spread = ", ".join(f"{f} {y['mean']:.4f} +- {y['spread']:.4f}" for f, y in yardstick.items())
    print(f"\nbf16 seeds (mean, spread max - min): {spread}")
    if args.out:
        args.out.write_text(
            json.dumps({"bf16_yardstick": yardstick, "runs": rows}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
