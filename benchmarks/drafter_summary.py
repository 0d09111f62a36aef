"""Summary of benchmarks/drafter_cpu.py runs: fp8 stores against the spread of the bf16 seeds.

    .venv/bin/python -m benchmarks.drafter_summary runs/fp8/drafter [--out summary.json]

Reads every DIR/*.json. Runs named `bf16-seed*` are the yardstick: for each held-out figure
(validation loss, accuracy of draft steps 0-2: the draft's argmax = the teacher's) the spread is
max - min over the bf16 seeds, and another run is "within" when its distance from the bf16 mean
is at most that spread. The figures are those on the reference export's held-out rows
(`val_on_eval_export`, drafter_cpu.py --eval-export: one teacher for every drafter) when the
runs have them, else on each run's own export.
Prints a markdown table and writes the figures as JSON.

`--yardstick PREFIX` names the yardstick runs (default `bf16-seed`; e.g. `noprefix-seed` for
benchmarks/prefix_drafter.sh); the JSON keys follow it (`bf16_yardstick`, `within_bf16_spread`
by default). `--by-arm` also prints and writes each arm's mean and spread over its seeds (an
arm: the run names before `-seed`) and, per figure, whether the arm's mean is within the
yardstick's spread of the yardstick's mean or beyond it on the better side (`above`: lower
loss, higher accuracy) or the worse (`below`).
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
    ap.add_argument("--yardstick", default="bf16-seed", help="name prefix of the yardstick runs")
    ap.add_argument("--by-arm", action="store_true", help="mean and spread of each arm's seeds")
    args = ap.parse_args()
    prefix = args.yardstick
    label = prefix.removesuffix("-seed").removesuffix("-") or prefix
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(args.runs.glob("*.json"))}
    for r in runs.values():
        r["own_val"] = r["val"]
        r["val"] = r.get("val_on_eval_export") or r["val"]
    base = [r for name, r in runs.items() if name.startswith(prefix)]
    if len(base) < 2:
        print(f"need at least two {prefix}* runs (the yardstick)", file=sys.stderr)
        return 2
    yardstick: dict[str, dict[str, float]] = {}
    for f in FIGURES:
        values = [r["val"][f] for r in base]
        yardstick[f] = {"mean": sum(values) / len(values), "spread": max(values) - min(values)}
    rows: dict[str, Any] = {}
    print(
        "| run | hidden states read | steps | train loss first 50 -> last 50 | val loss | "
        f"val next-token acc (draft steps 0 / 1 / 2) | within {label} spread |"
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
            f"minus_{label}_mean": {f: v[f] - yardstick[f]["mean"] for f in FIGURES},
            f"within_{label}_spread": within,
        }
        acc = " / ".join(f"{100 * v[f]:.2f} %" for f in FIGURES[1:])
        verdict = (
            "yardstick"
            if name.startswith(prefix)
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
    print(f"\n{label} seeds (mean, spread max - min): {spread}")
    out: dict[str, Any] = {f"{label}_yardstick": yardstick, "runs": rows}
    if args.by_arm:
        out["arms"] = by_arm(runs, yardstick)
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def by_arm(runs: dict[str, Any], yardstick: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Each arm's mean, min, max and spread over its seeds, and where its mean lies against
    the yardstick: within its spread of the yardstick's mean, or above (better) / below."""
    arms: dict[str, list[dict[str, Any]]] = {}
    for name, r in runs.items():
        arms.setdefault(name.split("-seed")[0], []).append(r)
    out: dict[str, Any] = {}
    print("\n| arm | seeds | " + " | ".join(FIGURES) + " |")
    print("| --- | --- |" + " --- |" * len(FIGURES))
    for arm, members in arms.items():
        figures: dict[str, Any] = {}
        for f in FIGURES:
            values = [r["val"][f] for r in members]
            mean = sum(values) / len(values)
            delta = mean - yardstick[f]["mean"]
            better = -delta if f == "loss" else delta  # lower loss, higher accuracy
            where = (
                "within"
                if abs(delta) <= yardstick[f]["spread"] + 1e-12
                else ("above" if better > 0 else "below")
            )
            figures[f] = {
                "mean": mean,
                "min": min(values),
                "max": max(values),
                "spread": max(values) - min(values),
                "minus_yardstick_mean": delta,
                "against_yardstick": where,
            }
        out[arm] = {"seeds": len(members), "figures": figures}
        cells = [
            (
                f"{v['mean']:.4f} (spread {v['spread']:.4f}, {v['against_yardstick']})"
                if f == "loss"
                else f"{100 * v['mean']:.2f} % (spread {100 * v['spread']:.2f}, "
                f"{v['against_yardstick']})"
            )
            for f, v in figures.items()
        ]
        print(f"| {arm} | {len(members)} | " + " | ".join(cells) + " |")
    return out


if __name__ == "__main__":
    sys.exit(main())
