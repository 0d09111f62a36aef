"""The routing the report recommends: which providers a policy keeps, in which order, and why."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import yaml

from kimi_pipe.core.issue_codes import Code
from kimi_pipe.reporting.formatting import counter_text, fmt_num, fmt_pct, fmt_usd, pct
from kimi_pipe.reporting.stats import UNKNOWN, RunStats


@dataclass(frozen=True)
class Policy:
    """Thresholds that decide which providers the recommended routing keeps."""

    min_ok_rate: float = 0.95  # share of answered requests whose ids agree with billing
    max_error_rate: float = 0.10  # share of requests that ended in an error
    min_tool_valid_rate: float = 0.95  # share of tool calls that parse and match the schema
    # Quantisations unfit for training data (case-insensitive; "unknown" is kept). A run's
    # own `provider.routing.quantizations` allow-list applies too; the model's native
    # quantisation belongs there (e.g. int4 for a model trained quantisation-aware).
    ignore_quantizations: tuple[str, ...] = ("fp4", "nvfp4", "mxfp4", "fp6")
    # ok rates within this of the best one rank as equal to it, so one noisy sample of 50
    # does not outweigh a large price or speed difference.
    rank_step: float = 0.02


@dataclass
class Recommendation:
    order: list[str]
    ignore: list[str]
    reasons: dict[str, str]  # provider slug -> why it is where it is


def exclusion_reasons(s: RunStats, policy: Policy) -> list[str]:
    out: list[str] = []
    if not s.answered:
        out.append("no answered requests")
    elif s.ok_rate is not None and s.ok_rate < policy.min_ok_rate:
        out.append(
            f"reconstruction ok rate {s.ok_rate:.0%} < {policy.min_ok_rate:.0%} "
            f"(billing drift {fmt_pct(s.drift_total_pct)})"
        )
    if s.error_rate is not None and s.error_rate > policy.max_error_rate:
        out.append(f"error rate {s.error_rate:.0%} > {policy.max_error_rate:.0%}")
    if s.tool_valid_rate is not None and s.tool_valid_rate < policy.min_tool_valid_rate:
        out.append(f"tool-call validity {s.tool_valid_rate:.0%} < {policy.min_tool_valid_rate:.0%}")
    ignored_q = {q.lower() for q in policy.ignore_quantizations}
    reported = set(s.quantization.split("/")) - {UNKNOWN}
    if reported & ignored_q:
        out.append(f"quantisation {s.quantization} is in the ignore list")
    elif s.allowed_quantizations and reported - set(s.allowed_quantizations):
        out.append(
            f"quantisation {s.quantization} is not in the run's allow-list "
            f"{list(s.allowed_quantizations)}"
        )
    return out


def rank_key(s: RunStats, policy: Policy, best: dict[str, float]) -> tuple[float, ...]:
    """Fidelity first, then reliability, then price, then speed (smaller sorts first).

    A fidelity rate within `rank_step` of the best one counts as equal to it, so one noisy
    sample in 50 does not outweigh a large price or speed difference.
    """

    def shortfall(name: str) -> float:
        rate = _quality(s)[name]
        return 0.0 if rate >= best[name] - policy.rank_step - 1e-9 else best[name] - rate

    return (
        shortfall("ok"),
        shortfall("tool"),
        shortfall("clean"),
        s.error_rate or 0.0,
        s.retry_rate or 0.0,
        s.usd_per_mtok if s.usd_per_mtok is not None else math.inf,
        -(s.median_tokens_per_s or 0.0),
        s.p95_latency if s.p95_latency is not None else math.inf,
    )


def _quality(s: RunStats) -> dict[str, float]:
    """Higher-is-better fidelity rates used for ranking."""
    return {"ok": s.ok_rate or 0.0, "tool": _tool_rate(s), "clean": s.clean_rate or 0.0}


def _tool_rate(s: RunStats) -> float:
    return s.tool_valid_rate if s.tool_valid_rate is not None else 1.0  # no calls: no fault


def recommend(stats: list[RunStats], policy: Policy) -> Recommendation:
    reasons: dict[str, str] = {}
    kept: list[RunStats] = []
    ignore: list[str] = []
    for s in stats:
        why = exclusion_reasons(s, policy)
        if why:
            ignore.append(s.provider)
            reasons[s.provider] = "ignored: " + "; ".join(why)
        else:
            kept.append(s)
    best = {k: max((_quality(s)[k] for s in kept), default=0.0) for k in ("ok", "tool", "clean")}

    def key(s: RunStats) -> tuple[float, ...]:
        return rank_key(s, policy, best)

    kept.sort(key=key)
    for i, s in enumerate(kept):
        reasons[s.provider] = f"rank {i + 1}: " + _strengths(s, kept[i - 1] if i else None, key)
    return Recommendation(
        order=_unique(s.provider for s in kept), ignore=_unique(ignore), reasons=reasons
    )


def conformance_exclusions(conformance: dict[str, Any] | None) -> dict[str, str]:
    """Providers whose probes saw a quirk no serving profile can undo -> why
    (`conformance.json` of the probe stage)."""
    return {
        str(p["provider"]): f"ignored: conformance probes: {p.get('why')}"
        for p in (conformance or {}).get("providers") or []
        if not p.get("usable")
    }


def recommend_with_conformance(
    stats: list[RunStats], policy: Policy, conformance: dict[str, Any] | None
) -> Recommendation:
    """The recommendation over the providers the probes allow; the serving profile named
    for the rest. Without probes it is `recommend` unchanged."""
    if conformance is None:
        return recommend(stats, policy)
    excluded = conformance_exclusions(conformance)
    profiles = {str(p["provider"]): p.get("profile") for p in conformance.get("providers") or []}
    rec = recommend([s for s in stats if s.provider not in excluded], policy)
    reasons = dict(rec.reasons)
    for provider in rec.order:
        profile = profiles.get(provider)
        reasons[provider] += f"; serving profile {profile}" if profile else "; not probed"
    ignore = list(rec.ignore)
    for s in stats:
        if s.provider in excluded:
            ignore.append(s.provider)
            reasons[s.provider] = excluded[s.provider]
    return Recommendation(order=rec.order, ignore=_unique(ignore), reasons=reasons)


def _strengths(s: RunStats, better: RunStats | None, key: Any) -> str:
    head = (
        f"ok {fmt_pct(pct(s.ok_rate))}, errors {fmt_pct(pct(s.error_rate))}, "
        f"retries {fmt_pct(pct(s.retry_rate))}, {fmt_usd(s.usd_per_mtok)}/M output tokens, "
        f"{fmt_num(s.median_tokens_per_s)} tok/s"
    )
    if better is None:
        return head + " (best on fidelity, then issue codes, errors, retries, price and speed)"
    mine, theirs = key(s), key(better)
    diff = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), -1)
    why = {
        0: f"lower ok rate, {fmt_pct(pct(s.ok_rate))} vs {fmt_pct(pct(better.ok_rate))}",
        1: f"fewer valid tool calls, {fmt_pct(pct(s.tool_valid_rate))} vs "
        f"{fmt_pct(pct(better.tool_valid_rate))}",
        2: f"more samples with issue codes, {fmt_pct(pct(1 - (s.clean_rate or 0)))} vs "
        f"{fmt_pct(pct(1 - (better.clean_rate or 0)))} ({counter_text(s.issues)})",
        3: f"more errors, {fmt_pct(pct(s.error_rate))} vs {fmt_pct(pct(better.error_rate))}",
        4: f"more retries, {fmt_pct(pct(s.retry_rate))} vs {fmt_pct(pct(better.retry_rate))}",
        5: f"dearer, {fmt_usd(s.usd_per_mtok)} vs {fmt_usd(better.usd_per_mtok)} per M tokens",
        6: f"slower, {fmt_num(s.median_tokens_per_s)} vs "
        f"{fmt_num(better.median_tokens_per_s)} tok/s",
        7: f"higher p95 latency, {fmt_num(s.p95_latency, 2)} vs {fmt_num(better.p95_latency, 2)} s",
    }.get(diff, "tied on every measure")
    return head + f" (behind {better.provider}: {why})"


# The target's resolution rate of closed candidate sets measured on the 500-answer calibration
# (docs/yield.md: 197 of 254 resolved): a rate carried over, not a measurement on the run.
CALIBRATED_RESOLUTION_RATE = 197 / 254


@dataclass(frozen=True)
class ProviderYield:
    """What one provider's answers are worth as training data."""

    provider: str
    answers: int
    cost_usd: float
    expected_exact_tokens: float  # proven tokens + resolvable tokens x the resolution rate
    unexplained_billing: int = 0  # answers whose prompt and completion bills fit no reading

    @property
    def exact_tokens_per_usd(self) -> float | None:
        return self.expected_exact_tokens / self.cost_usd if self.cost_usd > 0 else None


