"""Yield in the wild: real recorded Kimi K2.5 answers, per provider (README "In the wild").

    python -m benchmarks.wild_yield [--json docs/measured/wild_yield.json]

Every answer of tests/fixtures/wild/kimi_k25_wild.jsonl (public test recordings, provenance
per row: docs/wild.md) goes through the one reconstruction entry (core/record_builder.py)
under the default `unknown` profile, as `reconstruct` and `generate` run it. Per provider:
  proven       ok: ids proven by text, profile and bill
  resolvable   not ok, a closed (or bounded) candidate set extraction's target resolution takes
               (core/resolvability.resolvable, with the default resolve.max_options)
  lost         neither; the codes say why (every blocking one, notes left out: `lost_because`),
               and how many ids of them a proven prefix keeps
               (`prefix_proven`: an open set whose doubts lie only after the reasoning's text,
               core/prefix.py; cut like every prefix and weighed again by extraction's prefix
               split check, so not counted in `expected`)
  expected     exact tokens expected: proven tokens + resolvable tokens x the target's
               resolution rate measured on the 500-answer calibration (docs/yield.md: 197 of
               254 closed sets resolved, SmolLM2 as its own target). A rate, not a measurement
               on these answers: no Kimi K2.5 runs here.
  $/exact      the answers' billed cost (usage.cost) over the expected exact tokens
Then the routing that maximises exact tokens per dollar (reporting/recommend.py), and the
providers whose billing nothing explains, with their evidence; each provider's reasoning counts
against its records' ids (`reasoning_count_delta`: SGLang's count is +1), and how many of its
answers reach training under each shipped profile. And the other Kimi models'
answers (other_kimi_wild.jsonl.gz): how many come out `ok` under each shipped profile (0).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kimi_pipe.config import compose
from kimi_pipe.core.models import load_model
from kimi_pipe.core.prefix import exact_output_tokens
from kimi_pipe.core.record_builder import RecordBuilder
from kimi_pipe.core.resolvability import blocking_issues, covered_codes, resolvable
from kimi_pipe.core.serving import ServingProfile, serving_profile
from kimi_pipe.extraction.resolve_settings import ResolveSettings
from kimi_pipe.reporting.recommend import ProviderYield, route_by_exact_tokens

ROOT = Path(__file__).resolve().parent.parent
WILD = ROOT / "tests" / "fixtures" / "wild"
# docs/yield.md: 197 of 254 closed sets resolved by the target on the 500-answer calibration.
CALIBRATED_RESOLUTION_RATE = 197 / 254
PROFILES = ("unknown", "exact", "moonshot", "vllm_0_33", "sglang_0_5_23")
MAX_OPTIONS = ResolveSettings().max_options  # the target scores no larger set by default


def profile(name: str) -> ServingProfile:
    return serving_profile(compose([f"serving={name}"]))


def rows(name: str) -> list[dict[str, Any]]:
    path = WILD / name
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:  # type: ignore[operator]
        return [json.loads(line) for line in handle if line.strip()]


def build(builder: RecordBuilder, row: dict[str, Any]) -> dict[str, Any]:
    request = row["request"]
    return dict(builder.build(request["messages"], request.get("tools"), row["response"], request))


def fate(record: dict[str, Any]) -> str:
    """As extraction sees the record: proven, or one its target resolution takes
    (core/resolvability.resolvable: a closed or bounded set of at most the default
    resolve.max_options options and nothing else blocking), or lost."""
    if record["ok"]:
        return "proven"
    return "resolvable" if resolvable(record, max_options=MAX_OPTIONS) is None else "lost"


def lost_because(record: Mapping[str, Any]) -> list[str]:
    """The codes that lose a record, as extraction weighs them: the blocking ones its
    candidate set does not account for (a bill no reading fits); where there are none, the
    set's own (an open set: the ambiguities it could not list). Notes never."""
    cands = record.get("candidates")
    blocking = blocking_issues(record.get("issues") or [])
    covered = covered_codes(cands) if isinstance(cands, Mapping) else frozenset()
    return sorted(blocking - covered) or sorted(blocking)


