"""Executors of the extract stage on the unit protocol (docs/distributed.md).

`extract.executor` picks who runs the unit workers (`executors.worker.run_worker`):

* `local`: this process is one worker. Start as many as you like, by hand or as a job array
  (Hydra's submitit launcher: `-m hydra/launcher=... extract.worker=0,1,2,3`).
* `ray`: `extract.units.workers` Ray actors, one engine each (`ray_executor`).
* `submitit`: `extract.units.workers` submitit jobs, on SLURM or this machine
  (`submitit_executor`).

A multi-node engine (`extract.nnodes` > 1) is one worker: only the node of rank 0 claims
units; the other nodes serve their tensor-parallel ranks (`worker.serve_follower`).

All of them write the same unit store (`kimi_pipe.store.units`); `extract.executor=null`
keeps the work shards and merge of `extraction/sharding.py`.
"""

from __future__ import annotations

import os
from typing import Any

from kimi_pipe.extraction.executors.nodes import engine_node, node_rank_of
from kimi_pipe.extraction.executors.worker import (
    executor_of,
    open_worker_backend,
    run_summary,
    run_worker,
    serve_follower,
)
from kimi_pipe.extraction.job import EXECUTORS, ExtractJob
from kimi_pipe.extraction.token_samples import Backend

__all__ = ["EXECUTORS", "executor_of", "run_executor"]


def run_executor(job: ExtractJob, backend: Backend | None = None) -> dict[str, Any]:
    """Run `extract.executor` to the end; the run's summary. `backend` (local only): an open
    engine to use instead of loading one."""
    name = executor_of(job)
    if name == "ray":
        from kimi_pipe.extraction.executors.ray_executor import run_ray  # optional dep: ray

        return run_ray(job)
    if name == "submitit":
        from kimi_pipe.extraction.executors.submitit_executor import run_submitit  # submitit

        return run_submitit(job)
    # A multi-node engine (extract.nnodes > 1) under SLURM: which node this job task is.
    job = engine_node(job, os.environ)
    if node_rank_of(job) > 0:
        return serve_follower(job)
    own = backend is None
    engine = backend or open_worker_backend(job)
    try:
        mine = run_worker(job, engine)
    finally:
        if own:
            engine.close()
    return run_summary(job, [mine])
