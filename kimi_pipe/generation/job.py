"""The generate job's settings: `GenerateJob`, made from the composed config once, at the
stage's door (kimi_pipe/stages/jobs/generate.py); the job itself runs in generation/run.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kimi_pipe.conformance.auto import AutoSettings, AutoTarget, Pin
from kimi_pipe.core.serving import ServingProfile
from kimi_pipe.providers.budget import BudgetSettings
from kimi_pipe.providers.settings import ProviderSettings


@dataclass(frozen=True)
class GenerateJob:
    """Everything a generate run reads of its settings, read once from the composed config at
    the stage's door (kimi_pipe/stages/jobs/generate.py); what a run changes (the fitted
    route, a dataset's share of the budget, its run directory) is a new job
    (`dataclasses.replace`), never a write into the config."""

    model: dict[str, Any]  # the `model` node (conf/model), plain values
    provider: dict[str, Any]  # the `provider` node (conf/provider): routing, server, ...
    settings: ProviderSettings  # `provider` as checked; kept equal to it by `with_provider`
    dataset: dict[str, Any]  # the `dataset` node (conf/dataset)
    budget: BudgetSettings
    serving: ServingProfile
    serving_auto: AutoSettings
    billing_tolerance: int = 0  # validation.billing_tolerance
    record_ids: str = "engine"  # validation.record_ids
    accept: Any = None  # export.accept: the evidence rungs the summary's yield counts
    run_dir: Path | None = None  # None: a job only ever bought into a directory given to it
    # `datasets`: several datasets under one budget (generation/datasets.py); None: `dataset`.
    datasets: tuple[dict[str, Any], ...] | None = None

    def with_provider(self, provider: Mapping[str, Any]) -> GenerateJob:
        """This job buying through `provider` (its settings checked again)."""
        node = dict(provider)
        return replace(self, provider=node, settings=ProviderSettings.from_config(node))

    def for_dataset(self, dataset: dict[str, Any], run_dir: Path, usd: float | None) -> GenerateJob:
        """The job's run of one of its datasets: its node, its run directory, what is left of
        the job's USD cap as its budget."""
        budget = self.budget if usd is None else replace(self.budget, usd=usd)
        return replace(self, dataset=dataset, datasets=None, run_dir=run_dir, budget=budget)

    def pinned(self, pin: Pin | None) -> GenerateJob:
        """This job as serving=auto's `prepare` changes it (None: unchanged)."""
        if pin is None:
            return self
        out = replace(self, serving=pin.serving)
        if pin.order is None:
            return out
        routing = {
            **(self.provider.get("routing") or {}),
            "only": list(pin.order),
            "order": list(pin.order),
            "allow_fallbacks": False,
        }
        return out.with_provider({**self.provider, "routing": routing})

    def auto_target(self) -> AutoTarget:
        """What serving=auto reads of this job."""
        return AutoTarget(
            model_name=str(self.model.get("name")),
            provider_model=str(self.provider.get("model", "")),
            api_base=str(self.provider.get("api_base", "")),
            routing=dict(self.provider.get("routing") or {}),
            serving=self.serving,
            declared=self.provider.get("serving_profile") or None,
            budget_usd=self.budget.usd,
            auto=self.serving_auto,
        )
