"""What each finished generate run measured: fidelity (evidence rungs, issue codes, billing
drift), tool-call validity, cost, speed, errors and retries, and its yield in tokens.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kimi_pipe.core.evidence import UNRESOLVED, evidence_of, parse_accept
from kimi_pipe.core.issue_codes import COST_BELOW_LISTED_PRICE, NONCANONICAL_SPLIT
from kimi_pipe.core.resolvability import resolvable
from kimi_pipe.core.token_yield import completion_tokens_bought, token_yield
from kimi_pipe.extraction.resolve_settings import ResolveSettings
from kimi_pipe.reporting.runs import Run

# Notes that prove a record exact rather than doubt it (core/logprobs.py).
# Codes that are no fidelity fault: evidence of exact ids, or notes about money only.
EXACTNESS_EVIDENCE = frozenset({NONCANONICAL_SPLIT, COST_BELOW_LISTED_PRICE})
UNKNOWN = "unknown"


# --------------------------------------------------------------------------- tool calls


def tool_calls_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        calls = record["response"]["choices"][0]["message"].get("tool_calls")
    except (KeyError, IndexError, TypeError, AttributeError):
        return []
    return [c for c in calls or [] if isinstance(c, dict)]


def tool_call_problem(call: dict[str, Any], tools: list[dict[str, Any]] | None) -> str | None:
    """Why a tool call is unusable, or None when its arguments are JSON matching the schema."""
    import jsonschema  # optional: the `report` extra (a light install reads no tool calls)

    fn = call.get("function") or {}
    name = fn.get("name")
    schemas = {
        t["function"]["name"]: t["function"].get("parameters") or {}
        for t in tools or []
        if isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]
    }
    if name not in schemas:
        return "unknown_function"
    raw = fn.get("arguments")
    if isinstance(raw, str):
        try:
            args = json.loads(raw)
        except json.JSONDecodeError:
            return "arguments_not_json"
    else:
        args = raw  # some providers hand back a parsed object
    if not isinstance(args, dict):
        return "arguments_not_object"
    try:
        jsonschema.validate(args, schemas[name])
    except jsonschema.ValidationError:
        return "schema_mismatch"
    except jsonschema.SchemaError:
        return "bad_declared_schema"
    return None


# --------------------------------------------------------------------------- statistics


@dataclass
class RunStats:
    name: str
    provider: str  # OpenRouter provider slug for the routing block
    served_by: str  # provider name(s) the answers report
    quantization: str
    allowed_quantizations: tuple[str, ...] | None  # the run's routing allow-list, if any
    requests: int
    answered: int
    ok: int
    errors: int
    retried: int
    mean_attempts: float
    failed_attempts: int = 0  # lines of attempt_errors.jsonl
    stop_reason: str = UNKNOWN  # summary.json: done, budget_usd, payment_required, ...
    error_classes: Counter[str] = field(default_factory=Counter)
    issues: Counter[str] = field(default_factory=Counter)
    drift_pct: list[float] = field(default_factory=list)  # per answered sample
    drift_tokens: int = 0  # sum(reconstructed) - sum(reported)
    reported_tokens: int = 0
    with_issues: int = 0  # answered records with any issue code (errors or notes)
    tool_calls: int = 0
    tool_calls_valid: int = 0
    tool_problems: Counter[str] = field(default_factory=Counter)
    cost_usd: float | None = None
    latencies: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    # Token-level evidence (records' `logprobs`, kimi_pipe/core/logprobs.py)
    logprob_answers: int = 0  # answers that carried logprobs
    logprob_agree: int = 0  # ... whose engine tokens join to the answer text
    logprob_coverage: Counter[str] = field(default_factory=Counter)  # whole / content
    bad_lines: int = 0
    evidence: Counter[str] = field(default_factory=Counter)  # answered records per ladder rung
    # Completion tokens bought, exact per rung, cost per exact token (core/token_yield.py).
    token_yield: dict[str, Any] = field(default_factory=dict)

    @property
    def ok_rate(self) -> float | None:
        return self.ok / self.answered if self.answered else None

    @property
    def clean_rate(self) -> float | None:
        """Share of answered records without any issue code, notes included."""
        return 1.0 - self.with_issues / self.answered if self.answered else None

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    @property
    def retry_rate(self) -> float | None:
        return self.retried / self.requests if self.requests else None

    @property
    def attempt_failure_rate(self) -> float | None:
        """Failed attempts / all attempts (each answered record had one that worked)."""
        total = self.failed_attempts + self.answered
        return self.failed_attempts / total if total else None

    @property
    def tool_valid_rate(self) -> float | None:
        return self.tool_calls_valid / self.tool_calls if self.tool_calls else None

    @property
    def drift_total_pct(self) -> float | None:
        if not self.reported_tokens:
            return None
        return 100.0 * self.drift_tokens / self.reported_tokens

    @property
    def drift_samples(self) -> int:
        return sum(1 for d in self.drift_pct if d != 0)

    @property
    def usd_per_mtok(self) -> float | None:
        if self.cost_usd is None or not self.reported_tokens:
            return None
        return 1e6 * self.cost_usd / self.reported_tokens

    @property
    def p50_latency(self) -> float | None:
        return percentile(self.latencies, 50)

    @property
    def p95_latency(self) -> float | None:
        return percentile(self.latencies, 95)

    @property
    def median_tokens_per_s(self) -> float | None:
        return statistics.median(self.tokens_per_s) if self.tokens_per_s else None


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _dig(obj: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _routing(config: dict[str, Any]) -> dict[str, Any]:
    """The OpenRouter routing object of a run's provider config, wherever it is nested."""
    prov = config.get("provider") or {}
    for candidate in (_dig(prov, "routing"), _dig(prov, "extra_body", "provider"), prov):
        if isinstance(candidate, dict) and ("order" in candidate or "only" in candidate):
            return candidate
    return {}