def reasoning_count_delta(model: Any, record: Mapping[str, Any], usage: Any) -> int | None:
    """The billed `completion_tokens_details.reasoning_tokens` less the record's ids before its
    think-end (a `<think>` the model wrote not counted): SGLang 0.5.23 counts through the
    think-end (+1); a count of the reasoning's ids alone is 0. None without a count or a
    think-end."""
    details = usage.get("completion_tokens_details") if isinstance(usage, Mapping) else None
    billed = details.get("reasoning_tokens") if isinstance(details, Mapping) else None
    end = model.format.output.think_end
    ids = record.get("output_ids") or []
    if type(billed) is not int or end is None or model.markers[end] not in ids:
        return None
    before = ids.index(model.markers[end])
    opening = model.format.prompt.generation_open
    lead = list(model.constant_ids(opening)) if opening is not None else []
    if lead and ids[: len(lead)] == lead:
        before -= len(lead)
    return billed - before


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model = load_model(compose([]).model)
    unknown = RecordBuilder(model)
    per: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"answers": 0, "tokens": 0, "cost": 0.0, "fates": Counter(), "lost": Counter()}
    )
    per_fate_tokens: dict[str, Counter[str]] = defaultdict(Counter)
    unexplained: dict[str, list[str]] = defaultdict(list)
    counts: dict[str, Counter[int]] = defaultdict(Counter)
    wild = rows("kimi_k25_wild.jsonl")
    for row in wild:
        record = build(unknown, row)
        usage = row["response"].get("usage") or {}
        delta = reasoning_count_delta(model, record, usage)
        if delta is not None:
            counts[row["provider"]][delta] += 1
        tokens = int(usage.get("completion_tokens") or 0)
        cell = per[row["provider"]]
        cell["answers"] += 1
        cell["tokens"] += tokens
        cell["cost"] += float(usage.get("cost") or 0.0)
        kind = fate(record)
        cell["fates"][kind] += 1
        per_fate_tokens[row["provider"]][kind] += tokens
        if kind == "lost":
            cell["lost"].update(lost_because(record))
            if record.get("evidence") == "prefix_proven":
                per_fate_tokens[row["provider"]]["lost_prefix"] += exact_output_tokens(record)
        if "prompt_unproven" in record["issues"] and "billing_mismatch" in record["issues"]:
            unexplained[row["provider"]].append(
                f"{row['id']}: prompt billed {usage.get('prompt_tokens')} vs "
                f"{len(record['prompt_ids'])} rendered, completion billed {tokens} vs "
                f"{record['completion_tokens_reconstructed']} read"
            )
    print("| provider | answers | completion tokens | proven by text | resolvable by the target "
          "| lost (why) | expected exact tokens | $ per exact token |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    yields = []
    out: dict[str, Any] = {"providers": {}, "resolution_rate": CALIBRATED_RESOLUTION_RATE}
    for name, cell in sorted(per.items(), key=lambda kv: -kv[1]["answers"]):
        tokens = per_fate_tokens[name]
        expected = tokens["proven"] + CALIBRATED_RESOLUTION_RATE * tokens["resolvable"]
        per_token = cell["cost"] / expected if expected else None
        why = ", ".join(f"{c} {n}" for c, n in cell["lost"].most_common())
        kept = (
            f"; {tokens['lost_prefix']:,} tok kept as a proven prefix"
            if tokens["lost_prefix"]
            else ""
        )
        print(
            f"| {name} | {cell['answers']} | {cell['tokens']:,} "
            f"| {cell['fates']['proven']} ({tokens['proven']:,} tok) "
            f"| {cell['fates']['resolvable']} ({tokens['resolvable']:,} tok) "
            f"| {cell['fates']['lost']} ({tokens['lost']:,} tok{kept}){': ' + why if why else ''} "
            f"| {expected:,.0f} | {f'${per_token * 1e6:.2f}/M' if per_token else 'none'} |"
        )
        yields.append(
            ProviderYield(
                provider=name,
                answers=cell["answers"],
                cost_usd=cell["cost"],
                expected_exact_tokens=expected,
                unexplained_billing=len(unexplained[name]),
            )
        )
        out["providers"][name] = {
            "answers": cell["answers"],
            "completion_tokens": cell["tokens"],
            "fates": dict(cell["fates"]),
            "fate_tokens": dict(tokens),
            "lost_codes": dict(cell["lost"]),
            "cost_usd": cell["cost"],
            "expected_exact_tokens": expected,
            "usd_per_exact_token": per_token,
            "unexplained_billing": list(unexplained[name]),
        }
    total = sum(c["tokens"] for c in per.values())
    reach = sum(t["proven"] + t["resolvable"] for t in per_fate_tokens.values())
    answers = sum(c["answers"] for c in per.values())
    reached = sum(c["fates"]["proven"] + c["fates"]["resolvable"] for c in per.values())
    kept_total = sum(t["lost_prefix"] for t in per_fate_tokens.values())
    print(f"\n{reached} of {answers} answers reach training ({reach:,} of {total:,} tokens)")
    print(f"lost answers' ids kept as proven prefixes: {kept_total:,}")
    routing = route_by_exact_tokens(yields)
    print("\nrouting by exact tokens per dollar:")
    print(f"  provider.routing.only={routing.order}")
    print(f"  provider.routing.ignore={routing.ignore}")
    for provider, why in routing.reasons.items():
        print(f"  {provider}: {why}")
    for provider, evidence in unexplained.items():
        if not evidence:
            continue
        print(f"\nbilling nothing explains, {provider} ({len(evidence)} answers):")
        for line in evidence:
            print(f"  {line}")
    print("\nreasoning counts, billed less the ids before the think-end (SGLang's count: +1):")
    for provider, deltas in sorted(counts.items()):
        spread = ", ".join(f"{d:+d} x{n}" for d, n in sorted(deltas.items()))
        print(f"  {provider}: {sum(deltas.values())} answers: {spread}")
    # What declaring each shipped profile for a provider would give: answers reaching training.
    # More is not better by itself (a profile that declares nothing changed proves most): the
    # stack's own evidence (probes, the counts above) says which profile is its.
    builders = {name: RecordBuilder(model, profile(name)) for name in PROFILES}
    reach_by_profile: dict[str, dict[str, int]] = defaultdict(dict)
    for name, builder in builders.items():
        reached_here: Counter[str] = Counter()
        for row in wild:
            reached_here[row["provider"]] += fate(build(builder, row)) != "lost"
        for provider, n in reached_here.items():
            reach_by_profile[provider][name] = n
    print("\nanswers reaching training under each shipped profile:")
    for provider, by_name in sorted(reach_by_profile.items()):
        print(f"  {provider} ({per[provider]['answers']}): {by_name}")
    other = rows("other_kimi_wild.jsonl.gz")
    ok_by_profile = {}
    for name, builder in builders.items():
        ok_by_profile[name] = sum(build(builder, row)["ok"] for row in other)
    print(f"\nother Kimi models' answers ({len(other)}): ok under each profile {ok_by_profile}")
    out.update(
        reached=reached,
        answers=answers,
        tokens_reached=reach,
        lost_prefix_tokens=kept_total,
        tokens=total,
        routing={"only": routing.order, "ignore": routing.ignore, "reasons": routing.reasons},
        other_models={"answers": len(other), "ok_by_profile": ok_by_profile},
        reasoning_count_deltas={p: dict(sorted(d.items())) for p, d in sorted(counts.items())},
        reached_by_profile=dict(sorted(reach_by_profile.items())),
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
