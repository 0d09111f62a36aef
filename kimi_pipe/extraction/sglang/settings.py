"""What `conf/extract/sglang.yaml` says about the engine: `EngineSettings`, the devices, the
version pin and the install hint. Pure Python (torch only to count GPUs): tested without SGLang.

A multi-node engine (`extract.nnodes` > 1) splits its tensor-parallel ranks over the nodes as
SGLang does: node k runs ranks k*(tp/nnodes) .. (k+1)*(tp/nnodes)-1, on its GPUs
base_gpu_id .. base_gpu_id + tp/nnodes - 1; every rank joins one torch.distributed world at
`dist_init_addr` (SGLang's ServerArgs `nnodes`, `node_rank`, `dist_init_addr`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kimi_pipe.errors import ConfigError
from kimi_pipe.extraction.job import ExtractJob
from kimi_pipe.store.conventions import POST_NORM, PRE_NORM

SGLANG_VERSION = "0.5.14"  # keep equal to the pin of the `sglang` extra in pyproject.toml
INSTALL_HINT = (
    f"install sglang=={SGLANG_VERSION} on a machine with NVIDIA GPUs: `pip install '.[sglang]'`, "
    f"or in a separate venv `pip install sglang=={SGLANG_VERSION}` then "
    "`pip install --no-deps -e .`; on an Intel Xeon CPU with AMX: `make sglang-cpu` and run "
    "with .venv-sglang/bin/python (docs/sglang.md)"
)
DEVICES = ("cuda", "cpu")
# SGLang decides CPU vs CUDA once, at import, from this variable (sglang.srt.utils.is_cpu).
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
# Where SGLang loads NCCL from; on CPU it is pointed at a path that cannot load (runner.py).
NCCL_LIBRARY_ENV = "SGLANG_NCCL_SO_PATH"
NO_NCCL_ON_CPU = "/dev/null/no-nccl-on-the-cpu-engine"


def node_ranks(tp_size: int, nnodes: int, node_rank: int) -> range:
    """The tensor-parallel ranks node `node_rank` runs (SGLang's split, sglang.srt.entrypoints.
    engine: tp_size // nnodes consecutive ranks per node)."""
    if nnodes < 1 or tp_size % nnodes:
        raise ConfigError(
            f"extract.tp_size={tp_size} must be divisible by extract.nnodes={nnodes}: every "
            "node runs tp_size/nnodes tensor-parallel ranks"
        )
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"extract.node_rank={node_rank} must be in 0..nnodes-1 ({nnodes} nodes)")
    per_node = tp_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def split_address(addr: str) -> tuple[str, int]:
    """ "host:port" (or "[v6]:port") -> (host, port); a ConfigError when it is not one."""
    host, sep, port = str(addr).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"extract.dist_init_addr must be host:port (rank 0's node, a free port), not {addr!r}"
        )
    return host, int(port)


