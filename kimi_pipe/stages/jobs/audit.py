"""The audit stage's door: the config's values -> `AuditJob`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kimi_pipe.reporting.audit import AuditJob, AuditSettings
from kimi_pipe.stages.jobs.groups import plain_values


def audit_job(
    config: Mapping[str, Any] | DictConfig,
    run_dir: Path | None = None,
    *,
    server_threads: bool = False,
) -> AuditJob:
    """`audit.*` and `model` of the config's values (converted at the stage's door; a
    composed config is converted here) as an AuditJob. `run_dir`: the pipeline's run
    (`audit.run_dir`). `server_threads`: with no `audit.threads`, the local server's thread
    count (a pipeline's greedy runs must see the same arithmetic as the server)."""
    values = plain_values(config)
    node = values.get("audit") or {}
    if isinstance(node, dict):
        node = {str(k): v for k, v in node.items()}
        if run_dir is not None:
            node["run_dir"] = str(run_dir)
        server = (values.get("provider") or {}).get("server")
        if server_threads and node.get("threads") is None and isinstance(server, dict):
            node["threads"] = server.get("threads")
    return AuditJob(settings=AuditSettings.from_cfg(node), model=values.get("model") or {})