def provider_slug(run: Run, served: Counter[str]) -> str:
    """The slug for `order`/`ignore`: the pinned one (run config, else the requests the
    records carry), else the one provider that answered, else the directory name."""
    candidates = [_routing(run.config)]
    candidates += [_dig(r, "request", "extra_body", "provider") for r in run.records[:1]]
    for routing in candidates:
        for key in ("order", "only"):
            pinned = routing.get(key) if isinstance(routing, dict) else None
            if isinstance(pinned, list) and len(pinned) == 1 and isinstance(pinned[0], str):
                return pinned[0]
    if len(served) == 1:
        return next(iter(served))
    return run.path.name


def quantization_of(run: Run) -> str:
    """Quantisation the provider reports (response), else the provider config, else unknown."""
    seen: Counter[str] = Counter()
    for rec in run.records:
        resp = rec.get("response")
        for value in (
            rec.get("quantization"),
            _dig(resp, "quantization"),
            _dig(resp, "provider_specific_fields", "quantization"),
        ):
            if isinstance(value, str) and value:
                seen[value.lower()] += 1
                break
    if seen:
        return "/".join(sorted(seen))
    prov = run.config.get("provider") or {}
    for value in (prov.get("quantization"), _routing(run.config).get("quantizations")):
        if isinstance(value, str) and value:
            return value.lower()
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            return value[0].lower()  # pinned to exactly one quantisation
    return UNKNOWN


def _error_label(err: Any) -> str:
    err = err if isinstance(err, dict) else {"class": str(err)}
    label = err.get("class") or "error"
    status = err.get("status")
    return f"{label} ({status})" if status else str(label)


def allowed_quantizations(run: Run) -> tuple[str, ...] | None:
    allowed = _routing(run.config).get("quantizations")
    if isinstance(allowed, list) and allowed:
        return tuple(str(q).lower() for q in allowed)
    return None


