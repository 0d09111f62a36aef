"""Which node of a multi-node engine this process is (`extract.nnodes` > 1), from SLURM.

A multi-node engine is one SLURM job of `nnodes` nodes, one task per node (Hydra's submitit
launcher `nodes: 2, tasks_per_node: 1`, or `extract.submitit.parameters.nodes`). Every task
runs the same command; each derives its `node_rank` from `SLURM_NODEID` (else
`SLURM_PROCID`) and the engine's `dist_init_addr` from the first host of
`SLURM_JOB_NODELIST` and a port derived from `SLURM_JOB_ID` (two engines on one host never
pick the same one). Settings given on the command line win over the environment.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from itertools import product

from kimi_pipe.errors import ConfigError
from kimi_pipe.extraction.job import ExtractJob

AUTO = "auto"
PORT_BASE = 20000  # dist_init_addr's port in a SLURM job: PORT_BASE + (job id % PORT_SLOTS) * 8
PORT_SLOTS = 5000  # each engine uses its port and the next (the rank channel, sglang.ranks)


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets: "a[1,3],b" -> ["a[1,3]", "b"]."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in node list {text!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced '[' in node list {text!r}")
    parts.append(cur)
    return [p for p in parts if p]


def _expand_range(spec: str) -> list[str]:
    """ "01-03,7" -> ["01", "02", "03", "7"] (zero padding kept, as SLURM writes it)."""
    out: list[str] = []
    for item in spec.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in a node list")
        if not sep:
            out.append(lo)
            continue
        width = len(lo) if lo.startswith("0") else 0
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in a node list")
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list -> host names in order: "gpu[01-02]" -> ["gpu01", "gpu02"];
    "a1,b2" -> ["a1", "b2"]; "rack[1-2]-n[1,3]" -> rack1-n1, rack1-n3, rack2-n1, rack2-n3."""
    hosts: list[str] = []
    for entry in _split_top(nodelist.strip()):
        pieces = re.split(r"\[([^\]]*)\]", entry)  # text, range, text, range, ..., text
        choices = [[p] if i % 2 == 0 else _expand_range(p) for i, p in enumerate(pieces)]
        hosts.extend("".join(combo) for combo in product(*choices))
    if not hosts:
        raise ValueError(f"empty node list {nodelist!r}")
    return hosts


def slurm_node(env: Mapping[str, str]) -> tuple[int, str, int] | None:
    """(node_rank, first host, port) of this task in a SLURM job; None outside SLURM."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    rank = env.get("SLURM_NODEID") or env.get("SLURM_PROCID")
    if not nodelist or rank is None:
        return None
    job = env.get("SLURM_JOB_ID") or "0"
    port = PORT_BASE + (int(job) % PORT_SLOTS) * 8 if job.isdigit() else PORT_BASE
    return int(rank), expand_nodelist(nodelist)[0], port


def engine_node(job: ExtractJob, env: Mapping[str, str]) -> ExtractJob:
    """`job` with `extract.node_rank` and `extract.dist_init_addr` filled in for a multi-node
    engine (the same job when `extract.nnodes` is 1 or both are set)."""
    nnodes = job.nnodes
    if nnodes <= 1:
        return job
    if job.backend != "sglang":
        raise ConfigError(
            f"extract.nnodes={nnodes}: only extract=sglang runs one engine over several nodes"
        )
    rank = job.get("node_rank")
    addr = job.get("dist_init_addr")
    if rank not in (None, AUTO) and addr not in (None, AUTO):
        return job
    try:
        found = slurm_node(env)
    except ValueError as exc:
        raise ConfigError(f"SLURM_JOB_NODELIST: {exc}") from None
    if found is None:
        raise ConfigError(
            f"extract.nnodes={nnodes} outside SLURM: set extract.node_rank and "
            "extract.dist_init_addr=HOST:PORT (rank 0's node) on every node, or use "
            "extract.executor=ray (docs/distributed.md)"
        )
    slurm_rank, host, port = found
    filled: dict[str, object] = {}
    if rank in (None, AUTO):
        filled["node_rank"] = slurm_rank
    if addr in (None, AUTO):
        filled["dist_init_addr"] = f"{host}:{port}"
    return job.with_settings(**filled)


def node_rank_of(job: ExtractJob) -> int:
    """This process's node in its engine (0 for a one-node engine)."""
    if job.nnodes <= 1:
        return 0
    rank = job.get("node_rank")
    if rank in (None, AUTO):
        raise ConfigError("extract.node_rank is not set (engine_node derives it under SLURM)")
    return int(rank)
