"""`extract.executor=submitit`: unit workers as submitit jobs (SLURM, or local processes).

`extract.submitit.cluster=slurm` submits `extract.units.workers` jobs to SLURM (one job =
one engine; the `slurm_*` settings go to `submitit.AutoExecutor`); `local` runs them as
processes of this machine through `submitit.LocalExecutor` (what the tests run), the same
job code. A job that dies (preempted, killed, out of time) loses its unit's lease; another
job takes the unit over after `extract.units.lease_s`, or a later run of the same command
finishes it. Units already committed are never redone, whatever the number of jobs.

A multi-node engine (`extract.nnodes` > 1) is one job of `nnodes` nodes, one task each
(`nodes=nnodes`, `tasks_per_node=1`; locally `tasks_per_node=nnodes` on this host):
each task finds its node (`executors.nodes`), rank 0's node runs the unit loop, the others
serve their ranks.

The same worker runs under Hydra's submitit launcher as a job array (no driver process):

    python -m kimi_pipe extract -m hydra/launcher=submitit_slurm_extract \
        extract.executor=local extract.worker=0,1,2,3 extract.run_dir=runs/B5/x ...
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimi_pipe.errors import ConfigError, StoreError
from kimi_pipe.extraction.executors.nodes import engine_node, node_rank_of
from kimi_pipe.extraction.executors.worker import (
    UnitSettings,
    open_worker_backend,
    run_summary,
    run_worker,
    serve_follower,
)
from kimi_pipe.extraction.job import ExtractJob
from kimi_pipe.store.units import default_owner

log = logging.getLogger("kimi_pipe.extract")

CLUSTERS = ("local", "slurm")


@dataclass(frozen=True)
class SubmititSettings:
    """`extract.submitit.*`."""

    cluster: str = "local"
    folder: str | None = None  # job logs and pickles; null: <store>/submitit (local store)
    timeout_min: int = 1440
    parameters: dict[str, Any] = field(default_factory=dict)  # AutoExecutor's (slurm_*, ...)

    @classmethod
    def from_job(cls, job: ExtractJob) -> SubmititSettings:
        node = job.get("submitit")
        raw: dict[str, Any] = {}
        if node is not None:
            if not isinstance(node, Mapping):
                raise ConfigError("extract.submitit must be a mapping of settings")
            raw = {str(k): v for k, v in node.items()}
        cluster = str(raw.get("cluster") or "local")
        if cluster not in CLUSTERS:
            raise ConfigError(
                f"extract.submitit.cluster must be one of {CLUSTERS}, not {cluster!r}"
            )
        params = raw.get("parameters") or {}
        if not isinstance(params, dict):
            raise ConfigError("extract.submitit.parameters must be a mapping")
        try:
            timeout = int(raw.get("timeout_min", 1440))
        except (TypeError, ValueError):
            raise ConfigError("extract.submitit.timeout_min must be an integer") from None
        return cls(cluster, raw.get("folder"), timeout, dict(params))


def task_env() -> Mapping[str, str]:
    """Where this task sits in its job, as SLURM says it (`executors.nodes`). Under
    `submitit.LocalExecutor` every task runs on this host: its submitit rank is the node."""
    if "SLURM_JOB_NODELIST" in os.environ or "SLURM_NODELIST" in os.environ:
        return os.environ
    import submitit  # optional dependency: the submitit executor's

    job = submitit.JobEnvironment()
    return {
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_NODEID": str(job.global_rank),
        "SLURM_JOB_ID": str(job.job_id).split("_")[0] if str(job.job_id)[:1].isdigit() else "0",
    }


def submitit_job(job: ExtractJob, index: int) -> dict[str, Any]:
    """What one job runs (pickled by submitit): open the engine, run the unit loop. A job of
    a multi-node engine runs this on each of its nodes; only rank 0's node is a worker."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if job.nnodes > 1:
        job = engine_node(job, task_env())
        if node_rank_of(job) > 0:
            return serve_follower(job)
    backend = open_worker_backend(job)
    try:
        return run_worker(job, backend, owner=f"job{index}-{default_owner()}")
    finally:
        backend.close()


def executor_for(job: ExtractJob) -> Any:
    """A submitit executor for `extract.submitit` (LocalExecutor or SLURM's)."""
    import submitit  # optional dep: submitit

    settings = SubmititSettings.from_job(job)
    units = UnitSettings.from_job(job)
    folder = settings.folder
    if folder is None:
        root = units.local_root
        if root is None:
            raise ConfigError("extract.submitit.folder is needed when the store is not local")
        folder = str(root / "submitit")
    Path(folder).mkdir(parents=True, exist_ok=True)
    executor: Any
    params = dict(settings.parameters)
    nnodes = job.nnodes
    if settings.cluster == "local":
        executor = submitit.LocalExecutor(folder=folder)
        if nnodes > 1:  # one task per "node", all of them on this machine
            params["tasks_per_node"] = nnodes
        executor.update_parameters(timeout_min=settings.timeout_min, **params)
    else:
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
        if nnodes > 1:  # one job = one engine over nnodes nodes, one task on each
            params.update(nodes=nnodes, tasks_per_node=1)
        executor.update_parameters(timeout_min=settings.timeout_min, **params)
    return executor


def submit(job: ExtractJob, n: int, *, first_index: int = 0) -> list[Any]:
    """Submit `n` unit-worker jobs (each pickles the job); returns their submitit jobs."""
    executor = executor_for(job)
    return [executor.submit(submitit_job, job, first_index + i) for i in range(n)]


def wait(jobs: list[Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Each finished job's summary, and the failures of the others."""
    done: list[dict[str, Any]] = []
    errors: list[str] = []
    for job in jobs:
        try:
            # Task 0 is the worker; a multi-node engine's other tasks served their ranks.
            done.append(job.results()[0])
        except Exception as exc:  # noqa: BLE001 - a failed job is reported, its units taken over
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.warning("submitit job %s ended without finishing: %s", job.job_id, first)
            errors.append(f"job {job.job_id}: {first}")
    return done, errors


def run_submitit(job: ExtractJob) -> dict[str, Any]:
    """Extract with `extract.units.workers` submitit jobs and wait for them."""
    units = UnitSettings.from_job(job)
    units.open()
    started = time.monotonic()
    jobs = submit(job, units.workers)
    done, errors = wait(jobs)
    summary = run_summary(
        job,
        done,
        worker_errors=errors,
        jobs=[str(j.job_id) for j in jobs],
        wall_s=round(time.monotonic() - started, 3),
    )
    if not summary["complete"]:
        missing = summary["status"]["units"] - summary["status"]["committed"]
        raise StoreError(
            f"unit store {summary['store']}: {missing} units not committed (every job died); "
            "run the same command again to finish them"
        )
    return summary
