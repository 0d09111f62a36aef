"""Yield per variant of the live-vLLM corpus (tests/fixtures/live_vllm), as a markdown table.

    KIMI_TOKENIZER_DIR=../shared/tokenizers/kimi-k2.5 python -m benchmarks.live_vllm_counts

Every record goes through the reconstruct stage's own `reconstruct_line` (logprobs used where
the server sent them) under the default `unknown` profile and under the declared vLLM profile
(`vllm_0_33`, `marker_spacing=none` without spaces_between_special_tokens). Counted: exact
(ok, no note), repaired (ok with notes), flagged (ok false), silent (ok with ids that are not
the ground truth: must be 0), the ladder's rungs: engine_ids (logprobs covered and
confirmed the whole output), text_proven (ok on text + profile + billing), unresolved, and
the candidate sets (core/candidates.py) of the text-only reconstructions that are flagged:
closed sets that hold the ground truth / closed sets / open sets.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

from kimi_pipe.config import compose  # noqa: E402
from kimi_pipe.core.candidates import enumerate_candidates  # noqa: E402
from kimi_pipe.core.logprobs import LogprobPolicy  # noqa: E402
from kimi_pipe.core.models import load_model  # noqa: E402
from kimi_pipe.core.reconstruction import reconstruct  # noqa: E402
from kimi_pipe.core.serving import UNKNOWN_PROFILE, ServingProfile, serving_profile  # noqa: E402
from kimi_pipe.stages.reconstruct import reconstruct_line  # noqa: E402

# The corpus server's --served-model-name, declared as its user would.
SERVED_NAMES = "model.served_names=[moonshotai/kimi-k2.5,kimi-live]"

LIVE = ROOT / "tests" / "fixtures" / "live_vllm"
DECLARED = "vllm_0_33"


@cache
def shipped(name: str) -> ServingProfile:
    return serving_profile(compose([f"serving={name}"]))


def declared(settings: Mapping[str, Any]) -> ServingProfile:
    profile = shipped(DECLARED)
    if not settings["spaces_between_special_tokens"]:
        profile = replace(profile, marker_spacing="none")
    return profile


def candidate_cells(model: Any, row: Mapping[str, Any], profile: ServingProfile) -> Counter[str]:
    args = (row["messages"], row["tools"], row["response"])
    rec = reconstruct(model, *args, serving=profile)
    if rec.ok:
        return Counter()
    found = enumerate_candidates(model, *args, rec, profile=profile)
    if found is None:
        return Counter()
    if not found.closed:
        return Counter({"open": 1})
    truth = row["ground_truth_output_ids"] in [o.output_ids for o in found.options]
    return Counter({"closed": 1, "closed_truth": int(truth)})


def rung(record: Mapping[str, Any]) -> str:
    """The ladder rung by the rule of LADDER.md: ok with whole, confirmed logprobs is
    engine_ids; other ok records are text_proven; the rest unresolved."""
    if not record["ok"]:
        return "unresolved"
    logprobs = record.get("logprobs")
    whole = (
        isinstance(logprobs, Mapping)
        and logprobs.get("coverage") == "whole"
        and "mismatch" not in logprobs
        and "invalid" not in logprobs
    )
    sources = record.get("id_sources") or []
    confirmed = any(
        isinstance(s, Sequence) and len(s) == 3 and s[2] in ("confirmed", "engine") for s in sources
    )
    return "engine_ids" if whole and confirmed else "text_proven"


def main() -> int:
    model = load_model(compose([SERVED_NAMES]).model)
    print(
        "| variant | records | engine ids = truth | `unknown`: exact / repaired / flagged / "
        "silent | declared: exact / repaired / flagged / silent | declared: engine_ids / "
        "text_proven / unresolved | text-proven share (declared) | candidate sets `unknown`: "
        "closed with truth / closed / open | declared: same |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in sorted(LIVE.glob("*.jsonl")):
        rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x]
        counts: dict[str, Counter[str]] = {"unknown": Counter(), "declared": Counter()}
        rungs: Counter[str] = Counter()
        sets: dict[str, Counter[str]] = {"unknown": Counter(), "declared": Counter()}
        engine_exact = 0
        for row in rows:
            engine_exact += row["engine_output_ids"] == row["ground_truth_output_ids"]
            sets["unknown"] += candidate_cells(model, row, UNKNOWN_PROFILE)
            sets["declared"] += candidate_cells(model, row, declared(row["settings"]))
            line = json.dumps({k: row[k] for k in ("id", "messages", "tools", "response")})
            policy = LogprobPolicy(requested=bool(row["settings"]["logprobs"]))
            for mode, profile in (("unknown", None), ("declared", declared(row["settings"]))):
                rec = reconstruct_line(model, line, 1, 0, "live", policy, profile)
                if not rec["ok"]:
                    counts[mode]["flagged"] += 1
                else:
                    counts[mode]["repaired" if rec["issues"] else "exact"] += 1
                    counts[mode]["silent"] += rec["output_ids"] != row["ground_truth_output_ids"]
                if mode == "declared":
                    rungs[rung(rec)] += 1
        keys = ("exact", "repaired", "flagged", "silent")
        cell = {m: " / ".join(str(c[k]) for k in keys) for m, c in counts.items()}
        ladder = " / ".join(str(rungs[k]) for k in ("engine_ids", "text_proven", "unresolved"))
        share = f"{100 * rungs['text_proven'] / len(rows):.0f} %"
        sets_cell = {
            m: " / ".join(str(c[k]) for k in ("closed_truth", "closed", "open"))
            for m, c in sets.items()
        }
        print(
            f"| `{path.stem}` | {len(rows)} | {engine_exact} | {cell['unknown']} "
            f"| {cell['declared']} | {ladder} | {share} | {sets_cell['unknown']} "
            f"| {sets_cell['declared']} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
