"""The engine's tensor-parallel ranks as the backend drives them, without SGLang.

Rank 0 lives in the calling process and returns the states; every other rank runs the same
forwards (the states are replicated after the all-reduce, so rank 0's copy is complete) and
reports one status per step: ok, oom or error. On rank 0's node the others are spawned
processes fed through queues (`_follower_main`). In a multi-node engine each other node runs
`serve_node`: it spawns its own ranks the same way and relays rank 0's requests to them and
their statuses back over one connection (`multiprocessing.connection`) to rank 0's
`RankGroup`, at dist_init_addr's port + 1. The tensors never travel on it: only the batch's
token ids and the statuses; the states stay on rank 0, the collectives go through
torch.distributed as SGLang sets it up.

The channel has the same trust as torch.distributed's own TCP store at dist_init_addr (its
key derives from the engine's settings, it is no secret): run engines on the cluster's
private network.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Protocol

import torch

from kimi_pipe.extraction.sglang.settings import EngineSettings, split_address

log = logging.getLogger(__name__)

FOLLOWER_TIMEOUT_S = 3600.0  # one forward of a long batch on a 1T model can take minutes
CONNECT_TIMEOUT_S = 1800.0  # a follower node waits this long for rank 0's node (weights load)
# What rank 0 sends its followers: a capture batch, or ("logits", prefix, continuations, rows).
LOGITS_REQUEST = "logits"


class Rank(Protocol):
    """One tensor-parallel rank of the engine."""

    num_layers: int
    hidden_size: int
    max_total_tokens: int
    max_requests: int

    def set_layers(self, output_ids: Sequence[int]) -> list[int]:
        """Capture these "output of layer" ids; returns the capture ids in effect. A rank that
        overrode the engine's own choice may set `overridden_capture_ids` (the manifest
        records them as sglang_default_capture_ids)."""
        ...

    def forward(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Packed states of the batch, [sum L, k*H] and [sum L, H] (rank 0; others None).
        Raises torch.OutOfMemoryError on all ranks when any rank ran out of memory."""
        ...

    def close(self) -> None: ...


class ScoringRank(Rank, Protocol):
    """A rank that also returns the engine's logits (target resolution and the split check)."""

    def logits(
        self, prefix: list[int], continuations: list[list[int]], rows: list[list[int]]
    ) -> list[torch.Tensor] | None:
        """The KV of `prefix` is computed once in the engine's pool; every continuation is then
        extended on it, all in one batch (prefix sharing, as SGLang's radix cache does). Per
        continuation, the float32 logits [len(rows[i]), vocab] of its positions `rows[i]` (row
        j = continuation token j, predicting the token after it). Rank 0; others None."""
        ...


RankFactory = Callable[[EngineSettings, int, int], Rank]  # (settings, tp_rank, nccl_port)


def free_port(span: int = 2, attempts: int = 64) -> int:
    """A port that is free with the `span - 1` after it: an engine's dist_init_addr port is
    followed by its rank channel (`control_address`), so a port whose successor is taken
    fails at bind time. Both are held while checked; another process may still take one
    after this returns, as with any free-port probe."""
    for _ in range(attempts):
        with socket.socket() as first:
            first.bind(("", 0))  # every interface, as the rank channel's listener binds
            port = int(first.getsockname()[1])
            if port + span - 1 > 65535:
                continue
            held = []
            try:
                for offset in range(1, span):
                    s = socket.socket()
                    held.append(s)
                    s.bind(("", port + offset))
            except OSError:
                continue
            finally:
                for s in held:
                    s.close()
            return port
    raise RuntimeError(f"no {span} consecutive free ports in {attempts} tries")


def control_address(settings: EngineSettings) -> tuple[str, int]:
    """Where rank 0's node listens for the follower nodes: dist_init_addr's host, port + 1
    (SGLang's own server would use the ports after it; this backend runs no server)."""
    assert settings.dist_init_addr is not None
    host, port = split_address(settings.dist_init_addr)
    return host, port + 1


def _authkey(settings: EngineSettings) -> bytes:
    """Both ends derive it: a connection from another engine (or another run) is refused."""
    ident = f"{settings.dist_init_addr}|{settings.model_path}|{settings.tp_size}|{settings.nnodes}"
    return hashlib.sha256(ident.encode()).digest()