def summarize(run: Run) -> RunStats:
    served: Counter[str] = Counter()
    answered_ids = {r.get("id") for r in run.records}
    # Samples whose retries ran out leave no record (generate tries them again next run),
    # only failed attempts: they are failed requests of this provider all the same.
    given_up: dict[Any, list[dict[str, Any]]] = {}
    for att in run.attempt_errors:
        if att.get("id") not in answered_ids:
            given_up.setdefault(att.get("id"), []).append(att)
    stats = RunStats(
        name=run.name,
        provider="",
        served_by="",
        quantization=quantization_of(run),
        allowed_quantizations=allowed_quantizations(run),
        requests=len(run.records) + len(given_up),
        answered=0,
        ok=0,
        errors=len(given_up),
        retried=sum(len(a) > 1 for a in given_up.values()),
        mean_attempts=0.0,
        failed_attempts=len(run.attempt_errors),
        stop_reason=str(run.summary.get("stop_reason") or UNKNOWN),
        bad_lines=run.bad_lines,
    )
    for attempts in given_up.values():
        stats.error_classes[_error_label(attempts[-1].get("error")) + ", given up"] += 1
    attempts_total = float(sum(len(a) for a in given_up.values()))
    # Money billed for failed attempts is part of what the provider cost.
    cost_values = [_num(a.get("cost")) for a in run.attempt_errors]
    for rec in run.records:
        tries = _num(rec.get("attempts")) or 1.0
        attempts_total += tries
        stats.retried += tries > 1
        cost = _num(rec.get("cost"))
        # The price a provider charges is what it says it billed (usage.cost); the booked
        # cost (at least the listed price, issue 20) is the run's spend in summary.json.
        reported = _num(_dig(rec, "usage", "cost"))
        cost_values.append(reported if reported is not None else cost)
        if rec.get("error"):
            stats.errors += 1
            stats.error_classes[_error_label(rec["error"])] += 1
            continue
        stats.answered += 1
        stats.ok += bool(rec.get("ok"))
        stats.evidence[evidence_of(rec)] += 1
        codes = [str(i) for i in rec.get("issues") or []]
        stats.issues.update(codes)
        # A recovered split is evidence of exact ids, not a fault: it does not count here.
        stats.with_issues += bool(set(codes) - EXACTNESS_EVIDENCE)
        lp = rec.get("logprobs")
        if isinstance(lp, dict) and lp.get("present"):
            stats.logprob_answers += 1
            stats.logprob_agree += "mismatch" not in lp and "invalid" not in lp
            stats.logprob_coverage[str(lp.get("coverage") or "invalid")] += 1
        if isinstance(rec.get("provider"), str) and rec["provider"]:
            served[rec["provider"]] += 1
        reported = _num(rec.get("completion_tokens_reported"))
        if reported is None:
            reported = _num(_dig(rec, "usage", "completion_tokens"))
        rebuilt = _num(rec.get("completion_tokens_reconstructed"))
        if reported is not None:
            stats.reported_tokens += int(reported)
            if rebuilt is not None:
                stats.drift_tokens += int(rebuilt - reported)
                if reported > 0:
                    stats.drift_pct.append(100.0 * (rebuilt - reported) / reported)
        latency = _num(rec.get("latency_s"))
        if latency is not None and latency > 0:
            stats.latencies.append(latency)
            tokens = reported if reported is not None else rebuilt
            if tokens:
                stats.tokens_per_s.append(tokens / latency)
        for call in tool_calls_of(rec):
            stats.tool_calls += 1
            problem = tool_call_problem(call, rec.get("tools"))
            if problem is None:
                stats.tool_calls_valid += 1
            else:
                stats.tool_problems[problem] += 1
    stats.mean_attempts = attempts_total / stats.requests if stats.requests else 0.0
    known = [c for c in cost_values if c is not None]
    stats.cost_usd = sum(known) if known else None
    stats.provider = provider_slug(run, served)
    stats.served_by = ", ".join(sorted(served)) or UNKNOWN
    stats.token_yield = run_yield(run)
    return stats


def run_yield(run: Run) -> dict[str, Any]:
    """A run's yield in tokens and dollars under its own `export.accept`, at the listed
    output price and the spend its summary.json books (core/token_yield.py)."""
    try:
        accept = parse_accept((run.config.get("export") or {}).get("accept"))
    except (ValueError, AttributeError):
        accept = parse_accept(None)
    price = _num(_dig(run.summary, "budget", "price_out_usd_per_mtok"))
    block = token_yield(
        run.records,
        accept,
        price_out_per_token=price / 1e6 if price is not None else None,
        spend_usd=_num(run.summary.get("spend_usd")),
    )
    # Tokens of the records extraction's target resolution takes (the routing by exact tokens
    # per dollar counts them at the calibration's resolution rate): a closed or bounded set it
    # scores and nothing else blocking, as extraction asks; not a set beside another error.
    max_options = _dig(run.config, "resolve", "max_options")
    if type(max_options) is not int:
        max_options = ResolveSettings().max_options
    block["resolvable_tokens"] = sum(
        completion_tokens_bought(r)
        for r in run.records
        if not r.get("error")
        and evidence_of(r) == UNRESOLVED
        and resolvable(r, max_options=max_options) is None
    )
    return block
