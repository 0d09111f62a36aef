r"""The provider report: per-run fidelity, cost and speed from finished generate runs, as
`report.md`, `report.json` and charts, ending with a recommended routing. Reads only what
generate wrote. The command and its settings: kimi_pipe/stages/report.py."""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kimi_pipe.core.evidence import LADDER
from kimi_pipe.core.token_yield import yield_line
from kimi_pipe.reporting.charts import write_charts
from kimi_pipe.reporting.formatting import counter_text, fmt_num, fmt_pct, fmt_usd, pct
from kimi_pipe.reporting.recommend import (
    CALIBRATED_RESOLUTION_RATE,
    Policy,
    Recommendation,
    recommend_with_conformance,
    route_by_exact_tokens,
    routing_block,
    routing_overrides,
    run_yield_of,
)
from kimi_pipe.reporting.runs import ConfigReader, find_run_dirs, load_run
from kimi_pipe.reporting.stats import RunStats, summarize
from kimi_pipe.store import atomic
from kimi_pipe.store.layout import CONFORMANCE_JSON, PROBES_DIR, REPORT_JSON


@dataclass(frozen=True)
class ReportSettings(Policy):
    """The `report` config node (conf/report/default.yaml): where, and the routing policy."""

    sweep_dir: str | None = None
    out_dir: str | None = None

    def policy(self) -> Policy:
        values = {f.name: getattr(self, f.name) for f in fields(Policy)}
        values["ignore_quantizations"] = tuple(values["ignore_quantizations"])
        return Policy(**values)


# --------------------------------------------------------------------------- markdown


