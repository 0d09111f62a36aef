"""The model stage's door: the config's values -> `ModelJob`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from kimi_pipe.stages.jobs.groups import plain_values
from kimi_pipe.store.local_model import LocalModelSpec, ModelJob


def model_job(config: Mapping[str, Any] | DictConfig) -> ModelJob:
    """`model.local_model` (the embedded model to convert) and `model.hf_weights`."""
    model = plain_values(config).get("model") or {}
    node = model.get("local_model")
    if node is None:  # a remote model: its other keys are not this stage's to resolve
        return ModelJob(spec=None)
    hf_weights = model.get("hf_weights")
    return ModelJob(
        spec=LocalModelSpec.from_cfg(node),
        hf_weights=None if hf_weights is None else str(hf_weights),
    )
