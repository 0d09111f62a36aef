"""Composing the one Hydra config outside `@hydra.main` (for stages that write no run dir)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
CONF_DIR = REPO_DIR / "conf"
DATA_DIR = REPO_DIR / "data"

# `${kimi_pipe_data:demo_prompts.jsonl}` in a config: a file bundled with the project.
OmegaConf.register_new_resolver("kimi_pipe_data", lambda name: str(DATA_DIR / name), replace=True)


def compose(overrides: Sequence[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))