def _follower_main(
    factory: RankFactory,
    settings: EngineSettings,
    tp_rank: int,
    nccl_port: int,
    output_ids: list[int],
    inbox: Any,
    outbox: Any,
) -> None:
    """Every rank but 0: run every forward rank 0 runs, report ok/oom/error."""
    try:
        rank = factory(settings, tp_rank, nccl_port)
        rank.set_layers(output_ids)
        outbox.put(("ready", tp_rank, None))
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises
        outbox.put(("error", tp_rank, f"{type(exc).__name__}: {exc}"))
        return
    while True:
        batch = inbox.get()
        if batch is None:
            rank.close()
            return
        try:
            if isinstance(batch, tuple) and batch[0] == LOGITS_REQUEST:
                rank.logits(*batch[1:])  # type: ignore[attr-defined]
            else:
                rank.forward(batch)
            outbox.put(("ok", tp_rank, None))
        except torch.OutOfMemoryError:
            outbox.put(("oom", tp_rank, None))
        except Exception as exc:  # noqa: BLE001
            outbox.put(("error", tp_rank, f"{type(exc).__name__}: {exc}"))
            return


class _LocalRanks:
    """This node's ranks other than rank 0, as spawned processes fed through queues."""

    def __init__(
        self,
        factory: RankFactory,
        settings: EngineSettings,
        ranks: Sequence[int],
        nccl_port: int,
        output_ids: list[int],
    ) -> None:
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self.outbox: Any = ctx.Queue()
        self.procs: list[tuple[int, Any]] = []
        self.inboxes: list[Any] = []
        for r in ranks:
            inbox = ctx.Queue()
            proc = ctx.Process(
                target=_follower_main,
                args=(factory, settings, r, nccl_port, output_ids, inbox, self.outbox),
                daemon=True,
            )
            proc.start()
            self.procs.append((r, proc))
            self.inboxes.append(inbox)

    def send(self, request: Any) -> None:
        for inbox in self.inboxes:
            inbox.put(request)

    def dead(self) -> list[int]:
        return [r for r, p in self.procs if not p.is_alive()]

    def close(self) -> None:
        self.send(None)
        for _, proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
        self.procs.clear()
        self.inboxes.clear()


