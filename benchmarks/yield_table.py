"""Yield per variant on the committed corpora: the evidence ladder's counts.

    python -m benchmarks.yield_table        # or: make yield   (prints README's yield table)

Every record of tests/fixtures/server_shapes/*.jsonl (ground-truth ids from the stacks' own
code) and of tests/fixtures/kimi_k25_responses.jsonl (hand-written answers of a provider
that changes nothing) goes through the one reconstruction entry (core/record_builder.py),
under the default `unknown` profile and under the stack's declared profile. Columns:
  engine/text   ok: ids from whole-output logprobs / proven by text + profile + billing
  repaired      of those, ok with a repair note (a declared change undone, a one-option set)
  resolvable    not ok, with a closed candidate set of 2+ options (the target model decides)
  bounded       not ok, with an open set bounded by its gaps (core/gaps.py): the target
                decides, with what the gaps leave unlisted among each option's rivals
  open          not ok, with an open candidate set (never resolved)
  flagged       not ok, nothing enumerable
  silent        ok but not the ground truth (must be 0)
  set misses    a closed set without the ground truth among the sequences its options stand
                for, choice points' alternatives included, or a bounded one whose options and
                gaps do not cover it (`covers`; must be 0)
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

from kimi_pipe.config import compose  # noqa: E402
from kimi_pipe.core.models import Model, load_model  # noqa: E402
from kimi_pipe.core.record_builder import RecordBuilder  # noqa: E402
from kimi_pipe.core.serving import ServingProfile  # noqa: E402
from kimi_pipe.core.splits import Vocabulary  # noqa: E402
from kimi_pipe.extraction.split_check import vocabulary_of  # noqa: E402
from tests.support.candidate_sets import covers, sequences_of  # noqa: E402
from tests.support.server_shapes import SHAPES, declared_profile  # noqa: E402

HAND = ROOT / "tests" / "fixtures" / "kimi_k25_responses.jsonl"
COLUMNS = (
    "engine", "text", "repaired", "resolvable", "bounded", "open", "flagged", "silent", "misses"
)  # fmt: skip


def classify(record: dict[str, Any], truth: list[int] | None, vocab: Vocabulary) -> Counter[str]:
    counts: Counter[str] = Counter()
    if record["ok"]:
        counts["engine" if record["evidence"] == "engine_ids" else "text"] += 1
        counts["repaired"] += bool(record["issues"])
        counts["silent"] += truth is not None and record["output_ids"] != truth
        return counts
    cands = record.get("candidates")
    if cands is None:
        counts["flagged"] += 1
    elif not cands["closed"] and cands.get("gaps") is None:
        counts["open"] += 1
    elif not cands["closed"]:
        counts["bounded"] += 1
        counts["misses"] += truth is not None and not covers(cands, truth, vocab)
    else:
        counts["resolvable"] += 1
        counts["misses"] += truth is not None and tuple(truth) not in sequences_of(cands["options"])
    return counts


def hand_cases(model: Model) -> list[tuple[dict[str, Any], list[int] | None]]:
    cases = []
    for line in HAND.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        case = json.loads(line)
        expect = case["expect"]
        truth = expect.get("output_ids")
        if truth is None and expect.get("output_text") is not None:
            truth = model.tokenizer.encode_with_markers(expect["output_text"])
        cases.append((case, truth))
    return cases


def cell(c: Counter[str]) -> str:
    return " / ".join(str(c[k]) for k in COLUMNS)


def main() -> int:
    model = load_model(compose([]).model)
    unknown = RecordBuilder(model, ServingProfile())
    vocab = vocabulary_of(model.tokenizer)
    header = " / ".join(COLUMNS)
    print(f"| corpus / variant | records | `unknown`: {header} | declared: {header} |")
    print("| --- | --- | --- | --- |")
    totals = {"unknown": Counter(), "declared": Counter()}
    hand: Counter[str] = Counter()
    cases = hand_cases(model)
    for case, truth in cases:
        record = unknown.build(case["messages"], case.get("tools"), case["response"])
        hand += classify(record, truth, vocab)
    print(f"| hand-written, faithful (`kimi_k25_responses`) | {len(cases)} | {cell(hand)} | - |")
    for path in sorted(SHAPES.glob("*.jsonl")):
        counts = {"unknown": Counter(), "declared": Counter()}
        rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x]
        for r in rows:
            builders = {"unknown": unknown, "declared": RecordBuilder(model, declared_profile(r))}
            for mode, builder in builders.items():
                record = builder.build(r["messages"], r.get("tools"), r["response"])
                counts[mode] += classify(record, r["ground_truth_output_ids"], vocab)
        for mode in counts:
            totals[mode] += counts[mode]
        print(f"| `{path.stem}` | {len(rows)} | {cell(counts['unknown'])} "
              f"| {cell(counts['declared'])} |")  # fmt: skip
    records = sum(
        totals["unknown"][k] for k in ("engine", "text", "resolvable", "bounded", "open", "flagged")
    )
    print(f"| server shapes, all | {records} | {cell(totals['unknown'])} "
          f"| {cell(totals['declared'])} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
