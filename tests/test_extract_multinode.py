"""Multi-node SGLang engines without a GPU: the node split and addresses as pure functions,
the ServerArgs the runner builds, and one engine over two "nodes" that are two processes of
this machine (the stand-in rank of test_extract_sglang), whose store and export equal the
one-node engine's."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from test_extract_sglang import (  # noqa: F401
    StandInRank,
    _cfg,
    _records,
    run_extract,
    tiny_model,
)

from kimi_pipe.errors import ConfigError
from kimi_pipe.exporters import INDEX_FILE, export
from kimi_pipe.extraction.executors.nodes import (
    engine_node,
    expand_nodelist,
    node_rank_of,
    slurm_node,
)
from kimi_pipe.extraction.sglang import EngineSettings, node_ranks
from kimi_pipe.extraction.sglang.backend import serve_follower_node
from kimi_pipe.extraction.sglang.ranks import free_port
from kimi_pipe.stages.jobs.extract import extract_job
from kimi_pipe.store.hidden_store import HiddenStore

REPO = Path(__file__).resolve().parent.parent


# --- pure functions: SLURM's node list, this task's node, the rank split ----------------------
@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu[01-02]", ["gpu01", "gpu02"]),
        ("a1,b2", ["a1", "b2"]),
        ("node7", ["node7"]),
        ("node[1,3-4]", ["node1", "node3", "node4"]),
        ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
        ("h100-[1-2],h200-a[08-09]", ["h100-1", "h100-2", "h200-a08", "h200-a09"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ],
)
def test_slurm_node_lists_expand_in_order(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-", "gpu01]", "gpu[a-b]", "gpu[5-3]", ""])
def test_bad_node_lists_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        expand_nodelist(bad)


def test_slurm_task_finds_its_node_rank_and_rank_zeros_host() -> None:
    env = {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242"}
    rank, host, port = slurm_node(env)  # type: ignore[misc]
    assert (rank, host) == (1, "gpu07")
    # Another job (another engine, maybe on the same head node) gets another port.
    other = slurm_node({**env, "SLURM_JOB_ID": "4243"})
    assert other is not None and other[2] != port and 1024 < port < 65535
    # One task per node: SLURM_PROCID is the node when SLURM_NODEID is missing.
    assert slurm_node({"SLURM_NODELIST": "a1,b2", "SLURM_PROCID": "0"}) == (0, "a1", 20000)
    assert slurm_node({"PATH": "/bin"}) is None


def _sglang_cfg(*extra: str) -> Any:
    """The extract job of an SGLang config (built at the stage's door)."""
    from kimi_pipe.config import compose

    return extract_job(compose(["extract=sglang", "extract.model_path=/m", *extra]))


def test_engine_node_fills_in_rank_and_address_from_slurm() -> None:
    env = {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODEID": "1", "SLURM_JOB_ID": "10"}
    cfg = engine_node(_sglang_cfg("extract.nnodes=2", "extract.tp_size=16"), env)
    assert (cfg.get("node_rank"), cfg.get("dist_init_addr")) == (1, "gpu07:20080")
    settings = EngineSettings.from_job(cfg)
    assert list(settings.local_ranks) == list(range(8, 16))
    assert node_rank_of(cfg) == 1
    # What the command line says wins over the environment.
    cfg = engine_node(
        _sglang_cfg(
            "extract.nnodes=2",
            "extract.tp_size=16",
            "extract.node_rank=0",
            "extract.dist_init_addr=10.0.0.1:5000",
        ),
        env,
    )
    assert (cfg.get("node_rank"), cfg.get("dist_init_addr")) == (0, "10.0.0.1:5000")
    # One node: nothing to fill in, and `auto` means node 0.
    one = _sglang_cfg()
    assert engine_node(one, env) is one and node_rank_of(one) == 0
    assert EngineSettings.from_job(one).dist_init_addr is None
    with pytest.raises(ConfigError, match="outside SLURM"):
        engine_node(_sglang_cfg("extract.nnodes=2", "extract.tp_size=2"), {})
    with pytest.raises(ConfigError, match="executors fill them in"):
        EngineSettings.from_job(_sglang_cfg("extract.nnodes=2", "extract.tp_size=2"))
    from kimi_pipe.config import compose

    with pytest.raises(ConfigError, match="only extract=sglang"):
        engine_node(extract_job(compose(["extract=hf", "+extract.nnodes=2"])), env)


def test_ranks_split_over_nodes_as_sglang_does() -> None:
    assert [list(node_ranks(16, 2, k)) for k in (0, 1)] == [list(range(8)), list(range(8, 16))]
    assert list(node_ranks(8, 1, 0)) == list(range(8))
    assert [list(node_ranks(4, 4, k)) for k in range(4)] == [[0], [1], [2], [3]]
    s = EngineSettings(
        model_path="/m", tp_size=16, ep_size=16, nnodes=2, node_rank=1, dist_init_addr="h:1"
    )
    assert s.ranks_per_node == 8 and [s.gpu_of(r) for r in (8, 9, 15)] == [0, 1, 7]
    with pytest.raises(ConfigError, match="divisible by extract.nnodes=4"):
        EngineSettings(model_path="/m", tp_size=6, nnodes=4, dist_init_addr="h:1")
    with pytest.raises(ConfigError, match="node_rank=2 must be in 0..nnodes-1"):
        EngineSettings(model_path="/m", tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1")
    with pytest.raises(ConfigError, match="needs extract.dist_init_addr"):
        EngineSettings(model_path="/m", tp_size=2, nnodes=2)
    with pytest.raises(ConfigError, match="host:port"):
        EngineSettings(model_path="/m", tp_size=2, nnodes=2, dist_init_addr="gpu07")


def test_server_args_carry_the_nodes_only_for_a_multi_node_engine() -> None:
    one = EngineSettings(model_path="/m", tp_size=8).server_args_kwargs(1234)
    assert not {"nnodes", "node_rank", "dist_init_addr"} & set(one)
    two = EngineSettings(
        model_path="/m", tp_size=16, ep_size=16, nnodes=2, node_rank=1, dist_init_addr="gpu07:5000"
    ).server_args_kwargs(1234)
    assert (two["nnodes"], two["node_rank"], two["dist_init_addr"]) == (2, 1, "gpu07:5000")
    assert (two["tp_size"], two["ep_size"]) == (16, 16)


SERVER_ARGS_PROBE = """
import json, sys
from kimi_pipe.extraction.sglang.settings import EngineSettings
from sglang.srt.server_args import ServerArgs
s = EngineSettings(model_path=sys.argv[1], device="cpu", tp_size=2, nnodes=2, node_rank=1,
                   dist_init_addr="127.0.0.1:29611", dtype="float32", max_total_tokens=512)
sa = ServerArgs(**s.server_args_kwargs(1234))
print(json.dumps({k: getattr(sa, k) for k in ("nnodes", "node_rank", "dist_init_addr",
      "tp_size", "device", "disable_radix_cache", "chunked_prefill_size")}))
"""


def test_real_sglang_server_args_accept_the_nodes(tmp_path: Path, tiny_model: Path) -> None:  # noqa: F811
    """SGLang's own ServerArgs (its checks included) built from these settings, in the SGLang
    venv named by SGLANG_PYTHON (sglang 0.5.14; no GPU needed)."""
    python = os.environ.get("SGLANG_PYTHON")
    if not python:
        pytest.skip("set SGLANG_PYTHON to a python with sglang==0.5.14 (docs/sglang.md)")
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    proc = subprocess.run(
        [python, "-c", SERVER_ARGS_PROBE, str(tiny_model)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {
        "nnodes": 2,
        "node_rank": 1,
        "dist_init_addr": "127.0.0.1:29611",
        "tp_size": 2,
        "device": "cpu",
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
    }


# --- one engine over two "nodes": two processes here -------------------------------------------
def _follower(cfg_yaml: str, out: Any) -> None:
    """Node 1 of the engine, in its own process: it serves ranks it spawns itself."""
    cfg = OmegaConf.create(cfg_yaml)
    out.put(serve_follower_node(extract_job(cfg), StandInRank))


def _store_rows(store: Path) -> dict[str, dict[str, torch.Tensor]]:
    hs = HiddenStore(store)
    return {i: hs[i] for i in hs.ids}


def _export(store: Path, out: Path) -> dict[str, Any]:
    """The specforge export (states included): its index rows without the store's path, and
    every other file's bytes but those that name the store or the export's own directory."""
    export([store], out, "specforge", seed=0)
    rows = [json.loads(line) for line in (out / INDEX_FILE).read_text().splitlines()]
    files = {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file()
        and p.name != INDEX_FILE
        and not any(str(d).encode() in p.read_bytes() for d in (store, out))
    }
    return {"rows": [{k: v for k, v in r.items() if k != "store"} for r in rows], **files}


def test_two_node_engine_stores_what_one_node_stores(tmp_path: Path, tiny_model: Path) -> None:  # noqa: F811
    """tp_size=2 over nnodes=2: node 0 (this process, rank 0) claims the work and writes the
    store; node 1 (another process, rank 1) runs every forward it is sent. Same states, same
    export as one node with tp_size=1; node 1 relayed every batch."""
    recs = _records(tmp_path / "records.jsonl", n=8)
    one = tmp_path / "one"
    run_extract(_cfg(tmp_path / "records.jsonl", tiny_model, one), StandInRank)
    port = free_port()
    two = tmp_path / "two"
    nodes = ["extract.tp_size=2", "extract.nnodes=2", f"extract.dist_init_addr=127.0.0.1:{port}"]
    cfg0 = _cfg(tmp_path / "records.jsonl", tiny_model, two, *nodes, "extract.node_rank=0")
    cfg1 = _cfg(tmp_path / "records.jsonl", tiny_model, two, *nodes, "extract.node_rank=1")
    ctx = mp.get_context("spawn")
    answer = ctx.Queue()
    node1 = ctx.Process(target=_follower, args=(OmegaConf.to_yaml(cfg1), answer))
    node1.start()
    try:
        summary = run_extract(cfg0, StandInRank)
        served = answer.get(timeout=120)
    finally:
        node1.join(timeout=60)
        if node1.is_alive():
            node1.terminate()
    assert node1.exitcode == 0
    assert served["node_rank"] == 1 and served["ranks"] == [1]
    assert served["requests"] == summary["capture"]["batches"] > 1
    assert sorted(HiddenStore(two).ids) == sorted(r["id"] for r in recs)
    a, b = _store_rows(one), _store_rows(two)
    assert a.keys() == b.keys()
    for sid in a:
        for key in a[sid]:
            assert torch.equal(a[sid][key], b[sid][key]), (sid, key)
    exported = _export(one, tmp_path / "x1")
    assert any(name.endswith(".ckpt") for name in exported)  # the states are compared
    assert exported == _export(two, tmp_path / "x2")


def test_a_free_port_comes_with_its_rank_channel_free() -> None:
    """dist_init_addr's port and the next (the rank channel) are both bindable, on every
    interface as the channel's listener binds: CI once drew a port whose successor was
    taken, and rank 0 failed with EADDRINUSE."""
    import socket

    for _ in range(20):
        port = free_port()
        for p in (port, port + 1):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("", p))


def test_follower_node_alone_gives_up_with_a_clear_error(tmp_path: Path, tiny_model: Path) -> None:  # noqa: F811
    from kimi_pipe.extraction.sglang import ranks

    port = free_port()
    settings = EngineSettings(
        model_path=str(tiny_model),
        tp_size=2,
        nnodes=2,
        node_rank=1,
        dist_init_addr=f"127.0.0.1:{port}",
    )
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{port + 1} did not answer"):
        ranks.serve_node(settings, StandInRank, connect_timeout_s=2)
    with pytest.raises(ConfigError, match="only the node of rank 0 opens the backend"):
        from kimi_pipe.extraction.sglang import SGLangBackend

        SGLangBackend(settings, layer_ids=[1, 3, 4], rank_factory=StandInRank)


# --- the executors: one engine over two nodes as a Ray placement group, as a submitit job -----
def _unit_cfg(tmp: Path, model: Path, out: Path, executor: str, *extra: str) -> Any:
    return _cfg(
        tmp / "records.jsonl",
        model,
        out,
        f"extract.executor={executor}",
        "extract.units.unit_samples=3",
        "extract.units.workers=1",
        "extract.units.poll_s=0.5",
        "extract.rank_factory=test_extract_sglang:StandInRank",
        *extra,
    )


def _unit_rows(store: Path) -> dict[str, dict[str, torch.Tensor]]:
    from kimi_pipe.store.unit_reader import UnitHiddenStore

    hs = UnitHiddenStore(str(store))
    return {i: hs[i] for i in hs.ids}


@pytest.fixture
def child_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray workers and submitit jobs import this checkout and the stand-in rank."""
    paths = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a throwaway cluster on this machine


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["ray", "submitit"])
def test_executor_runs_a_two_node_engine_like_one_node(
    executor: str,
    child_env: None,
    tmp_path: Path,
    tiny_model: Path,  # noqa: F811
) -> None:
    """extract.nnodes=2, tp_size=2 through the executor: Ray places the engine as one
    placement group of two bundles (PACK here: one machine), submitit runs one job of two
    tasks (LocalExecutor); rank 0's node claims every unit, the other serves its rank.
    The unit store holds the same states as a one-node engine's, to float32 rounding: rank 0
    computes in another process (Ray gives an actor one torch thread), which sums in another
    order than this one."""
    _records(tmp_path / "records.jsonl", n=8)
    one = tmp_path / "one"
    run_extract_stage = _stage()
    run_extract_stage(_unit_cfg(tmp_path, tiny_model, one, "local"))
    two = tmp_path / "two"
    extra = ["extract.nnodes=2", "extract.tp_size=2"]
    if executor == "ray":
        extra += ["extract.ray.node_strategy=PACK", "extract.ray.num_cpus=2"]
    else:
        extra += ["extract.submitit.timeout_min=10"]
    summary = run_extract_stage(_unit_cfg(tmp_path, tiny_model, two, executor, *extra))
    assert summary["complete"] and not summary["worker_errors"]
    (worker,) = summary["workers"]  # one engine: one worker claimed, the other node served
    assert sorted(worker["units_committed"]) == [f"u-{i:06d}" for i in range(3)]
    a, b = _unit_rows(one), _unit_rows(two)
    assert a.keys() == b.keys() and len(a) == 8
    for sid in a:
        assert a[sid].keys() == b[sid].keys()
        for key in a[sid]:
            x, y = a[sid][key], b[sid][key]
            if x.is_floating_point():
                assert x.shape == y.shape and (x - y).abs().max() < 1e-5, (sid, key)
            else:
                assert torch.equal(x, y), (sid, key)


def _stage() -> Any:
    from kimi_pipe.stages.extract import run_extract as stage

    return stage
