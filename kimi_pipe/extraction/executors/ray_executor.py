"""`extract.executor=ray`: one Ray actor per engine, each a unit worker (docs/distributed.md).

Ray places the actors (`extract.ray.cpus_per_worker` / `gpus_per_worker`: one engine, e.g.
a TP group of 8 GPUs), restarts one whose process died and retries its call
(`max_restarts`), and lets workers join a running pool (`RayPool.add`). It schedules
nothing else: which unit a worker does next is decided by the leases in the store, so a
dead actor's unit is taken over by whoever claims it after its lease ends, restarted or not.

    python -m kimi_pipe extract extract.executor=ray extract.units.workers=4 \
        extract.ray.gpus_per_worker=8 extract.run_dir=runs/B5/x        # address: auto, or local
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.errors import ConfigError, StoreError
from kimi_pipe.extraction.executors.worker import (
    UnitSettings,
    open_worker_backend,
    run_summary,
    run_worker,
)
from kimi_pipe.store.units import default_owner

log = logging.getLogger("kimi_pipe.extract")


@dataclass(frozen=True)
class RaySettings:
    """`extract.ray.*`."""

    address: str | None = None  # null: start a local cluster; "auto": join the running one
    num_cpus: int | None = None  # of a local cluster (null: Ray counts them)
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    max_restarts: int = 3  # a dead actor's process is restarted this often, its call retried

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> RaySettings:
        node = OmegaConf.select(cfg, "extract.ray", default=None)
        raw: dict[str, Any] = {}
        if node is not None:
            container = OmegaConf.to_container(node, resolve=True)
            if not isinstance(container, dict):
                raise ConfigError("extract.ray must be a mapping of settings")
            raw = {str(k): v for k, v in container.items()}
        try:
            out = cls(
                address=str(raw["address"]) if raw.get("address") else None,
                num_cpus=int(raw["num_cpus"]) if raw.get("num_cpus") is not None else None,
                cpus_per_worker=float(raw.get("cpus_per_worker", 1.0)),
                gpus_per_worker=float(raw.get("gpus_per_worker", 0.0)),
                max_restarts=int(raw.get("max_restarts", 3)),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"extract.ray: {exc}") from None
        if out.cpus_per_worker < 0 or out.gpus_per_worker < 0 or out.max_restarts < 0:
            raise ConfigError("extract.ray: cpus_per_worker, gpus_per_worker, max_restarts >= 0")
        return out


class UnitActor:
    """A Ray actor: opens one engine and runs the unit loop on it."""

    def __init__(self, cfg: dict[str, Any], index: int) -> None:
        self.cfg = OmegaConf.create(cfg)
        self.backend = open_worker_backend(self.cfg)  # type: ignore[arg-type]
        # A new name per process: a restarted actor's attempts never mix with the dead one's.
        self.owner = f"ray{index}-{default_owner()}"

    def name(self) -> str:
        return self.owner

    def run(self, wait_for_held: bool = True, max_units: int | None = None) -> dict[str, Any]:
        return run_worker(
            self.cfg,  # type: ignore[arg-type]
            self.backend,
            owner=self.owner,
            wait_for_held=wait_for_held,
            max_units=max_units,
        )


def _remote_actor(settings: RaySettings) -> Any:
    import ray

    return ray.remote(
        num_cpus=settings.cpus_per_worker,
        num_gpus=settings.gpus_per_worker,
        max_restarts=settings.max_restarts,
        max_task_retries=settings.max_restarts,
    )(UnitActor)


class RayPool:
    """Unit workers as Ray actors. `start(n)` then `wait()`; `add(n)` while it runs."""

    def __init__(self, cfg: DictConfig, settings: RaySettings | None = None) -> None:
        import ray

        self.cfg = cfg
        self.settings = settings or RaySettings.from_cfg(cfg)
        self.units = UnitSettings.from_cfg(cfg)
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
        self._container = OmegaConf.to_container(cfg, resolve=True)
        self._actor = _remote_actor(self.settings)
        self.actors: list[Any] = []
        self.calls: list[Any] = []

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
        import ray

        new = [self._actor.remote(self._container, len(self.actors) + i) for i in range(n)]
        if ready_first:
            ray.get([actor.name.remote() for actor in new])
        for actor in new:
            self.actors.append(actor)
            self.calls.append(actor.run.remote(wait_for_held, max_units))
        return new

    def wait(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Every actor's summary, and the errors of those that died for good (their units
        were taken over by the others)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        done: list[dict[str, Any]] = []
        errors: list[str] = []
        for call in self.calls:
            try:
                done.append(ray.get(call))
            except (RayActorError, RayTaskError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                log.warning("a Ray unit worker ended without finishing: %s", first)
                errors.append(f"{type(exc).__name__}: {first}")
        return done, errors

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self._owns_cluster:
            ray.shutdown()


def run_ray(cfg: DictConfig) -> dict[str, Any]:
    """Extract with `extract.units.workers` Ray actors; the run's summary."""
    pool = RayPool(cfg)
    started = time.monotonic()
    try:
        pool.add(pool.units.workers)
        done, errors = pool.wait()
    finally:
        pool.close()
    summary = run_summary(
        cfg, done, worker_errors=errors, wall_s=round(time.monotonic() - started, 3)
    )
    if not summary["complete"]:
        missing = summary["status"]["units"] - summary["status"]["committed"]
        raise StoreError(
            f"unit store {summary['store']}: {missing} units not committed (every worker "
            "died); run the same command again to finish them"
        )
    return summary