@dataclass(frozen=True)
class EngineSettings:
    """What `conf/extract/sglang.yaml` says about the engine."""

    model_path: str
    device: str = "cuda"  # cuda | cpu: SGLang's `device` server argument
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    mem_fraction_static: float | None = 0.85
    dtype: str = "bfloat16"
    max_len: int | None = None
    disable_radix_cache: bool = True
    disable_cuda_graph: bool = True
    trust_remote_code: bool = False
    load_format: str = "auto"
    base_gpu_id: int = 0
    # KV pool size in tokens; None = SGLang sizes it from mem_fraction_static (of GPU memory;
    # on CPU, of host memory, which is shared with everything else: set it there).
    max_total_tokens: int | None = None
    # One engine over several nodes (SGLang's --nnodes/--node-rank/--dist-init-addr).
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    server_args: dict[str, Any] = field(default_factory=dict)
    # The final state kept: post_norm (what SGLang's head receives) or pre_norm (the final
    # norm's input, taken by a hook on the text model's norm; its weight goes in the manifest).
    final_state: str = POST_NORM

    def __post_init__(self) -> None:
        if self.final_state not in (PRE_NORM, POST_NORM):
            raise ConfigError(
                f"extract.final_state must be {PRE_NORM} or {POST_NORM}, not {self.final_state!r}"
            )
        if self.device not in DEVICES:
            raise ConfigError(
                f"extract.device must be one of {DEVICES} (or auto), not {self.device!r}"
            )
        if self.tp_size < 1 or self.ep_size < 1 or self.dp_size < 1:
            raise ConfigError("extract.tp_size, ep_size and dp_size must be >= 1")
        if self.tp_size % self.ep_size:
            raise ConfigError(
                f"extract.ep_size={self.ep_size} must divide tp_size={self.tp_size} (SGLang "
                "places experts across the tensor-parallel ranks)"
            )
        if self.dp_size != 1:
            # dp>1 in SGLang means DP attention, which scatters the hidden states across
            # ranks; data parallelism here is done by work shards (extract.num_shards).
            raise ConfigError(
                "extract.dp_size > 1 is not supported for capture; run data-parallel copies "
                "as work shards instead (extract.shard=i extract.num_shards=n, one per GPU group)"
            )
        if not self.disable_radix_cache:
            raise ConfigError(
                "extract.disable_radix_cache must stay true: a prefix-cache hit skips the "
                "states of the cached prompt tokens (SGLang issue #8066)"
            )
        node_ranks(self.tp_size, self.nnodes, self.node_rank)  # raises on a bad split
        if self.nnodes > 1:
            if not self.dist_init_addr:
                raise ConfigError(
                    f"extract.nnodes={self.nnodes} needs extract.dist_init_addr=HOST:PORT (the "
                    "node of rank 0; the SLURM and Ray executors set it, docs/distributed.md)"
                )
            split_address(self.dist_init_addr)

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The tensor-parallel ranks this node runs."""
        return node_ranks(self.tp_size, self.nnodes, self.node_rank)

    def gpu_of(self, tp_rank: int) -> int:
        """The GPU of a rank on its own node (SGLang: base_gpu_id + tp_rank % ranks_per_node)."""
        return self.base_gpu_id + tp_rank % self.ranks_per_node

    @classmethod
    def from_job(cls, job: ExtractJob) -> EngineSettings:
        ecfg = job.settings
        path = ecfg.get("model_path") or job.hf_weights
        if not path:
            raise ConfigError(
                "extract.backend=sglang needs the target model: set extract.model_path=DIR "
                "(a Hugging Face model directory, e.g. a local copy of moonshotai/Kimi-K2.5)"
            )
        extra = ecfg.get("server_args") or {}
        device = str(ecfg.get("device") or "cuda")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        max_total = ecfg.get("max_total_tokens")
        if max_total is None and device == "cpu":
            # One batch at a time lives in the pool: size it to the batch, not to host memory.
            max_total = ecfg.get("batch_tokens")
        nnodes, node_rank, addr = _nodes_of(ecfg)
        return cls(
            model_path=str(Path(str(path)).expanduser()),
            device=device,
            tp_size=int(ecfg.get("tp_size", 1)),
            dp_size=int(ecfg.get("dp_size", 1)),
            ep_size=int(ecfg.get("ep_size", 1)),
            mem_fraction_static=ecfg.get("mem_fraction_static"),
            dtype=str(ecfg.get("dtype", "bfloat16")),
            max_len=ecfg.get("max_len"),
            disable_radix_cache=bool(ecfg.get("disable_radix_cache", True)),
            disable_cuda_graph=bool(ecfg.get("disable_cuda_graph", True)),
            trust_remote_code=bool(ecfg.get("trust_remote_code", False)),
            load_format=str(ecfg.get("load_format", "auto")),
            base_gpu_id=_base_gpu_id(ecfg) if device == "cuda" else 0,
            max_total_tokens=int(max_total) if max_total is not None else None,
            nnodes=nnodes,
            node_rank=node_rank,
            dist_init_addr=addr,
            server_args=dict(extra) if extra else {},
            final_state=str(ecfg.get("final_state") or POST_NORM),
        )

    def server_args_kwargs(self, nccl_port: int) -> dict[str, Any]:
        """Keyword arguments of `sglang.srt.server_args.ServerArgs` for capture."""
        kwargs: dict[str, Any] = {
            "model_path": self.model_path,
            "device": self.device,
            "tp_size": self.tp_size,
            "ep_size": self.ep_size,
            "dtype": self.dtype,
            "trust_remote_code": self.trust_remote_code,
            "load_format": self.load_format,
            "skip_tokenizer_init": True,  # ids come from the records, never re-tokenised
            "disable_radix_cache": True,
            "chunked_prefill_size": -1,  # one extend pass per batch: every token's states
            "enable_return_hidden_states": True,
            "disable_overlap_schedule": True,
            "nccl_port": nccl_port,
        }
        if self.nnodes > 1:
            # ModelRunner then joins torch.distributed at tcp://dist_init_addr (every node the
            # same address), not at 127.0.0.1:nccl_port.
            kwargs.update(
                nnodes=self.nnodes, node_rank=self.node_rank, dist_init_addr=self.dist_init_addr
            )
        if self.mem_fraction_static is not None:
            kwargs["mem_fraction_static"] = float(self.mem_fraction_static)
        if self.max_total_tokens is not None:
            kwargs["max_total_tokens"] = int(self.max_total_tokens)
        if self.disable_cuda_graph:
            kwargs["disable_cuda_graph"] = True
        # Free-form extras last: the user's word wins (e.g. attention_backend, quantization).
        kwargs.update(self.server_args)
        return kwargs


def _nodes_of(ecfg: Any) -> tuple[int, int, str | None]:
    """(nnodes, node_rank, dist_init_addr) from `extract.*`; `auto` is for the executors to
    fill in (executors/nodes.py) and means nothing to a one-node engine."""
    try:
        nnodes = int(ecfg.get("nnodes") or 1)
    except (TypeError, ValueError):
        raise ConfigError("extract.nnodes must be an integer") from None
    rank, addr = ecfg.get("node_rank"), ecfg.get("dist_init_addr")
    if nnodes <= 1:
        rank = 0 if rank in (None, "auto") else rank
        addr = None if addr in (None, "auto") else addr
    elif "auto" in (rank, addr) or rank is None:
        raise ConfigError(
            f"extract.nnodes={nnodes}: extract.node_rank and dist_init_addr are auto (or unset): "
            "the executors fill them in (extract.executor=local or submitit under SLURM, or "
            "ray); set both by hand otherwise (docs/distributed.md)"
        )
    try:
        node_rank = int(rank)
    except (TypeError, ValueError):
        raise ConfigError(f"extract.node_rank must be an integer, not {rank!r}") from None
    return nnodes, node_rank, str(addr) if addr else None


def _base_gpu_id(ecfg: Mapping[str, Any]) -> int:
    """First GPU of this work shard: extract.base_gpu_id, else shard * tp_size modulo the
    visible GPUs (shards launched together on one node take disjoint GPU groups; a SLURM job
    sees only its own GPUs, so it starts at 0). A multi-node engine starts at 0 on each node."""
    value = ecfg.get("base_gpu_id")
    if value is not None:
        return int(value)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0 or int(ecfg.get("nnodes") or 1) > 1:
        return 0
    shard = int(ecfg.get("shard", 0) or 0)
    return (shard * int(ecfg.get("tp_size", 1))) % visible