class RankGroup:
    """Every rank but 0, seen from rank 0: its own node's (spawned here) and, in a multi-node
    engine, the other nodes' (each behind one `serve_node` connection). `send` a request to
    all, then `wait` for one status from each."""

    def __init__(
        self,
        factory: RankFactory,
        settings: EngineSettings,
        nccl_port: int,
        output_ids: list[int] | None,
    ) -> None:
        self.size = settings.tp_size - 1  # statuses per step
        local = [r for r in settings.local_ranks if r != 0]
        self._local: _LocalRanks | None = None
        self._nodes: dict[int, Connection] = {}
        self._listener: Listener | None = None
        self._accepting: threading.Thread | None = None
        self._accept_error: BaseException | None = None
        if self.size and output_ids is None:
            raise ValueError(
                f"{settings.model_path}/config.json has no num_hidden_layers; set "
                "extract.layer_ids explicitly for tensor-parallel capture"
            )
        if local:
            assert output_ids is not None
            self._local = _LocalRanks(factory, settings, local, nccl_port, output_ids)
        self.outbox: Any = self._local.outbox if self._local else queue.Queue()
        if settings.nnodes > 1:
            host, port = control_address(settings)
            # Every interface: dist_init_addr names this node as the others reach it.
            self._listener = Listener(("0.0.0.0", port), authkey=_authkey(settings))
            self._accepting = threading.Thread(
                target=self._accept, args=(settings.nnodes - 1, list(output_ids or [])), daemon=True
            )
            self._accepting.start()
            log.info("rank 0 waits for %d follower node(s) on port %d", settings.nnodes - 1, port)

    def _accept(self, n: int, output_ids: list[int]) -> None:
        assert self._listener is not None
        try:
            while len(self._nodes) < n:
                conn = self._listener.accept()
                node_rank = int(conn.recv())
                conn.send(output_ids)  # the same layers on every rank
                self._nodes[node_rank] = conn
                threading.Thread(target=self._relay, args=(node_rank, conn), daemon=True).start()
        except BaseException as exc:  # noqa: BLE001 - raised by wait_nodes
            self._accept_error = exc

    def _relay(self, node_rank: int, conn: Connection) -> None:
        """A follower node's statuses into the outbox, and its loss as an error status."""
        while True:
            try:
                status = conn.recv()
            except (EOFError, OSError):
                self.outbox.put(("error", -node_rank, f"node {node_rank} disconnected"))
                return
            self.outbox.put(status)

    def wait_nodes(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Every follower node connected (rank 0's engine is built: the others joined)."""
        if self._accepting is None:
            return
        self._accepting.join(timeout_s)
        if self._accept_error is not None:
            raise RuntimeError(f"follower nodes: {self._accept_error}") from self._accept_error
        if self._accepting.is_alive():
            raise RuntimeError(f"the follower nodes did not connect in {timeout_s:.0f}s")

    def send(self, request: Any) -> None:
        if self._local is not None:
            self._local.send(request)
        for conn in self._nodes.values():
            conn.send(request)

    def wait(self, ok: set[str]) -> bool:
        """Collect one status from every other rank; True if any reported out-of-memory."""
        oom = False
        for _ in range(self.size):
            status, rank, detail = self._next_status()
            if status == "error":
                where = f"node {-rank}" if rank < 0 else f"tensor-parallel rank {rank}"
                raise RuntimeError(f"{where} failed: {detail}")
            if status == "oom":
                oom = True
            elif status not in ok:
                raise RuntimeError(f"tensor-parallel rank {rank}: unexpected status {status!r}")
        return oom

    def _next_status(self) -> tuple[str, int, str | None]:
        """Next status; a local rank that died without a word is an error too."""
        waited = 0.0
        while waited < FOLLOWER_TIMEOUT_S:
            try:
                return self.outbox.get(timeout=5.0)  # type: ignore[no-any-return]
            except queue.Empty:
                waited += 5.0
            dead = self._local.dead() if self._local else []
            if dead:
                raise RuntimeError(f"tensor-parallel rank(s) {dead} exited; see their log above")
        raise RuntimeError(f"no answer from the tensor-parallel ranks in {FOLLOWER_TIMEOUT_S}s")

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
            self._local = None
        for conn in self._nodes.values():
            try:
                conn.send(None)
                conn.close()
            except OSError:
                pass
        self._nodes.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def serve_node(
    settings: EngineSettings,
    factory: RankFactory,
    *,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> int:
    """A follower node (node_rank > 0) of a multi-node engine: spawn this node's ranks, then
    relay rank 0's requests to them and their statuses back until rank 0 closes the engine.
    Returns how many requests it relayed. Only rank 0's node claims work."""
    if settings.nnodes < 2 or settings.node_rank == 0:
        raise ValueError("serve_node runs the nodes of a multi-node engine other than rank 0's")
    host, port = control_address(settings)
    conn = _connect((host, port), _authkey(settings), connect_timeout_s)
    conn.send(settings.node_rank)
    output_ids = list(conn.recv())
    ranks = list(settings.local_ranks)
    local = _LocalRanks(factory, settings, ranks, free_port(), output_ids)
    relayed = 0
    try:
        for _ in ranks:  # "ready" (or the error) of each rank here
            conn.send(_status(local))
        while True:
            request = conn.recv()
            if request is None:
                return relayed
            local.send(request)
            relayed += 1
            for _ in ranks:
                status = _status(local)
                conn.send(status)
                if status[0] == "error":
                    return relayed
    except (EOFError, OSError):
        log.warning("rank 0's node closed the connection; node %d stops", settings.node_rank)
        return relayed
    finally:
        local.close()
        conn.close()


def _status(local: _LocalRanks) -> tuple[str, int, str | None]:
    waited = 0.0
    while waited < FOLLOWER_TIMEOUT_S:
        try:
            return local.outbox.get(timeout=5.0)  # type: ignore[no-any-return]
        except queue.Empty:
            waited += 5.0
        dead = local.dead()
        if dead:
            return ("error", dead[0], f"tensor-parallel rank(s) {dead} exited")
    return ("error", -1, f"no answer from this node's ranks in {FOLLOWER_TIMEOUT_S}s")


def _connect(address: tuple[str, int], authkey: bytes, timeout_s: float) -> Connection:
    """Rank 0's node may still be loading: retry until it listens."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, authkey=authkey)
        except (ConnectionRefusedError, OSError) as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank 0's node at {address[0]}:{address[1]} did not answer in "
                    f"{timeout_s:.0f}s ({exc})"
                ) from None
            time.sleep(1.0)
