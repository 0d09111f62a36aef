"""generate's door: the composed config read once into a `GenerateJob`
(kimi_pipe/generation/job.py), checked as the run reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kimi_pipe.conformance.auto import AutoSettings
from kimi_pipe.generation.datasets import datasets_of
from kimi_pipe.generation.job import GenerateJob
from kimi_pipe.providers.credentials import api_key, refuse_secrets
from kimi_pipe.providers.settings import ProviderSettings
from kimi_pipe.stages.jobs.groups import (
    budget_of,
    mapping_node,
    plain_node,
    serving_of,
    settings_node,
)
from kimi_pipe.stages.launch import run_dir_of


def generate_job(cfg: Any, run_dir: Path | None = None, *, own_dir: bool = True) -> GenerateJob:
    """The composed config as generate's job. Before anything is written: no secret in any
    value, budget and provider settings that can buy, a key that is set (each a ConfigError
    naming the setting). `run_dir`: where it buys (None: `output_dir`, as Hydra's run
    agrees; `own_dir=False`: none, for a job only ever bought into directories given to
    it, as the probes are)."""
    refuse_secrets(plain_node(cfg, ""))
    budget = budget_of(cfg)
    provider = mapping_node(cfg, "provider")
    settings = ProviderSettings.from_config(provider)
    nodes = datasets_of(plain_node(cfg, "datasets"))
    # A missing key stops here too: before Hydra or the runner makes the run directory, and
    # before serving=auto's probes open theirs.
    api_key(settings.api_key_env)
    if run_dir is None and own_dir:
        run_dir = run_dir_of(cfg)
    validation = mapping_node(cfg, "validation")
    return GenerateJob(
        model=mapping_node(cfg, "model"),
        provider=provider,
        settings=settings,
        dataset=mapping_node(cfg, "dataset"),
        budget=budget,
        serving=serving_of(cfg),
        serving_auto=settings_node(cfg, "serving_auto", AutoSettings, lists=("providers",)),
        billing_tolerance=int(validation.get("billing_tolerance") or 0),
        record_ids=str(validation.get("record_ids", "engine")),
        accept=plain_node(cfg, "export.accept"),
        run_dir=run_dir,
        datasets=tuple(nodes) if nodes is not None else None,
    )
