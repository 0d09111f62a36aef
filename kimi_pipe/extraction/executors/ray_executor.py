"""`extract.executor=ray`: one Ray actor per engine, each a unit worker (docs/distributed.md).

Ray places the actors (`extract.ray.cpus_per_worker` / `gpus_per_worker`: one engine, e.g.
a TP group of 8 GPUs), restarts one whose process died and retries its call
(`max_restarts`), and lets workers join a running pool (`RayPool.add`). It schedules
nothing else: which unit a worker does next is decided by the leases in the store, so a
dead actor's unit is taken over by whoever claims it after its lease ends, restarted or not.

    python -m kimi_pipe extract extract.executor=ray extract.units.workers=4 \
        extract.ray.gpus_per_worker=8 extract.run_dir=runs/B5/x        # address: auto, or local

A multi-node engine (`extract.nnodes` > 1) is one placement group of `nnodes` bundles (one
per node: `cpus_per_worker` CPUs and `gpus_per_worker` GPUs, `node_strategy` STRICT_SPREAD):
the actor on bundle 0 is rank 0's node and the unit worker; the actors on the other bundles
serve their ranks (`worker.serve_follower`) and claim nothing. rank 0's address is its
node's IP and a free port there. Such an engine is not restarted: a node lost ends it, and
its unit is taken over by another engine after its lease.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kimi_pipe.errors import ConfigError, StoreError
from kimi_pipe.extraction.executors.worker import (
    UnitSettings,
    open_worker_backend,
    run_summary,
    run_worker,
    serve_follower,
)
from kimi_pipe.extraction.job import ExtractJob
from kimi_pipe.extraction.sglang.ranks import free_port
from kimi_pipe.store.units import default_owner

log = logging.getLogger("kimi_pipe.extract")

# Ray's placement strategies; STRICT_SPREAD puts every node of an engine on its own machine.
STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")
PG_READY_S = 600.0  # an engine's nodes must all be placed within this


def with_node(job: ExtractJob, node_rank: int, addr: str) -> ExtractJob:
    """The job of one node of a multi-node engine."""
    return job.with_settings(node_rank=node_rank, dist_init_addr=addr)


def node_address() -> tuple[str, int]:
    """This node's IP and a free port on it: rank 0's dist_init_addr (run on bundle 0)."""
    import ray  # optional dependency: the ray executor's

    return ray.util.get_node_ip_address(), free_port()


@dataclass(frozen=True)
class RaySettings:
    """`extract.ray.*`."""

    address: str | None = None  # null: start a local cluster; "auto": join the running one
    num_cpus: int | None = None  # of a local cluster (null: Ray counts them)
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    max_restarts: int = 3  # a dead actor's process is restarted this often, its call retried
    node_strategy: str = "STRICT_SPREAD"  # a multi-node engine's bundles: one per node

    @classmethod
    def from_job(cls, job: ExtractJob) -> RaySettings:
        node = job.get("ray")
        raw: dict[str, Any] = {}
        if node is not None:
            if not isinstance(node, Mapping):
                raise ConfigError("extract.ray must be a mapping of settings")
            raw = {str(k): v for k, v in node.items()}
        try:
            out = cls(
                address=str(raw["address"]) if raw.get("address") else None,
                num_cpus=int(raw["num_cpus"]) if raw.get("num_cpus") is not None else None,
                cpus_per_worker=float(raw.get("cpus_per_worker", 1.0)),
                gpus_per_worker=float(raw.get("gpus_per_worker", 0.0)),
                max_restarts=int(raw.get("max_restarts", 3)),
                node_strategy=str(raw.get("node_strategy") or "STRICT_SPREAD"),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"extract.ray: {exc}") from None
        if out.cpus_per_worker < 0 or out.gpus_per_worker < 0 or out.max_restarts < 0:
            raise ConfigError("extract.ray: cpus_per_worker, gpus_per_worker, max_restarts >= 0")
        if out.node_strategy not in STRATEGIES:
            raise ConfigError(f"extract.ray.node_strategy must be one of {STRATEGIES}")
        return out

    def engine_bundles(self, nnodes: int) -> list[dict[str, float]]:
        """A multi-node engine's placement group: one bundle per node, each one node's share
        of the engine (its tensor-parallel ranks' GPUs)."""
        bundle = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker
        return [dict(bundle) for _ in range(nnodes)]


class UnitActor:
    """A Ray actor: opens one engine and runs the unit loop on it."""

    def __init__(self, job: ExtractJob, index: int) -> None:
        self.job = job
        self.backend = open_worker_backend(job)
        # A new name per process: a restarted actor's attempts never mix with the dead one's.
        self.owner = f"ray{index}-{default_owner()}"

    def name(self) -> str:
        return self.owner

    def run(self, wait_for_held: bool = True, max_units: int | None = None) -> dict[str, Any]:
        return run_worker(
            self.job,
            self.backend,
            owner=self.owner,
            wait_for_held=wait_for_held,
            max_units=max_units,
        )


class NodeActor:
    """A Ray actor on one of the other nodes of a multi-node engine: serves its ranks."""

    def __init__(self, job: ExtractJob) -> None:
        self.job = job

    def serve(self) -> dict[str, Any]:
        return serve_follower(self.job)


def _remote_actor(settings: RaySettings) -> Any:
    import ray  # optional dep: ray

    return ray.remote(
        num_cpus=settings.cpus_per_worker,
        num_gpus=settings.gpus_per_worker,
        max_restarts=settings.max_restarts,
        max_task_retries=settings.max_restarts,
    )(UnitActor)


class RayPool:
    """Unit workers as Ray actors. `start(n)` then `wait()`; `add(n)` while it runs."""

    def __init__(self, job: ExtractJob, settings: RaySettings | None = None) -> None:
        import ray  # optional dep: ray

        self.job = job
        self.settings = settings or RaySettings.from_job(job)
        self.units = UnitSettings.from_job(job)
        self.units.open()  # a bad store location fails here, before any actor starts
        self._owns_cluster = False
        if not ray.is_initialized():
            ray.init(
                address=self.settings.address,
                num_cpus=self.settings.num_cpus if self.settings.address is None else None,
                include_dashboard=False,
                log_to_driver=True,
            )
            self._owns_cluster = True
        self._actor = _remote_actor(self.settings)
        self.nnodes = job.nnodes
        self.actors: list[Any] = []
        self.calls: list[Any] = []
        self.nodes: list[Any] = []  # actors of the other nodes of multi-node engines
        self.node_calls: list[Any] = []
        self.groups: list[Any] = []  # their placement groups

    def add(
        self,
        n: int = 1,
        *,
        wait_for_held: bool = True,
        max_units: int | None = None,
        ready_first: bool = False,
    ) -> list[Any]:
        """Start `n` more actors, each running the unit loop; returns their handles.
        `ready_first`: wait until every new actor has opened its engine before any of them
        claims a unit (a benchmark measures the extraction alone)."""
        import ray  # optional dep: ray

        if self.nnodes > 1:
            new = [self._engine_over_nodes(len(self.actors) + i) for i in range(n)]
        else:
            new = [self._actor.remote(self.job, len(self.actors) + i) for i in range(n)]
        if ready_first:
            ray.get([actor.name.remote() for actor in new])
        for actor in new:
            self.actors.append(actor)
            self.calls.append(actor.run.remote(wait_for_held, max_units))
        return new

    def _engine_over_nodes(self, index: int) -> Any:
        """One engine over `nnodes` Ray nodes: its placement group, rank 0's address on
        bundle 0, the unit worker there and the other nodes' actors. Returns the worker."""
        import ray  # optional dependency: the ray executor's
        from ray.util.placement_group import placement_group  # optional dep: ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # optional dep

        group = placement_group(
            self.settings.engine_bundles(self.nnodes), strategy=self.settings.node_strategy
        )
        self.groups.append(group)
        ready, _ = ray.wait([group.ready()], timeout=PG_READY_S)
        if not ready:
            raise StoreError(
                f"Ray could not place a {self.nnodes}-node engine in {PG_READY_S:.0f}s "
                f"({self.settings.node_strategy}: {self.nnodes} nodes with "
                f"{self.settings.engine_bundles(1)[0]} each)"
            )

        def on(bundle: int) -> Any:
            return PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=bundle
            )

        where = ray.remote(num_cpus=0)(node_address).options(scheduling_strategy=on(0))
        host, port = ray.get(where.remote())
        addr = f"{host}:{port}"
        options = {
            "num_cpus": self.settings.cpus_per_worker,
            "num_gpus": self.settings.gpus_per_worker,
            "max_restarts": 0,  # a restarted node could not rejoin its engine
            "max_task_retries": 0,
        }
        node_actor: Any = ray.remote(NodeActor)
        head = (
            ray.remote(UnitActor)
            .options(scheduling_strategy=on(0), **options)
            .remote(with_node(self.job, 0, addr), index)
        )
        for k in range(1, self.nnodes):
            node = node_actor.options(scheduling_strategy=on(k), **options).remote(
                with_node(self.job, k, addr)
            )
            self.nodes.append(node)
            self.node_calls.append(node.serve.remote())
        log.info("engine %d over %d nodes, rank 0 at %s", index, self.nnodes, addr)
        return head

    def wait(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Every actor's summary, and the errors of those that died for good (their units
        were taken over by the others)."""
        import ray  # optional dep: ray
        from ray.exceptions import RayActorError, RayTaskError  # optional dep: ray

        done: list[dict[str, Any]] = []
        errors: list[str] = []
        for call in self.calls:
            try:
                done.append(ray.get(call))
            except (RayActorError, RayTaskError) as exc:
                reason = _why(exc)
                log.warning("a Ray unit worker ended without finishing: %s", reason)
                errors.append(reason)
        return done, errors

    def close(self) -> None:
        import ray  # optional dep: ray

        for actor in self.actors + self.nodes:
            ray.kill(actor, no_restart=True)
        if self.groups:
            from ray.util.placement_group import remove_placement_group  # optional: ray

            for group in self.groups:
                remove_placement_group(group)
        if self._owns_cluster:
            ray.shutdown()


def _why(exc: BaseException) -> str:
    """One line on why a worker's call failed: the worker's own exception when Ray carries
    it (a RayTaskError's first line names only the call and the process)."""
    name, cause = type(exc).__name__, getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        if type(cause).__name__ not in name:  # Ray names the class RayTaskError(Cause)
            name += f"({type(cause).__name__})"
        exc = cause
    text = str(exc).strip().splitlines()
    return f"{name}: {text[0] if text else ''}"


def run_ray(job: ExtractJob) -> dict[str, Any]:
    """Extract with `extract.units.workers` Ray actors; the run's summary."""
    pool = RayPool(job)
    started = time.monotonic()
    try:
        pool.add(pool.units.workers)
        done, errors = pool.wait()
    finally:
        pool.close()
    summary = run_summary(
        job, done, worker_errors=errors, wall_s=round(time.monotonic() - started, 3)
    )
    if not summary["complete"]:
        missing = summary["status"]["units"] - summary["status"]["committed"]
        raise StoreError(
            f"unit store {summary['store']}: {missing} units not committed (every worker "
            "died); run the same command again to finish them"
        )
    return summary
