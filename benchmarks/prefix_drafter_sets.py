"""The record sets of benchmarks/prefix_drafter.sh: one held-out set, one training set.

    .venv/bin/python -m benchmarks.prefix_drafter_sets --records A.jsonl [B.jsonl ...] \
        --out RUN [--every 5]

Reads the final records of benchmarks/calibrate_resolution.py (`--records-out`, one file per
`--part`; a later record of an id replaces an earlier one, as extraction reads them) and
writes, by a rule that does not look at any arm:

- RUN/heldout/records.jsonl: the held-out rows. Prompts are numbered in the order of their
  first answer (answer index from the record id `a<i>`); every `--every`-th distinct prompt
  (0, 5, 10, ...) is held out whole: its whole-exact answers (`text_proven`,
  `target_resolved`) are the held-out rows, and no answer to it (whatever its evidence) is
  trained on. Held out by prompt, not by answer: the calibration asks each question about
  four times, and answers to one question at T=1 are often the same text.
- RUN/train/records.jsonl: every record of the other prompts, evidence as the calibration
  left it. Both arms are exported from the one store extracted from it; they differ only in
  `export.accept` (with or without `prefix_proven`).
- RUN/sets.json: the rule, and per set the records and tokens by evidence; per arm the rows,
  tokens and loss tokens that reach training (`kimi_pipe.core.prefix.training_ids`, the ids and
  loss mask extraction keeps: a `prefix_proven` record cut at its proven prefix).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from kimi_pipe.core.evidence import evidence_of, parse_accept, usable
from kimi_pipe.core.prefix import training_ids

WHOLE_EXACT = ("text_proven", "target_resolved")
ARMS = {
    "prefix": ["text_proven", "target_resolved", "prefix_proven"],
    "noprefix": ["text_proven", "target_resolved"],
}


def answer_index(record: dict[str, Any]) -> int:
    sid = str(record.get("id"))
    if not (sid.startswith("a") and sid[1:].isdigit()):
        raise SystemExit(f"record id {sid!r} is not calibrate_resolution's a<answer index>")
    return int(sid[1:])


def read(paths: list[Path]) -> list[dict[str, Any]]:
    by_id: dict[str, dict[str, Any]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                by_id[str(rec["id"])] = rec
    return sorted(by_id.values(), key=answer_index)


def tally(records: list[dict[str, Any]], accept: list[str] | None = None) -> dict[str, Any]:
    """Records by evidence; with `accept`, the rows, ids and loss tokens reaching training."""
    out: dict[str, Any] = {
        "records": len(records),
        "by_evidence": dict(sorted(Counter(evidence_of(r) for r in records).items())),
    }
    if accept is None:
        return out
    rungs = parse_accept(accept)
    rows = tokens = loss = output = 0
    per: Counter[str] = Counter()
    for rec in records:
        if not usable(rec, rungs):  # as extraction reads them
            continue
        ids, mask = training_ids(rec, rungs)
        rows += 1
        tokens += len(ids)
        loss += sum(mask)
        output += len(ids) - len(rec["prompt_ids"])
        per[evidence_of(rec)] += sum(mask)
    out.update(
        accept=list(rungs),
        rows=rows,
        tokens=tokens,
        output_tokens=output,
        loss_tokens=loss,
        loss_tokens_by_evidence=dict(sorted(per.items())),
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=Path, nargs="+", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--every", type=int, default=5, help="hold out every N-th distinct prompt")
    args = ap.parse_args()
    records = read(args.records)
    prompt_no: dict[tuple[int, ...], int] = {}
    for rec in records:  # in answer order: numbered by first answer
        prompt_no.setdefault(tuple(rec["prompt_ids"]), len(prompt_no))
    held_prompts = {p for p, k in prompt_no.items() if k % args.every == 0}
    held = [r for r in records if tuple(r["prompt_ids"]) in held_prompts]
    heldout = [r for r in held if evidence_of(r) in WHOLE_EXACT]
    train = [r for r in records if tuple(r["prompt_ids"]) not in held_prompts]
    assert not {r["id"] for r in heldout} & {r["id"] for r in train}
    for name, rows in (("heldout", heldout), ("train", train)):
        (args.out / name).mkdir(parents=True, exist_ok=True)
        with open(args.out / name / "records.jsonl", "w") as fh:
            for rec in rows:
                fh.write(json.dumps(rec) + "\n")
    sets = {
        "rule": (
            f"prompts numbered by first answer index; every {args.every}-th held out whole: "
            "its text_proven / target_resolved answers are the held-out rows, no answer to it "
            "is trained on"
        ),
        "records_in": [str(p) for p in args.records],
        "records": len(records),
        "prompts": len(prompt_no),
        "heldout_prompts": len(held_prompts),
        "heldout_prompts_records": tally(held),
        "heldout": tally(heldout, list(WHOLE_EXACT)),
        "train_records": tally(train),
        "arms": {arm: tally(train, accept) for arm, accept in ARMS.items()},
    }
    (args.out / "sets.json").write_text(json.dumps(sets, indent=2) + "\n")
    print(json.dumps(sets, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
