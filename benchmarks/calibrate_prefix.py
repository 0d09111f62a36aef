"""Proven prefixes on the calibration answers (issue 33): tokens kept, and 0 silent?

    .venv/bin/python -m benchmarks.calibrate_prefix --truths runs/calibration_truths500.json \
        [--answers N] [--only 8,67] [--json docs/measured/prefix_calibration.json]

Reads the answers `benchmarks/calibrate_resolution.py` sampled (its `--truths` cache; SmolLM2,
T=1, top_p 0.9), rebuilds each as that script does (a stack hides the whitespace between
a reasoning and a content), and for every answer with a closed set of two or more options:
scores the set with the target (extraction/resolve.py, min_posterior 0.999); where that
leaves it unresolved, the record's proven prefix (core/prefix.py) is checked by the target
(extraction/prefix_check.py). Counted: prefixes before and after the check, their ids, and
every prefix whose ids are not the sampled ones (silent: must be 0 after the check). The
whole-record rungs (text-proven, resolved) are not split-checked here: that is
calibrate_resolution.py's figure (its 42 minutes of split check are not repeated).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import calibrate_resolution as cal
from kimi_pipe.core.prefix import training_ids, with_prefix
from kimi_pipe.extraction.prefix_check import check_prefix
from kimi_pipe.extraction.resolve import HFSuffixScorer, ResolveSettings, score_record
from kimi_pipe.extraction.split_check import vocabulary_of

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--truths", type=Path, default=REPO / "runs" / "calibration_truths500.json")
    ap.add_argument("--answers", type=int, default=None, help="the first N answers only")
    ap.add_argument("--only", default="", help="comma-separated answer indices")
    ap.add_argument("--all-prefixes", action="store_true", help="check resolved sets' too")
    ap.add_argument("--no-check", action="store_true", help="count prefixes, check none")
    ap.add_argument("--min-posterior", type=float, default=0.999)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _path, backend, tok, end = cal.load_target()
    hf = backend.model
    end_id = end[-1]
    truths = json.loads(args.truths.read_text())["truths"]
    key = json.loads(args.truths.read_text())["key"]
    prompts = cal.calibration_prompts(model, key["answers"])
    _spaces, gaps = cal.hidden_gaps(tok)
    settings = ResolveSettings(min_posterior=args.min_posterior, max_options=len(gaps))
    scorer = HFSuffixScorer(hf, "smollm2")
    vocab = vocabulary_of(model.tokenizer)
    sampling = {"temperature": key["temperature"], "top_p": key["top_p"]}
    only = {int(x) for x in args.only.split(",") if x}
    counts: dict[str, int] = {}
    tokens = {"bought": 0, "prefix_before_check": 0, "prefix_after_check": 0}
    silent_before: list[int] = []
    silent_after: list[int] = []
    started = time.monotonic()

    def count(name: str) -> None:
        counts[name] = counts.get(name, 0) + 1

    for i, (prompt, truth) in enumerate(zip(prompts, truths, strict=True)):
        if args.answers is not None and i >= args.answers or only and i not in only:
            continue
        tokens["bought"] += len(truth)
        tokens["bought_in_sets"] = tokens.get("bought_in_sets", 0)
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
        if len(options) < 2:
            continue
        count("sets")
        tokens["bought_in_sets"] += len(truth)
        rec: dict[str, Any] = cal.gap_record(f"a{i}", prompt, options, sampling)
        rec["short_readings"] = cal.readings(short)
        rec["long_readings"] = cal.readings(long)
        if not args.all_prefixes:
            scored = score_record(rec, scorer, settings)
            assert scored is not None
            if scored["ok"]:
                count("target_resolved")
                continue
            rec = dict(scored)
        rec = dict(with_prefix(rec))  # type: ignore[arg-type]
        if rec["evidence"] != "prefix_proven":
            count("no_prefix")
            continue
        count("prefix_before_check")
        ids, _ = training_ids(rec)
        cut = ids[len(prompt) :]
        tokens["prefix_before_check"] += len(cut)
        right = cut == truth[: len(cut)]
        if not right:
            silent_before.append(i)
        if args.no_check:
            continue
        checked, _cost = check_prefix(rec, hf, vocab, settings, "smollm2")
        assert checked is not None
        facts = checked.get("prefix_split_check") or checked.get("prefix", {}).get("split_check")
        posterior = (facts or {}).get("posterior")
        kept = checked["evidence"] == "prefix_proven"
        print(f"[prefix] {i}: {len(cut)}/{len(truth)} ids, right {right}, kept {kept}, "
              f"posterior {posterior}", file=sys.stderr, flush=True)  # fmt: skip
        if not kept:
            count("prefix_withdrawn" + ("" if right else "_was_wrong"))
            continue
        count("prefix_after_check")
        tokens["prefix_after_check"] += len(cut)
        if not right:
            silent_after.append(i)
    figures = {
        "answers": args.answers or len(truths),
        "only": sorted(only) or None,
        "min_posterior": args.min_posterior,
        "counts": counts,
        "tokens": tokens,
        "silent_before_check": silent_before,
        "silent_after_check": silent_after,
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