def render_markdown(
    stats: list[RunStats], rec: Recommendation, charts: list[Path], sweep_dir: Path, policy: Policy
) -> str:
    lines = [
        "# Provider report",
        "",
        f"Runs read from `{sweep_dir.as_posix()}`: {len(stats)}. "
        "Rows are in recommended order (ignored providers last).",
        "",
        "| provider | run | quant. | requests | ok rate | billing drift | drifting samples | "
        "tool calls valid | USD / M out | p50 s | p95 s | out tok/s | errors | retries |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
        "---: | ---: |",
    ]
    for s in stats:
        tool = f"{fmt_pct(pct(s.tool_valid_rate))} of {s.tool_calls}" if s.tool_calls else "n/a"
        lines.append(
            f"| {s.provider} | {s.name} | {s.quantization} | {s.requests} | "
            f"{fmt_pct(pct(s.ok_rate))} | {fmt_pct(s.drift_total_pct, 2)} | "
            f"{s.drift_samples}/{len(s.drift_pct)} | {tool} | {fmt_usd(s.usd_per_mtok)} | "
            f"{fmt_num(s.p50_latency, 2)} | {fmt_num(s.p95_latency, 2)} | "
            f"{fmt_num(s.median_tokens_per_s)} | {fmt_pct(pct(s.error_rate))} | "
            f"{fmt_pct(pct(s.retry_rate))} |"
        )
    lines += ["", "## Details per provider", ""]
    for s in stats:
        lines += [
            f"### {s.provider}",
            "",
            f"- answers served by: {s.served_by}; quantisation: {s.quantization}",
            f"- requests {s.requests}, answered {s.answered}, reconstruction ok {s.ok}; "
            f"run ended: {s.stop_reason}",
            "- evidence ladder (answered records): "
            + ", ".join(f"{rung} {s.evidence[rung]}" for rung in LADDER),
            f"- issue codes: {counter_text(s.issues)}",
            f"- billing drift: {s.drift_tokens:+d} tokens over {s.reported_tokens} reported "
            f"({fmt_pct(s.drift_total_pct, 2)}); per sample min/median/max "
            f"{_spread(s.drift_pct)}",
            f"- tool calls: {s.tool_calls_valid}/{s.tool_calls} valid; problems: "
            f"{counter_text(s.tool_problems)}",
            f"- cost: {fmt_usd(s.cost_usd)} in total, {fmt_usd(s.usd_per_mtok)} per million "
            "output tokens",
            f"- yield: {yield_line(s.token_yield) if s.token_yield else 'n/a'}",
            f"- errors: {counter_text(s.error_classes)}; mean attempts per request "
            f"{s.mean_attempts:.2f}; failed attempts {s.failed_attempts} "
            f"({fmt_pct(pct(s.attempt_failure_rate))} of all attempts)",
        ]
        if s.bad_lines:
            lines.append(f"- {s.bad_lines} unreadable line(s) in records.jsonl were skipped")
        lines.append("")
    lines += ["## Charts", ""]
    lines += [f"![{p.stem.replace('_', ' ')}]({p.name})" for p in charts]
    lines += [
        "",
        "## Recommended routing",
        "",
        "OpenRouter's `provider` routing object for the generate requests:",
        "",
        "```yaml",
        routing_block(rec),
        "```",
        "",
        "The same as overrides of generate (`conf/provider/openrouter.yaml` keeps it under "
        "`routing:`):",
        "",
        "```",
        routing_overrides(rec),
        "```",
        "",
        "Why:",
        "",
    ]
    lines += [f"- `{p}`: {why}" for p, why in rec.reasons.items()]
    by_tokens = route_by_exact_tokens(run_yield_of(s) for s in stats)
    lines += [
        "",
        "## Routing by exact tokens per dollar",
        "",
        "Expected exact tokens: tokens proven, plus tokens of closed candidate sets times the "
        "target's resolution rate on the 500-answer calibration "
        f"({CALIBRATED_RESOLUTION_RATE:.1%}, docs/yield.md; a rate carried over, not measured "
        "on these runs), per dollar billed:",
        "",
        "```",
        f"provider.routing.only='[{','.join(by_tokens.order)}]' "
        f"provider.routing.ignore='[{','.join(by_tokens.ignore)}]'",
        "```",
        "",
    ]
    lines += [f"- `{p}`: {why}" for p, why in by_tokens.reasons.items()]
    lines += [
        "",
        "Policy: a provider is ignored when its reconstruction ok rate is below "
        f"{policy.min_ok_rate:.0%}, its error rate above {policy.max_error_rate:.0%}, its "
        f"tool-call validity below {policy.min_tool_valid_rate:.0%}, or its quantisation is "
        f"one of {', '.join(policy.ignore_quantizations) or 'none'} or outside the run's "
        "`provider.routing.quantizations`. The rest are ordered "
        f"by ok rate (within {policy.rank_step:.0%} of the best counts as equal), tool-call "
        "validity (same), share of samples without issue codes (same), error rate, "
        "retry rate, USD per million output tokens, then output tokens/s.",
        "",
        "## How each figure is measured",
        "",
        "- *ok rate*: records with `ok: true` / records without `error`.",
        "- *billing drift*: sum(`completion_tokens_reconstructed`) - "
        "sum(`completion_tokens_reported`), as % of reported; per sample the same ratio.",
        "- *tool calls valid*: calls in `response.choices[0].message.tool_calls` whose "
        "function is declared in the record's `tools` and whose `arguments` parse as a JSON "
        "object that validates against that function's `parameters` (JSON Schema).",
        "- *USD / M out*: total `cost` of all records plus the cost of failed attempts "
        "(`attempt_errors.jsonl`) / reported output tokens x 1e6.",
        "- *p50/p95 s*: `latency_s` of answered records (the attempt that answered; retries "
        "show in the retry rate).",
        "- *out tok/s*: median over answered records of reported output tokens / `latency_s`.",
        "- *errors*: records with an `error`, plus samples whose retries ran out (only in "
        "`attempt_errors.jsonl`); *retries*: requests that needed more than one attempt.",
        "- *quant.*: the quantisation the response reports, else the run's provider "
        "config, else unknown.",
        "",
    ]
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{min(values):+.2f}% / {statistics.median(values):+.2f}% / {max(values):+.2f}%"


# --------------------------------------------------------------------------- entry point


