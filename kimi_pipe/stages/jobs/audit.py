"""The audit stage's door: the composed config -> `AuditJob`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.reporting.audit import AuditJob, AuditSettings


def _plain(cfg: DictConfig, key: str) -> Any:
    """The node `key` as plain values (interpolations resolved); {} when absent."""
    node = OmegaConf.select(cfg, key, default=None)
    if node is None:
        return {}
    plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    return {str(k): v for k, v in plain.items()} if isinstance(plain, dict) else plain


def audit_job(
    cfg: DictConfig, run_dir: Path | None = None, *, server_threads: bool = False
) -> AuditJob:
    """`audit.*` and `model` as an AuditJob. `run_dir`: the pipeline's run (`audit.run_dir`).
    `server_threads`: with no `audit.threads`, the local server's thread count (a pipeline's
    greedy runs must see the same arithmetic as the server)."""

    node = _plain(cfg, "audit")
    if run_dir is not None and isinstance(node, dict):
        node["run_dir"] = str(run_dir)
    server = OmegaConf.select(cfg, "provider.server", default=None)
    if server_threads and isinstance(node, dict) and node.get("threads") is None and server:
        node["threads"] = server.get("threads")
    return AuditJob(settings=AuditSettings.from_cfg(node), model=_plain(cfg, "model"))
