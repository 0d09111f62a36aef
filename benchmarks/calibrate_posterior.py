"""The posterior rung on the calibration answers (issue 33): is a drawn option the truth as
often as its posterior says?

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.calibrate_posterior --threads 1 \
        --answers 500 --cache runs/calibration_posterior500.json

Samples the answers as `benchmarks/calibrate_resolution.py` does (SmolLM2, T=1, top_p 0.9,
seed 0, batches of 50: the first N answers are that script's first N), rebuilds each as
that script does (a stack hides the whitespace between a reasoning and a content) and
scores every closed set of two or more options with the target (extraction/resolve.py,
min_posterior 0.999). Each scored set's numbers are cached after every batch (`--cache`:
every option's log-probability and which option, if any, is the sampled truth), so the
table is computed again without the model, and a run stopped early keeps its batches.

For every set the target leaves unresolved, one option is drawn as the pipeline's
`posterior_sampled` rung draws it (core/posterior.py: seed from `--seed` and the record id).
Printed: in bins of the drawn option's posterior, how many records, how often the drawn
option is the truth, and the mean posterior; the same table in expectation over the RNG
(each option weighted by its posterior: what the draw gives on average over seeds); and the
tokens the rung adds. The split check is not run here (calibrate_resolution.py's 42 minutes):
a truth that is a non-canonical split is among no option, and counts as a miss.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.999)


def _bin(p: float) -> int | None:
    for b in range(len(EDGES) - 1):
        if EDGES[b] <= p < EDGES[b + 1]:
            return b
    return None


def score_sets(args: argparse.Namespace) -> dict[str, Any]:
    """Sample the answers batch by batch (calibrate_resolution.py's key: its first batches
    are the same answers) and score every closed set; the cache, written after each batch,
    so a run stopped early keeps every whole batch."""
    import torch

    from benchmarks import calibrate_resolution as cal
    from kimi_pipe.core.prefix import proven_prefix
    from kimi_pipe.extraction.resolve import HFSuffixScorer, ResolveSettings, score_record

    torch.set_num_threads(args.threads)
    model, _path, backend, tok, end = cal.load_target()
    hf = backend.model
    end_id = end[-1]
    # calibrate_resolution.py's defaults (its key, but for the number of answers).
    key = {"answers": args.answers, "temperature": 1.0, "top_p": 0.9, "max_new_tokens": 64,
           "batch": 50, "seed": 0}  # fmt: skip
    prompts = cal.calibration_prompts(model, key["answers"])
    _spaces, gaps = cal.hidden_gaps(tok)
    settings = ResolveSettings(min_posterior=0.999, max_options=len(gaps))
    scorer = HFSuffixScorer(hf, "smollm2")
    sampling = {"temperature": key["temperature"], "top_p": key["top_p"]}
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    data: dict[str, Any] = {"key": key, "rows": rows}
    for first, truths in cal.sample_batches(hf, prompts, key, end_id):
        for offset, truth in enumerate(truths):
            i = first + offset
            rows.append(score_one(cal, model, tok, scorer, settings, sampling, gaps, i,
                                  prompts[i], truth, end, end_id, proven_prefix,
                                  score_record))  # fmt: skip
        data["seconds"] = time.monotonic() - started
        args.cache.parent.mkdir(parents=True, exist_ok=True)
        args.cache.write_text(json.dumps(data))
        print(f"[posterior] {len(rows)}/{len(prompts)} answers, {data['seconds']:.0f}s",
              file=sys.stderr, flush=True)  # fmt: skip
    return data


def score_one(
    cal: Any, model: Any, tok: Any, scorer: Any, settings: Any, sampling: dict[str, float],
    gaps: list[str], i: int, prompt: list[int], truth: list[int], end: list[int], end_id: int,
    proven_prefix: Any, score_record: Any,
) -> dict[str, Any]:  # fmt: skip
    """One answer rebuilt as calibrate_resolution.py does; its set scored when it has one."""
    ended = truth[-1:] == [end_id]
    body = truth[:-1] if ended else truth
    tail = end if ended else []
    text = tok.decode(body, skip_special_tokens=True)
    at = cal.split_point(tok, body)
    if at is None:
        reasoning, content = text.rstrip(), ""
    else:
        reasoning, content = tok.decode(body[:at]).rstrip(), tok.decode(body[at:]).lstrip()
    options, short, long = cal.gap_options(model, reasoning, content, tail, len(truth), gaps)
    row: dict[str, Any] = {"answer": i, "bought": len(truth), "options": len(options)}
    if len(options) < 2:
        return row
    rec = cal.gap_record(f"a{i}", prompt, options, sampling)
    rec["short_readings"] = cal.readings(short)
    rec["long_readings"] = cal.readings(long)
    scored = score_record(rec, scorer, settings)
    assert scored is not None
    row["resolved"] = bool(scored["ok"])
    row["logprobs"] = scored["resolution"]["logprobs"]
    row["truth_option"] = next((j for j, (ids, _) in enumerate(options) if ids == truth), None)
    row["option_tokens"] = [len(ids) for ids, _ in options]
    prefix = None if scored["ok"] else proven_prefix(scored)
    row["prefix_tokens"] = prefix["prefix_tokens"] if prefix else 0
    return row


def table(
    data: dict[str, Any], seed: int, only_truth_among_options: bool = False
) -> dict[str, Any]:
    """The calibration of the drawn option (module docstring), from the cache; optionally
    over the sets whose options hold the truth only (a non-canonical truth is in none)."""
    from kimi_pipe.core.posterior import draw, draw_seed, posteriors_of

    n_bins = len(EDGES) - 1
    drawn = [{"records": 0, "truth": 0, "posterior_sum": 0.0} for _ in range(n_bins)]
    expect = [{"weight": 0.0, "truth": 0.0, "posterior_sum": 0.0} for _ in range(n_bins)]
    tokens = {"bought": 0, "unresolved_sets_bought": 0, "drawn": 0, "prefix_unchecked": 0}
    unresolved = truth_in_options = not_drawable = 0
    predicted = 0.0
    for row in data["rows"]:
        tokens["bought"] += row["bought"]
        if row["options"] < 2 or row.get("resolved"):
            continue
        if only_truth_among_options and row["truth_option"] is None:
            continue
        posteriors = posteriors_of(row["logprobs"])
        if posteriors is None:
            not_drawable += 1  # every option impossible under the sampler: nothing is drawn
            continue
        unresolved += 1
        truth = row["truth_option"]
        truth_in_options += truth is not None
        chosen = draw(posteriors, draw_seed(f"a{row['answer']}", seed))
        p = posteriors[chosen]
        predicted += p
        b = _bin(p)
        if b is not None:
            drawn[b]["records"] += 1
            drawn[b]["truth"] += int(chosen == truth)
            drawn[b]["posterior_sum"] += p
        for j, q in enumerate(posteriors):
            bj = _bin(q) if q > 0 else None
            if bj is not None:
                expect[bj]["weight"] += q
                expect[bj]["truth"] += q * (j == truth)
                expect[bj]["posterior_sum"] += q * q
        tokens["unresolved_sets_bought"] += row["bought"]
        tokens["drawn"] += row["option_tokens"][chosen]
        tokens["prefix_unchecked"] += row["prefix_tokens"]
    bins = []
    for b in range(n_bins):
        d, e = drawn[b], expect[b]
        bins.append(
            {
                "bin": f"[{EDGES[b]}, {EDGES[b + 1]})",
                "records": d["records"],
                "drawn_is_truth": d["truth"],
                "frequency": d["truth"] / d["records"] if d["records"] else None,
                "mean_posterior": d["posterior_sum"] / d["records"] if d["records"] else None,
                "expected_records": e["weight"],
                "expected_frequency": e["truth"] / e["weight"] if e["weight"] else None,
                "expected_mean_posterior": (
                    e["posterior_sum"] / e["weight"] if e["weight"] else None
                ),
            }
        )
    return {
        "seed": seed,
        "only_truth_among_options": only_truth_among_options,
        "unresolved_sets": unresolved,
        "not_drawable": not_drawable,
        "predicted_truth": predicted,
        "truth_among_options": truth_in_options,
        "bins": bins,
        "drawn_is_truth": sum(d["truth"] for d in drawn),
        "expected_truth": sum(e["truth"] for e in expect),
        "tokens": tokens,
    }


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_table(result: dict[str, Any]) -> None:
    scope = "sets whose options hold the truth" if result["only_truth_among_options"] else "all"
    print(f"\n{scope}: answers {result['answers']}; drawn target-unresolved sets: "
          f"{result['unresolved_sets']} (truth among the options: "
          f"{result['truth_among_options']}; not drawable, every option impossible: "
          f"{result['not_drawable']}); seed {result['seed']}")  # fmt: skip
    print("| drawn option's posterior | records | drawn = truth | frequency | mean posterior "
          "| expected over seeds: records, frequency, mean posterior |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for b in result["bins"]:
        print(
            f"| {b['bin']} | {b['records']} | {b['drawn_is_truth']} | {_f(b['frequency'], 2)} "
            f"| {_f(b['mean_posterior'])} | {b['expected_records']:.1f}, "
            f"{_f(b['expected_frequency'])}, {_f(b['expected_mean_posterior'])} |"
        )
    t = result["tokens"]
    print(f"drawn = truth: {result['drawn_is_truth']} of {result['unresolved_sets']}, "
          f"predicted by the drawn posteriors {result['predicted_truth']:.1f} "
          f"(over seeds: {result['expected_truth']:.1f})")  # fmt: skip
    print(f"tokens: bought {t['bought']}; in the target-unresolved sets "
          f"{t['unresolved_sets_bought']}; "
          f"drawn ids {t['drawn']}; their proven prefixes (before the target's prefix check) "
          f"{t['prefix_unchecked']}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", type=int, default=500, help="the first N (whole batches of 50)")
    ap.add_argument("--cache", type=Path, default=REPO / "runs" / "calibration_posterior500.json")
    ap.add_argument("--seed", type=int, default=0, help="resolve.posterior_seed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="write the table here too")
    args = ap.parse_args()
    if args.cache.exists():
        data = json.loads(args.cache.read_text())
    else:
        data = score_sets(args)
        args.cache.parent.mkdir(parents=True, exist_ok=True)
        args.cache.write_text(json.dumps(data))
    results = [table(data, args.seed), table(data, args.seed, only_truth_among_options=True)]
    for result in results:
        result["answers"] = len(data["rows"])
        result["seconds"] = data.get("seconds")
        print_table(result)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