def build_report(
    sweep_dir: Path, out_dir: Path, policy: Policy | None = None, *, read_config: ConfigReader
) -> Path:
    """Read every run below `sweep_dir` (its saved config through `read_config`), write
    report.md and charts; returns report.md."""
    policy = policy or Policy()
    run_dirs = find_run_dirs(sweep_dir)
    stats: list[RunStats] = []
    for i, path in enumerate(run_dirs, start=1):
        print(f"[report] {i}/{len(run_dirs)} reading {path}", file=sys.stderr, flush=True)
        stats.append(summarize(load_run(path, sweep_dir, read_config)))
    conformance = _read_conformance(sweep_dir)
    rec = recommend_with_conformance(stats, policy, conformance)
    position = {p: i for i, p in enumerate(rec.order + rec.ignore)}
    stats.sort(key=lambda s: (position.get(s.provider, len(position)), s.name))
    out_dir.mkdir(parents=True, exist_ok=True)
    charts = write_charts(stats, out_dir, rec.ignore)
    _write_atomic(out_dir / REPORT_JSON, json.dumps(report_data(stats, rec), indent=2) + "\n")
    report = out_dir / "report.md"
    text = render_markdown(stats, rec, charts, sweep_dir, policy)
    _write_atomic(report, add_conformance(text, stats, conformance))
    print(
        f"[report] wrote {report}, report.json and {len(charts)} charts",
        file=sys.stderr,
        flush=True,
    )
    return report


def _read_conformance(sweep_dir: Path) -> dict[str, Any] | None:
    path = sweep_dir / PROBES_DIR / CONFORMANCE_JSON
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    table = path.with_name("conformance.md")
    data["table_md"] = table.read_text(encoding="utf-8") if table.is_file() else ""
    return data


def add_conformance(text: str, stats: list[RunStats], conformance: dict[str, Any] | None) -> str:
    """The probe verdicts, logprob agreement and share flagged per code, before the routing."""
    lines = ["## Conformance and token-level evidence", ""]
    if conformance is None:
        lines += [
            "No conformance probes in this sweep (`probes/conformance.json`); run "
            "`make probe providers=...` into `<sweep_dir>/probes` or `make sweep` (which runs "
            "them first). Without them the routing below rests on billing alone.",
            "",
        ]
    else:
        md = str(conformance.get("table_md") or "")
        body = md.split("\n", 2)[2] if md.count("\n") > 2 else md
        lines += [
            "Probe verdicts per quirk (clean: the probe saw the model's text intact; seen: the "
            "server changed it; unknown: no usable evidence). *logprobs*: what the provider's "
            "`logprobs.content[]` covers; *token agreement*: probe answers whose engine tokens "
            "join to the answer text. The recommended routing leaves out every provider "
            "whose probes saw a quirk marked not invertible, and names the serving profile of "
            "the others.",
            "",
            body.rstrip(),
            "",
        ]
    lines += [
        "Token-level evidence in the answers themselves (`logprobs` of each record): answers "
        "with logprobs, what they cover, and how many agree with the text:",
        "",
    ]
    for s in stats:
        if not s.logprob_answers:
            lines.append(f"- `{s.provider}`: no logprobs in {s.answered} answers")
            continue
        cover = ", ".join(f"{k} x{v}" for k, v in s.logprob_coverage.most_common())
        lines.append(
            f"- `{s.provider}`: {s.logprob_answers}/{s.answered} answers with logprobs ({cover}); "
            f"{s.logprob_agree}/{s.logprob_answers} agree with the text"
        )
    lines.append("")
    if any(s.issues for s in stats):
        lines += [
            "Share of answered samples flagged with each code (`logprob_mismatch`: the engine's "
            "tokens disagree with the text; `noncanonical_split`: the engine's ids kept where "
            "re-encoding differs; `logprobs_missing`: asked for, not sent):",
            "",
        ]
        for s in stats:
            shares = ", ".join(
                f"{code} {fmt_pct(pct(n / s.answered))}" for code, n in s.issues.most_common()
            )
            lines.append(
                f"- `{s.provider}`: {shares or 'none'}"
                if s.answered
                else f"- `{s.provider}`: no answers"
            )
        lines.append("")
    marker = "## Recommended routing"
    block = "\n".join(lines) + "\n"
    return text.replace(marker, block + marker, 1) if marker in text else text + "\n" + block


def _write_atomic(path: Path, text: str) -> None:
    # Write-then-rename: an interrupted report never leaves a half file behind.
    atomic.write_text(path, text)


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
    by_tokens = route_by_exact_tokens(run_yield_of(s) for s in stats)
    exact = {"only": by_tokens.order, "ignore": by_tokens.ignore, "reasons": by_tokens.reasons}
    return {"runs": rows, "routing": routing, "routing_by_exact_tokens": exact}
