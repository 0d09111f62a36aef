"""The model stage's door: the composed config -> `ModelJob`."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.store.local_model import LocalModelSpec, ModelJob


def model_job(cfg: DictConfig) -> ModelJob:
    """`model.local_model` (the embedded model to convert) and `model.hf_weights`."""
    node = OmegaConf.select(cfg, "model.local_model", default=None)
    if node is None:  # a remote model: its other keys are not this stage's to resolve
        return ModelJob(spec=None)
    hf_weights = OmegaConf.select(cfg, "model.hf_weights", default=None)
    return ModelJob(
        spec=LocalModelSpec.from_cfg(node),
        hf_weights=None if hf_weights is None else str(hf_weights),
    )
