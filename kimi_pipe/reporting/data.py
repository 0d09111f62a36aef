"""Report data: what each finished generate run measured, and the routing it recommends.

Reads only what generate wrote (records, attempt errors, saved config); no network, no model.
The charts are `reporting.charts`, the markdown and the CLI the `report` stage.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig

from kimi_pipe.core.evidence import LADDER, evidence_of
from kimi_pipe.core.issue_codes import COST_BELOW_LISTED_PRICE, NONCANONICAL_SPLIT
from kimi_pipe.errors import MissingFile
from kimi_pipe.store.layout import ATTEMPT_ERRORS as ATTEMPT_ERRORS_FILE
from kimi_pipe.store.layout import PROBES_DIR, SERVING_AUTO_DIR, SUMMARY
from kimi_pipe.store.layout import RECORDS as RECORDS_FILE

# Notes that prove a record exact rather than doubt it (core/logprobs.py).
# Codes that are no fidelity fault: evidence of exact ids, or notes about money only.
EXACTNESS_EVIDENCE = frozenset({NONCANONICAL_SPLIT, COST_BELOW_LISTED_PRICE})
UNKNOWN = "unknown"


# --------------------------------------------------------------------------- settings


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


# --------------------------------------------------------------------------- reading runs


@dataclass
class Run:
    name: str  # label in the report: the run directory relative to sweep_dir
    path: Path
    records: list[dict[str, Any]]
    config: dict[str, Any]  # .hydra/generate/config.yaml, {} when absent
    summary: dict[str, Any]  # summary.json, {} when absent
    attempt_errors: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: int = 0


def find_run_dirs(root: Path) -> list[Path]:
    """Every directory at or below `root` holding a records file, in a stable order."""
    if not root.exists():
        raise MissingFile(
            f"{root} does not exist; pass report.sweep_dir= a generate run directory or a "
            "sweep directory (made by `make sweep` or `python -m kimi_pipe generate`)"
        )
    # The probe stage's runs (<sweep_dir>/probes/<slug>/) and serving=auto's
    # (<run>/serving_auto/<slug>/) are probes, not provider runs.
    probes = {PROBES_DIR, SERVING_AUTO_DIR}
    found = sorted(
        {p.parent for p in root.rglob(RECORDS_FILE) if not probes & set(p.relative_to(root).parts)}
    )
    if not found:
        raise MissingFile(
            f"no {RECORDS_FILE} at or below {root}; run the generate stage or `make sweep` first"
        )
    return found


# Token lists are the bulk of a record and no figure needs them: dropped on load.
HEAVY_KEYS = ("prompt_ids", "output_ids", "loss_mask")


def load_run(path: Path, root: Path) -> Run:
    from kimi_pipe.store.records import ReadStats, iter_records

    read = ReadStats()  # torn last line (a crash mid-write) and corrupt lines are skipped
    by_id: dict[Any, dict[str, Any]] = {}
    for i, rec in enumerate(iter_records(path / RECORDS_FILE, read)):
        for key in HEAVY_KEYS:
            rec.pop(key, None)
        # A resumed run may hold a sample twice; the last record is the one that counts.
        by_id[rec.get("id", f"line-{i}")] = rec
    name = path.relative_to(root).as_posix() if path != root else path.name
    return Run(
        name=name or path.resolve().name,
        path=path,
        records=list(by_id.values()),
        # generate saves its config under .hydra/generate/ (one subdir per stage)
        config=_read_yaml(path / ".hydra" / "generate" / "config.yaml")
        or _read_yaml(path / ".hydra" / "config.yaml"),
        summary=_read_json(path / SUMMARY),
        attempt_errors=list(iter_records(path / ATTEMPT_ERRORS_FILE)),
        bad_lines=len(read.bad_lines) + int(read.torn_tail),
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    """A run's saved Hydra config, interpolations resolved where they can be.

    A sweep job's config holds e.g. `order: [${provider.name}]`; keys whose interpolation
    cannot be resolved outside Hydra (`${hydra:...}`) are kept as written.
    """
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(path)
    if not isinstance(cfg, DictConfig):
        return {}
    out: dict[str, Any] = {}
    for key in cfg:
        try:
            out[str(key)] = OmegaConf.to_container(cfg[key], resolve=True)
        except Exception:  # noqa: BLE001 - an unresolvable interpolation: keep it as text
            out[str(key)] = OmegaConf.to_container(cfg, resolve=False)[key]  # type: ignore[index]
    return out


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


# --------------------------------------------------------------------------- tool calls


def tool_calls_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        calls = record["response"]["choices"][0]["message"].get("tool_calls")
    except (KeyError, IndexError, TypeError, AttributeError):
        return []
    return [c for c in calls or [] if isinstance(c, dict)]


def tool_call_problem(call: dict[str, Any], tools: list[dict[str, Any]] | None) -> str | None:
    """Why a tool call is unusable, or None when its arguments are JSON matching the schema."""
    import jsonschema

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
    from kimi_pipe.core.evidence import parse_accept
    from kimi_pipe.core.token_yield import token_yield

    try:
        accept = parse_accept((run.config.get("export") or {}).get("accept"))
    except (ValueError, AttributeError):
        accept = parse_accept(None)
    price = _num(_dig(run.summary, "budget", "price_out_usd_per_mtok"))
    return token_yield(
        run.records,
        accept,
        price_out_per_token=price / 1e6 if price is not None else None,
        spend_usd=_num(run.summary.get("spend_usd")),
    )


# --------------------------------------------------------------------------- recommendation


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
        f"ok {fmt_pct(_pct(s.ok_rate))}, errors {fmt_pct(_pct(s.error_rate))}, "
        f"retries {fmt_pct(_pct(s.retry_rate))}, {fmt_usd(s.usd_per_mtok)}/M output tokens, "
        f"{fmt_num(s.median_tokens_per_s)} tok/s"
    )
    if better is None:
        return head + " (best on fidelity, then issue codes, errors, retries, price and speed)"
    mine, theirs = key(s), key(better)
    diff = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), -1)
    why = {
        0: f"lower ok rate, {fmt_pct(_pct(s.ok_rate))} vs {fmt_pct(_pct(better.ok_rate))}",
        1: f"fewer valid tool calls, {fmt_pct(_pct(s.tool_valid_rate))} vs "
        f"{fmt_pct(_pct(better.tool_valid_rate))}",
        2: f"more samples with issue codes, {fmt_pct(_pct(1 - (s.clean_rate or 0)))} vs "
        f"{fmt_pct(_pct(1 - (better.clean_rate or 0)))} ({_counter_text(s.issues)})",
        3: f"more errors, {fmt_pct(_pct(s.error_rate))} vs {fmt_pct(_pct(better.error_rate))}",
        4: f"more retries, {fmt_pct(_pct(s.retry_rate))} vs {fmt_pct(_pct(better.retry_rate))}",
        5: f"dearer, {fmt_usd(s.usd_per_mtok)} vs {fmt_usd(better.usd_per_mtok)} per M tokens",
        6: f"slower, {fmt_num(s.median_tokens_per_s)} vs "
        f"{fmt_num(better.median_tokens_per_s)} tok/s",
        7: f"higher p95 latency, {fmt_num(s.p95_latency, 2)} vs {fmt_num(better.p95_latency, 2)} s",
    }.get(diff, "tied on every measure")
    return head + f" (behind {better.provider}: {why})"


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


# --------------------------------------------------------------------------- formatting


def _pct(rate: float | None) -> float | None:
    return None if rate is None else 100.0 * rate


def fmt_pct(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}%"


def fmt_num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def fmt_usd(value: float | None) -> str:
    return "n/a" if value is None else f"${value:.4g}"


def _counter_text(counter: Counter[str]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in counter.most_common()) or "none"


def report_data(stats: list[RunStats], rec: Recommendation) -> dict[str, Any]:
    """The figures of report.md for scripts: one entry per run, then the routing."""
    rows = []
    for s in stats:
        rows.append(
            {
                "provider": s.provider,
                "run": s.name,
                "served_by": s.served_by,
                "quantization": s.quantization,
                "requests": s.requests,
                "answered": s.answered,
                "ok_rate": s.ok_rate,
                "evidence": {rung: s.evidence[rung] for rung in LADDER},
                "yield": s.token_yield,
                "billing_drift_pct": s.drift_total_pct,
                "billing_drift_per_sample_pct": s.drift_pct,
                "issues": dict(s.issues),
                "tool_calls": s.tool_calls,
                "tool_valid_rate": s.tool_valid_rate,
                "tool_problems": dict(s.tool_problems),
                "cost_usd": s.cost_usd,
                "usd_per_mtok_output": s.usd_per_mtok,
                "latency_p50_s": s.p50_latency,
                "latency_p95_s": s.p95_latency,
                "output_tokens_per_s": s.median_tokens_per_s,
                "error_rate": s.error_rate,
                "errors": dict(s.error_classes),
                "retry_rate": s.retry_rate,
                "attempt_failure_rate": s.attempt_failure_rate,
                "stop_reason": s.stop_reason,
                "verdict": rec.reasons.get(s.provider, ""),
            }
        )
    routing = {"order": rec.order, "ignore": rec.ignore, "allow_fallbacks": False}
    return {"runs": rows, "routing": routing}
