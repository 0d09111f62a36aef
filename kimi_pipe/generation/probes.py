"""Probes bought like answers: a battery through the generate job, pinned to each provider,
judged and cached for serving=auto. Above both the job and the conformance checks, so that
neither imports the other: the job gets `buy_battery` as a parameter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from kimi_pipe.config import CONF_DIR
from kimi_pipe.conformance.auto import cache_conformance, profile_from_spec
from kimi_pipe.conformance.probe import (
    Battery,
    ProbeError,
    ProviderConformance,
    Shortfall,
    check_providers,
    judge,
    write_conformance,
    write_probe_prompts,
)
from kimi_pipe.generation import run as job
from kimi_pipe.generation.job import GenerateJob
from kimi_pipe.store.layout import RECORDS
from kimi_pipe.store.records import iter_records


def run_generate(gen: GenerateJob, run_dir: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """The generate job, buying serving=auto's probes through `buy_battery`."""
    return job.run_generate(gen, run_dir, buy_probes=buy_battery)


def generate(gen: GenerateJob, run_dir: Path | None = None) -> tuple[int, dict[str, Any] | None]:
    """`job.generate` (exit status and summary), buying serving=auto's probes."""
    return job.generate(gen, run_dir, buy_probes=buy_battery)


def battery_job(
    base: GenerateJob, battery: Battery, prompts: Path, slug: str | None, usd: float, run: Path
) -> GenerateJob:
    """The generate job that buys the battery pinned to one provider (slug None: the route
    as configured, to find out which providers it reaches), from the job `base`."""
    provider = {**base.provider}
    routing = dict(provider.get("routing") or {})
    if slug is not None:
        routing |= {"order": [slug], "allow_fallbacks": False}
    # Ask for logprobs without requiring them: a provider without them must still answer.
    routing["require_parameters"] = False
    provider["routing"] = routing
    provider["logprobs"] = False
    provider["params"] = {
        **(provider.get("params") or {}),
        "logprobs": True,
        "max_tokens": battery.max_tokens,
    }
    jsonl = yaml.safe_load((CONF_DIR / "dataset" / "jsonl.yaml").read_text(encoding="utf-8"))
    return replace(
        base,
        dataset={**jsonl, "path": str(prompts)},
        datasets=None,
        # The probes judge the text as the provider sent it; nothing declared, nothing fitted.
        serving=profile_from_spec("unknown"),
        budget=replace(base.budget, usd=usd).check(),
        run_dir=run,
    ).with_provider(provider)


def buy_battery(
    base: GenerateJob, battery: Battery, prompts: Path, slug: str | None, usd: float, run: Path
) -> tuple[list[dict[str, Any]], Shortfall | None]:
    """Buy the battery through the generate stage (pinned to `slug`, or the route as
    configured when None) into `run`, as the job `base` buys; returns its records (resumes
    what `run` holds) and what of it did not fit `usd` (None: nothing was skipped for the
    budget)."""
    # A mistake (a config, the key, a price) is raised and said once by the caller's
    # command; a run stopped by the provider still has its answers judged.
    # The battery names its own serving profile: its run buys no probes of its own.
    where, summary = job.run_generate(battery_job(base, battery, prompts, slug, usd, run), run)
    short = Shortfall.of(summary)
    if short is None or short.answered:
        job.finish_status(where, summary)  # else the caller says that the probes did not fit
    records = list(iter_records(run / RECORDS)) if (run / RECORDS).exists() else []
    return records, short


def probe_providers(
    base: GenerateJob,
    providers: Sequence[str],
    out_dir: Path,
    battery: Battery,
    usd: float | None,
    usd_key: str = "probe.usd",
) -> list[ProviderConformance]:
    """The battery bought pinned to each provider as the job `base` buys (its model and
    provider settings, under the default budget: the stage's door makes it so; the battery
    brings its own prompts, budget cap and profile), judged, written to `out_dir` and cached
    for serving=auto. A battery none of whose probes fit its share of `usd` is a ProbeError
    naming `usd_key` (the setting that gave `usd`)."""
    check_providers(providers, "providers")
    prompts = out_dir / "prompts.jsonl"
    write_probe_prompts(battery, prompts)
    total = usd if usd is not None else battery.usd_each * len(providers)
    each = int(total / len(providers) * 1e6) / 1e6  # micro-dollars, never more than the total
    results = []
    for slug in providers:
        run = out_dir / slug.replace("/", "_")
        records, short = buy_battery(base, battery, prompts, slug, each, run)
        if short is not None and not records:
            given = (
                f"{usd_key}={total:g}"
                if usd is not None
                else (
                    f"the battery's usd_each ${battery.usd_each:g} per provider ({usd_key} unset)"
                )
            )
            raise ProbeError(
                f"the probes on {slug} did not fit the budget: "
                f"{short.describe(f'its share ${each:g} of {given}')}; raise {usd_key}"
            )
        results.append(judge(battery, slug, records))
    write_conformance(out_dir, battery, results)
    cache_conformance(
        base.auto_target(), battery.source, results
    )  # serving=auto reads these verdicts
    return results


def run_datasets(gen: GenerateJob, run_dir: Path | None = None) -> tuple[Path, dict[str, Any], int]:
    """`job.run_datasets` (several datasets under one budget), buying serving=auto's probes."""
    return job.run_datasets(gen, run_dir, buy_probes=buy_battery)
