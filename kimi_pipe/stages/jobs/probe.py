"""probe's door: the job the conformance battery is bought as (generate's, under the
default budget: the battery brings its own cap, prompts and profile)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kimi_pipe.conformance.probe import ProbeSettings, check_settings, probe_overrides
from kimi_pipe.generation.job import GenerateJob
from kimi_pipe.stages.jobs.generate import generate_job
from kimi_pipe.stages.jobs.groups import settings_node, with_overrides


def probe_settings(cfg: Any) -> ProbeSettings:
    """The `probe` node, checked: providers to probe (`a,b` or [a, b]), a cap that can buy."""
    return check_settings(settings_node(cfg, "probe", ProbeSettings, lists=("providers",)))


def probe_job(cfg: Any, overrides: Sequence[str] = ()) -> GenerateJob:
    """The composed config, with the probe settings' `overrides` (those that are not the
    probes' own: dataset, budget, serving), as the job a battery is bought like; it has no
    run directory of its own (each battery is bought into one given to it)."""
    base = with_overrides(cfg, [*probe_overrides(overrides), "budget=default"])
    return generate_job(base, own_dir=False)