def run_yield_of(s: RunStats) -> ProviderYield:
    """A generate run's ProviderYield from its stats (token_yield: proven tokens accepted,
    tokens of closed candidate sets; the issue counts: bills that fit no reading)."""
    block = s.token_yield or {}
    proven = float(block.get("exact_accepted") or 0)
    resolvable = float(block.get("resolvable_tokens") or 0)
    return ProviderYield(
        provider=s.provider,
        answers=s.answered,
        cost_usd=s.cost_usd or 0.0,
        expected_exact_tokens=proven + CALIBRATED_RESOLUTION_RATE * resolvable,
        unexplained_billing=min(
            s.issues.get(Code.PROMPT_UNPROVEN, 0), s.issues.get(Code.BILLING_MISMATCH, 0)
        ),
    )


def route_by_exact_tokens(
    yields: Iterable[ProviderYield], *, max_unexplained_share: float = 0.5
) -> Recommendation:
    """`only`: the providers in order of expected exact tokens per dollar, best first;
    `ignore`: those with no exact token, no known cost, or bills that mostly fit no reading
    (more than `max_unexplained_share` of their answers: nothing explains what they charge)."""
    kept: list[ProviderYield] = []
    ignore: list[str] = []
    reasons: dict[str, str] = {}
    for y in yields:
        if y.answers and y.unexplained_billing / y.answers > max_unexplained_share:
            ignore.append(y.provider)
            reasons[y.provider] = (
                f"ignored: billing nothing explains ({y.unexplained_billing} of {y.answers} "
                "answers: prompt and completion bills fit no reading)"
            )
        elif not y.expected_exact_tokens or y.exact_tokens_per_usd is None:
            ignore.append(y.provider)
            reasons[y.provider] = "ignored: no exact token expected (or no cost known)"
        else:
            kept.append(y)
    kept.sort(key=lambda y: -(y.exact_tokens_per_usd or 0.0))
    for rank, y in enumerate(kept, start=1):
        reasons[y.provider] = (
            f"rank {rank}: {y.exact_tokens_per_usd:,.0f} expected exact tokens per $ "
            f"({y.expected_exact_tokens:,.0f} tokens for {fmt_usd(y.cost_usd)})"
        )
    return Recommendation(
        order=_unique(y.provider for y in kept), ignore=_unique(ignore), reasons=reasons
    )


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def routing_block(rec: Recommendation) -> str:
    """YAML to paste into the generate provider config."""
    block = {
        "provider": {
            "order": rec.order,
            "ignore": rec.ignore,
            # Pinning only pays off if OpenRouter may not fall back to an ignored vendor.
            "allow_fallbacks": False,
        }
    }
    return yaml.safe_dump(block, sort_keys=False, default_flow_style=None).rstrip()


def routing_overrides(rec: Recommendation, prefix: str = "provider.routing") -> str:
    """Hydra overrides that put the recommendation into the generate provider config."""

    def as_list(items: list[str]) -> str:
        return "[" + ",".join(items) + "]"

    return (
        f"{prefix}.order='{as_list(rec.order)}' {prefix}.ignore='{as_list(rec.ignore)}' "
        f"{prefix}.allow_fallbacks=false"
    )
