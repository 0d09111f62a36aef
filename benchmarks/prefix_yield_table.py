"""Tokens usable by default, before and after the `prefix_proven` rung (issue 33), on the
committed corpora: tests/fixtures/server_shapes (ids from the stacks' own code) and
tests/fixtures/live_vllm (a real vLLM serving scripted ids).

    KIMI_TOKENIZER_DIR=../shared/tokenizers/kimi-k2.5 python -m benchmarks.prefix_yield_table

Each record goes through the one reconstruction entry (RecordBuilder for server shapes, the
reconstruct stage's `reconstruct_line` for live vLLM, logprobs used where sent), under the
`unknown` profile and the declared one. Per variant and profile: completion tokens bought
(the ground truth's length, which every answer here was billed), exact tokens by default
BEFORE (engine_ids + text_proven records; the old accept set) and AFTER (plus the proven
prefixes), the prefix records, and silent: a prefix whose ids are not the ground truth's
first ids (must be 0). No target runs here: closed sets that target resolution would settle
whole count as prefixes, and the prefix split check (extraction) does not run.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks import live_vllm_counts
from kimi_pipe.config import compose
from kimi_pipe.core.evidence import PREFIX_PROVEN, evidence_of
from kimi_pipe.core.logprobs import LogprobPolicy
from kimi_pipe.core.models import load_model
from kimi_pipe.core.prefix import exact_output_tokens, training_ids
from kimi_pipe.core.record_builder import RecordBuilder
from kimi_pipe.core.serving import ServingProfile
from kimi_pipe.stages.reconstruct import reconstruct_line
from tests.support.server_shapes import SHAPES, declared_profile

ROOT = Path(__file__).resolve().parent.parent
LIVE = ROOT / "tests" / "fixtures" / "live_vllm"


def tally(record: dict[str, Any], truth: list[int]) -> Counter[str]:
    c: Counter[str] = Counter({"bought": len(truth)})
    rung = evidence_of(record)
    exact = exact_output_tokens(record)
    if rung in ("engine_ids", "text_proven"):
        c["before"] += exact
        c["after"] += exact
    elif rung == PREFIX_PROVEN:
        c["after"] += exact
        c["prefixes"] += 1
        ids, _ = training_ids(record)
        cut = ids[len(record["prompt_ids"]) :]
        c["silent"] += cut != truth[: len(cut)]
    return c


def cell(c: Counter[str]) -> str:
    if not c["bought"]:
        return "-"
    return (
        f"{100 * c['before'] / c['bought']:.1f} % -> {100 * c['after'] / c['bought']:.1f} % "
        f"({c['prefixes']} prefixes, {c['silent']} silent)"
    )


def main() -> int:
    model = load_model(compose([]).model)
    unknown = RecordBuilder(model, ServingProfile())
    print("| corpus / variant | records | tokens bought | `unknown`: exact by default before "
          "-> after | declared: before -> after |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    totals = {"unknown": Counter(), "declared": Counter()}
    for path in sorted(SHAPES.glob("*.jsonl")):
        counts = {"unknown": Counter(), "declared": Counter()}
        rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x]
        for r in rows:
            builders = {
                "unknown": unknown,
                "declared": RecordBuilder(model, declared_profile(r)),
            }
            for mode, builder in builders.items():
                record = builder.build(r["messages"], r.get("tools"), r["response"])
                counts[mode] += tally(dict(record), r["ground_truth_output_ids"])
        for mode in counts:
            totals[mode] += counts[mode]
        row = f"{cell(counts['unknown'])} | {cell(counts['declared'])}"
        bought = counts["unknown"]["bought"]
        print(f"| `{path.stem}` | {len(rows)} | {bought} | {row} |", flush=True)
    print(f"| server shapes, all | | {totals['unknown']['bought']} | {cell(totals['unknown'])} "
          f"| {cell(totals['declared'])} |")  # fmt: skip
    live = {"unknown": Counter(), "declared": Counter()}
    # Its answers name the server's own model name, which the corpus declares (without it
    # every live record is `other_model` and nothing here counts).
    model = load_model(compose([live_vllm_counts.SERVED_NAMES]).model)
    for path in sorted(LIVE.glob("*.jsonl")):
        counts = {"unknown": Counter(), "declared": Counter()}
        rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x]
        for row in rows:
            line = json.dumps({k: row[k] for k in ("id", "messages", "tools", "response")})
            policy = LogprobPolicy(requested=bool(row["settings"]["logprobs"]))
            profiles = {"unknown": None, "declared": live_vllm_counts.declared(row["settings"])}
            for mode, profile in profiles.items():
                rec = reconstruct_line(model, line, 1, 0, "live", policy, profile)
                counts[mode] += tally(rec, row["ground_truth_output_ids"])
        for mode in counts:
            live[mode] += counts[mode]
        row = f"{cell(counts['unknown'])} | {cell(counts['declared'])}"
        bought = counts["unknown"]["bought"]
        print(f"| live vLLM `{path.stem}` | {len(rows)} | {bought} | {row} |", flush=True)
    print(f"| live vLLM, all | | {live['unknown']['bought']} | {cell(live['unknown'])} "
          f"| {cell(live['declared'])} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
