"""Probes bought like answers: a battery through the generate job, pinned to each provider,
judged and cached for serving=auto. Above both the job and the conformance checks, so that
neither imports the other: the job gets `buy_battery` as a parameter."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kimi_pipe.config import compose
from kimi_pipe.conformance.auto import cache_conformance
from kimi_pipe.conformance.probe import (
    Battery,
    ProbeError,
    ProbeSettings,
    ProviderConformance,
    Shortfall,
    battery_of,
    check_providers,
    judge,
    probe_overrides,
    provider_overrides,
    settings_of,
    with_overrides,
    write_conformance,
    write_probe_prompts,
)
from kimi_pipe.generation import job
from kimi_pipe.store.layout import RECORDS
from kimi_pipe.store.records import iter_records


def run_generate(cfg: DictConfig, run_dir: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """The generate job, buying serving=auto's probes through `buy_battery`."""
    return job.run_generate(cfg, run_dir, buy_probes=buy_battery)


def run_datasets(
    cfg: DictConfig, nodes: list[DictConfig], run_dir: Path | None = None
) -> tuple[Path, dict[str, Any], int]:
    """`job.run_datasets` (several datasets under one budget), buying serving=auto's probes."""
    return job.run_datasets(cfg, nodes, run_dir, buy_probes=buy_battery)


def generate(cfg: DictConfig, run_dir: Path | None = None) -> tuple[int, dict[str, Any] | None]:
    """`job.generate` (exit status and summary), buying serving=auto's probes."""
    return job.generate(cfg, run_dir, buy_probes=buy_battery)


def buy_battery(
    base_cfg: Any, battery: Battery, prompts: Path, slug: str | None, usd: float, run: Path
) -> tuple[list[dict[str, Any]], Shortfall | None]:
    """Buy the battery through the generate stage (pinned to `slug`, or the route as
    configured when None) into `run`; returns its records (resumes what `run` holds) and
    what of it did not fit `usd` (None: nothing was skipped for the budget)."""
    cfg = with_overrides(base_cfg, provider_overrides(battery, prompts, slug, usd, run))
    # A mistake (a config, the key, a price) is raised and said once by the caller's
    # command; a run stopped by the provider still has its answers judged.
    # The battery names its own serving profile: its run buys no probes of its own.
    where, summary = job.run_generate(cfg, run)
    short = Shortfall.of(summary)
    if short is None or short.answered:
        job.finish_status(where, summary)  # else the caller says that the probes did not fit
    records = list(iter_records(run / RECORDS)) if (run / RECORDS).exists() else []
    return records, short


def probe_providers(
    base: Any,
    providers: Sequence[str],
    out_dir: Path,
    battery: Battery,
    usd: float | None,
    usd_key: str = "probe.usd",
) -> list[ProviderConformance]:
    """The battery bought pinned to each provider on the composed config `base` (its model
    and provider settings; the battery brings its own prompts, budget and profile), judged,
    written to `out_dir` and cached for serving=auto. A battery none of whose probes fit
    its share of `usd` is a ProbeError naming `usd_key` (the setting that gave `usd`)."""
    check_providers(providers, "providers")
    base = with_overrides(base, ["budget=default"])  # the battery's cap, not the caller's
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
    cache_conformance(base, battery.source, results)  # serving=auto reads these verdicts
    return results


def run_probes(
    providers: Sequence[str],
    out_dir: Path,
    battery: Battery,
    usd: float | None,
    overrides: Sequence[str] = (),
) -> list[ProviderConformance]:
    """`probe_providers` on the config composed from `overrides` (for scripts and tests)."""
    return probe_providers(compose(probe_overrides(overrides)), providers, out_dir, battery, usd)


def probe(
    cfg: Any, out_dir: Path, settings: ProbeSettings | None = None
) -> list[ProviderConformance]:
    """The probes the composed config's `probe` node asks for, into `out_dir`."""
    settings = settings or settings_of(cfg)
    base = with_overrides(cfg, probe_overrides(settings.overrides))
    battery = battery_of(base, settings)
    return probe_providers(base, settings.providers, out_dir, battery, settings.usd)
