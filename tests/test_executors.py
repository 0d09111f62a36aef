"""The extract executors on the unit protocol, run for real (docs/distributed.md).

A local Ray cluster with two actors running the hf backend on SmolLM2-135M, one of them
killed mid-run; submitit's LocalExecutor with two jobs, one SIGKILLed mid-run; the worker
count changed between runs and while one runs. After each: every sample id in the export
exactly once, every unit committed once, and no unit attempted twice except the one the
dead worker held. The fast cases (tiny random Llama): the unit store's states equal the
work-shard store's, bad settings are one-line errors, a corrupt data object is refused.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from test_unit_store import s3_endpoint  # noqa: F401  (the moto S3 server fixture)

from kimi_pipe.errors import ConfigError
from kimi_pipe.exporters import INDEX_FILE, export
from kimi_pipe.extraction.parity import compare_stores
from kimi_pipe.stages.extract import is_complete, run_extract
from kimi_pipe.stages.jobs.extract import extract_job
from kimi_pipe.store.hidden_store import HiddenStore
from kimi_pipe.store.unit_reader import UnitHiddenStore, is_unit_store
from kimi_pipe.store.units import CorruptUnit, UnitStore

REPO = Path(__file__).resolve().parent.parent
SMOL_VOCAB = 49152


# --- helpers -------------------------------------------------------------------------------------
def write_records(path: Path, n: int, vocab: int, seed: int = 3, longest: int = 40) -> list[str]:
    """Token records of random ids (prompt + output), as generate writes them."""
    gen = torch.Generator().manual_seed(seed)
    ids = []
    with open(path / "records.jsonl", "w") as f:
        for i in range(n):
            plen = int(torch.randint(4, longest // 2, (1,), generator=gen))
            olen = int(torch.randint(2, longest // 2, (1,), generator=gen))
            toks = torch.randint(0, vocab, (plen + olen,), generator=gen).tolist()
            sid = f"r{i:04d}"
            row = {
                "id": sid,
                "ok": True,
                "issues": [],
                "prompt_ids": toks[:plen],
                "output_ids": toks[plen:],
                "loss_mask": [0] * plen + [1] * olen,
                "completion_tokens_reported": olen,
                "completion_tokens_reconstructed": olen,
            }
            f.write(json.dumps(row) + "\n")
            ids.append(sid)
    return ids


def make_cfg(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def leases(store: Path) -> dict[str, list[tuple[int, str]]]:
    """Each unit's lease generations and their owners."""
    out: dict[str, list[tuple[int, str]]] = {}
    for p in sorted((store / "leases").glob("u-*.json")):
        unit, gen = p.name.split(".")[0], int(p.name.split(".")[1][1:])
        body = json.loads(p.read_text())
        out.setdefault(unit, []).append((gen, str(body["owner"])))
    return out


def indexes(store: Path) -> dict[str, dict[str, Any]]:
    """Each committed unit's index; fails when a unit has a second index slot."""
    out: dict[str, dict[str, Any]] = {}
    for p in sorted((store / "index").glob("u-*.json")):
        unit, slot = p.name.split(".")[0], p.name.split(".")[1]
        assert slot == "c0", f"unit {unit} has a second index {p.name}"
        out[unit] = json.loads(p.read_text())
    return out


def held_by(store: Path, prefix: str) -> str | None:
    """A unit that a worker named `prefix...` holds now (leased, not committed)."""
    done = set(indexes(store))
    now = time.time()
    for unit, gens in leases(store).items():
        gen, owner = max(gens)
        body = json.loads((store / "leases" / f"{unit}.g{gen:06d}.json").read_text())
        if owner.startswith(prefix) and unit not in done and body["expires"] > now:
            return unit
    return None


def committed_by(store: Path, prefix: str) -> list[str]:
    return [u for u, body in indexes(store).items() if str(body["owner"]).startswith(prefix)]


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            value = check()
        except (FileNotFoundError, json.JSONDecodeError):
            value = None  # a record being written: look again
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def exported_ids(store: Path, out: Path) -> list[str]:
    """Export the store (tokens format) and return the ids of its index, in file order."""
    summary = export([store], out, "tokens", seed=0)
    rows = [json.loads(line) for line in (out / INDEX_FILE).read_text().splitlines()]
    assert summary["samples"] == len(rows)
    return [r["id"] for r in rows]


def check_exactly_once(store: Path, ids: list[str], tmp: Path) -> dict[str, dict[str, Any]]:
    """Every unit committed once, every sample in exactly one index and in the export once."""
    units = UnitStore.open(str(store)).plan.units
    committed = indexes(store)
    assert sorted(committed) == [u.name for u in units]
    named = [row[0] for body in committed.values() for row in body["samples"]]
    assert sorted(named) == sorted(ids)
    got = exported_ids(store, tmp / "export")
    assert len(got) == len(set(got)) and sorted(got) == sorted(ids)
    return committed


def takeovers(store: Path) -> dict[str, list[tuple[int, str]]]:
    """Units claimed more than once (a generation after the first)."""
    return {u: g for u, g in leases(store).items() if len(g) > 1}


def check_in_flight(
    store: Path, committed: dict[str, dict[str, Any]], victim: str, seen_held: str
) -> set[str]:
    """The units the killed worker held when it died (claimed first by it, committed by
    another), checked to be the only units claimed twice. Normally the unit it was seen
    holding just before the kill; if the kill landed in the instant after that unit's
    commit, the victim committed it and held at most one more."""
    first_owner = {u: gens[0][1] for u, gens in leases(store).items()}
    in_flight = {
        u
        for u, body in committed.items()
        if first_owner.get(u) == victim and body["owner"] != victim
    }
    assert set(takeovers(store)) == in_flight  # nothing else was done twice
    if committed[seen_held]["owner"] == victim:
        assert len(in_flight) <= 1
    else:
        assert in_flight == {seen_held}
    return in_flight


# --- real SmolLM2 on Ray and submitit -------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    from omegaconf import OmegaConf

    from kimi_pipe.store.local_model import LocalModelSpec, ensure_local_model

    spec = LocalModelSpec.from_cfg(OmegaConf.load(REPO / "conf/model/smollm2.yaml").local_model)
    return ensure_local_model(spec)


@pytest.fixture(scope="module")
def child_env() -> Iterator[None]:
    """Ray workers and submitit jobs import this checkout's kimi_pipe."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        mp.setenv("RAY_AUTH_MODE", "disabled")  # a throwaway cluster on this machine
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        yield


@pytest.fixture(scope="module")
def ray_cluster(child_env: None) -> Iterator[None]:
    import ray  # in requirements.lock: a missing Ray fails here, it does not skip

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def smol_cfg(tmp: Path, smollm2_dir: Path, executor: str, *more: str) -> DictConfig:
    return make_cfg(
        [
            "model=smollm2",
            f"extract.run_dir={tmp}",
            f"extract.model_path={smollm2_dir}",
            "extract.store_dtype=bfloat16",
            "extract.threads=1",
            "extract.batch_tokens=64",
            "resolve.enabled=false",
            f"extract.executor={executor}",
            "extract.units.unit_samples=2",
            # Short enough that a dead worker's unit comes back within the test, long
            # enough that a live one's heartbeat (every lease_s / 4) survives a loaded host.
            "extract.units.lease_s=4",
            "extract.units.poll_s=0.3",
            *more,
        ]
    )


@pytest.mark.slow
@pytest.mark.parametrize("restart", [False, True], ids=["dead", "restarted"])
def test_ray_actor_killed_mid_run_every_id_once(
    ray_cluster: None, smollm2_dir: Path, tmp_path: Path, restart: bool
) -> None:
    """ray.kill of a working actor: for good (the other actor takes its unit over after the
    lease), or restarted by Ray (max_restarts) with its call retried under a new name."""
    import ray

    from kimi_pipe.extraction.executors.ray_executor import RayPool

    ids = write_records(tmp_path, 40, SMOL_VOCAB)
    store = tmp_path / "hidden_hf"
    pool = RayPool(extract_job(smol_cfg(tmp_path, smollm2_dir, "ray")))
    try:
        pool.add(2)
        # Kill actor 0 while it holds a unit, after it has committed one.
        wait_for(lambda: committed_by(store, "ray0-"), 180, "a commit of actor 0")
        victim_unit = wait_for(lambda: held_by(store, "ray0-"), 60, "actor 0 to hold a unit")
        victim = max(leases(store)[victim_unit])[1]
        ray.kill(pool.actors[0], no_restart=not restart)
        done, errors = pool.wait()
    finally:
        pool.close()
    if restart:  # Ray restarted the actor and retried its call: both calls finished
        assert len(done) == 2 and not errors
        assert {d["owner"].split("-")[0] for d in done} == {"ray0", "ray1"}
        assert victim not in {d["owner"] for d in done}  # the restart is a new worker
    else:
        assert len(done) == 1 and len(errors) == 1  # the survivor finished, the victim died
        assert done[0]["owner"].startswith("ray1-")
    committed = check_exactly_once(store, ids, tmp_path)
    # Only the unit in flight was claimed twice, after its lease ran out, by another worker.
    in_flight = check_in_flight(store, committed, victim, victim_unit)
    for unit in in_flight:
        assert committed[unit]["generation"] >= 1
    assert not any(d["units_lost"] for d in done)
    assert committed_by(store, "ray0-") and committed_by(store, "ray1-")  # both worked
    # What a reader gets is the record's ids with the model's states beside them.
    rows = {
        r["id"]: r for r in map(json.loads, (tmp_path / "records.jsonl").read_text().splitlines())
    }
    reader = UnitHiddenStore(store)
    for sid in ids[:5]:
        sample = reader[sid]
        assert sample["input_ids"].tolist() == rows[sid]["prompt_ids"] + rows[sid]["output_ids"]
        assert sample["aux_hidden_state"].shape == (len(sample["input_ids"]), 3 * 576)
        assert torch.isfinite(sample["hidden_state"].float()).all()


@pytest.mark.slow
def test_ray_worker_count_changes_between_and_during_runs_redo_nothing(
    ray_cluster: None, smollm2_dir: Path, tmp_path: Path
) -> None:
    from kimi_pipe.extraction.executors.ray_executor import RayPool

    ids = write_records(tmp_path, 40, SMOL_VOCAB, seed=5)
    store = tmp_path / "hidden_hf"
    cfg = smol_cfg(tmp_path, smollm2_dir, "ray", "extract.units.lease_s=30")  # nobody dies
    first = RayPool(extract_job(cfg))  # run 1: one worker that leaves after 3 units
    try:
        first.add(1, wait_for_held=False, max_units=3)
        done1, errors1 = first.wait()
    finally:
        first.close()
    assert not errors1 and len(done1[0]["units_committed"]) == 3
    before = indexes(store)
    second = RayPool(extract_job(cfg))  # run 2: one worker, then a second joins while it runs
    try:
        second.add(1)
        wait_for(lambda: len(indexes(store)) > len(before), 180, "run 2's first commit")
        second.add(1)
        done2, errors2 = second.wait()
    finally:
        second.close()
    assert not errors2
    committed = check_exactly_once(store, ids, tmp_path)
    assert not takeovers(store)  # no unit was claimed twice: none redone
    for unit, body in before.items():  # run 1's commits stand as they were
        assert committed[unit] == body
    runs = [*done1, *done2]
    all_units = [u for d in runs for u in d["units_committed"]]
    assert len(all_units) == len(set(all_units)) == len(committed)


@pytest.mark.slow
def test_submitit_local_job_killed_mid_run_every_id_once(
    child_env: None, smollm2_dir: Path, tmp_path: Path
) -> None:
    from kimi_pipe.extraction.executors.submitit_executor import submit, wait

    ids = write_records(tmp_path, 40, SMOL_VOCAB, seed=9)
    store = tmp_path / "hidden_hf"
    cfg = smol_cfg(tmp_path, smollm2_dir, "submitit", f"extract.submitit.folder={tmp_path}/jobs")
    jobs = submit(extract_job(cfg), 2)
    try:
        wait_for(lambda: committed_by(store, "job0-"), 240, "a commit of job 0")
        victim_unit = wait_for(lambda: held_by(store, "job0-"), 60, "job 0 to hold a unit")
        owner = max(leases(store)[victim_unit])[1]
        os.kill(int(owner.rsplit("-", 2)[1]), signal.SIGKILL)  # owner: job0-<host>-<pid>-<tag>
        done, errors = wait(jobs)
    finally:
        for job in jobs:
            if not job.done():
                job.cancel()
    assert len(done) == 1 and len(errors) == 1
    committed = check_exactly_once(store, ids, tmp_path)
    for unit in check_in_flight(store, committed, owner, victim_unit):
        assert committed[unit]["owner"].startswith("job1-")
    assert done[0]["owner"].startswith("job1-")


# --- fast cases: a tiny random-weight Llama in this process --------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    directory = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def tiny_overrides(tmp: Path, tiny_dir: Path, *more: str) -> list[str]:
    return [
        f"extract.run_dir={tmp}",
        f"extract.model_path={tiny_dir}",
        "extract.store_dtype=float32",
        "extract.batch_tokens=96",
        "extract.units.unit_samples=3",
        "extract.units.poll_s=0.2",
        *more,
    ]


def test_local_worker_store_equals_work_shard_store(tmp_path: Path, tiny_dir: Path) -> None:
    ids = write_records(tmp_path, 11, 256)
    sharded = run_extract(
        make_cfg(tiny_overrides(tmp_path, tiny_dir, f"extract.output_dir={tmp_path}/shards"))
    )
    unit_cfg = make_cfg(
        tiny_overrides(
            tmp_path, tiny_dir, "extract.executor=local", f"extract.output_dir={tmp_path}/u"
        )
    )
    assert not is_complete(unit_cfg, tmp_path)  # the runner's check: nothing planned yet
    units = run_extract(unit_cfg)
    assert is_complete(unit_cfg, tmp_path)
    assert units["complete"] and units["status"]["committed"] == 4  # ceil(11 / 3)
    assert is_unit_store(tmp_path / "u") and not is_unit_store(tmp_path / "shards")
    old, new = HiddenStore(sharded["store"]), UnitHiddenStore(tmp_path / "u")
    assert sorted(new.ids) == sorted(old.ids) == sorted(ids)
    assert new.manifest["layer_ids"] == old.manifest["layer_ids"]
    for sid in ids:
        a, b = old[sid], new[sid]
        assert a.keys() == b.keys()
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        # Other batches, other padding: the same states up to float32 noise.
        torch.testing.assert_close(a["aux_hidden_state"], b["aux_hidden_state"])
        torch.testing.assert_close(a["hidden_state"], b["hidden_state"])
    # The parity check reads a unit store as it reads the work-shard one.
    report = compare_stores(sharded["store"], tmp_path / "u", records=tmp_path / "records.jsonl")
    assert report.ok and report.compared == len(ids), report.table()
    # A second run finds every unit committed and redoes none.
    again = run_extract(
        make_cfg(
            tiny_overrides(
                tmp_path, tiny_dir, "extract.executor=local", f"extract.output_dir={tmp_path}/u"
            )
        )
    )
    assert again["workers"][0]["units_committed"] == [] and again["complete"]
    got = exported_ids(tmp_path / "u", tmp_path / "exp")
    assert len(got) == len(set(got)) and sorted(got) == sorted(ids)


def test_export_reads_only_what_indexes_name(tmp_path: Path, tiny_dir: Path) -> None:
    ids = write_records(tmp_path, 7, 256)
    cfg = make_cfg(tiny_overrides(tmp_path, tiny_dir, "extract.executor=local"))
    run_extract(cfg)
    store = tmp_path / "hidden_hf"
    # A killed attempt's objects lie beside the committed ones: nobody names them.
    stray = store / "data" / "u-000000" / "g000009-dead" / "part-00000.safetensors"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"not a safetensors file")
    # The index of one unit removed: its samples are not committed, the export lacks them.
    dropped = indexes(store)["u-000002"]
    (store / "index" / "u-000002.c0.json").unlink()
    assert not is_complete(cfg, tmp_path)  # the runner sees a unit missing
    got = exported_ids(store, tmp_path / "exp")
    lost = {row[0] for row in dropped["samples"]}
    assert sorted(got) == sorted(set(ids) - lost) and len(got) == len(set(got))
    # A data object changed after its commit is refused, not read.
    obj = store / indexes(store)["u-000000"]["objects"][0]["path"]
    data = bytearray(obj.read_bytes())
    data[-1] ^= 0xFF
    obj.write_bytes(bytes(data))
    with pytest.raises(CorruptUnit, match="sha256"):
        UnitHiddenStore(store)[indexes(store)["u-000000"]["samples"][0][0]]


def test_a_failed_ray_worker_is_reported_with_its_own_exception() -> None:
    """RayPool.wait's one line per dead worker carries the worker's exception (a lost node
    of a multi-node engine: gloo's "Connection closed by peer"), not only Ray's first line,
    which names the call and the process."""
    from ray.exceptions import RayActorError, RayTaskError

    from kimi_pipe.extraction.executors.ray_executor import _why

    lost = RuntimeError("[gloo/pair.cc:547] Connection closed by peer [127.0.0.1]:3801\nmore")
    exc = RayTaskError("UnitActor.run", "Traceback ...", lost, "ray::UnitActor.run()", 7, "::1")
    want = (
        "RayTaskError(RuntimeError): [gloo/pair.cc:547] Connection closed by peer [127.0.0.1]:3801"
    )
    assert _why(exc) == _why(exc.as_instanceof_cause()) == want
    assert _why(RayActorError()).startswith("RayActorError: The actor")


def test_bad_executor_settings_are_one_line_errors(tmp_path: Path, tiny_dir: Path) -> None:
    write_records(tmp_path, 3, 256)
    with pytest.raises(ConfigError, match="extract.executor must be one of"):
        run_extract(make_cfg(tiny_overrides(tmp_path, tiny_dir, "extract.executor=spark")))
    with pytest.raises(ConfigError, match="unit_samples must be > 0"):
        run_extract(
            make_cfg(
                tiny_overrides(
                    tmp_path, tiny_dir, "extract.executor=local", "extract.units.unit_samples=0"
                )
            )
        )
    # A store the work shards wrote is not turned into a unit store.
    run_extract(make_cfg(tiny_overrides(tmp_path, tiny_dir)))
    with pytest.raises(ConfigError, match="written by the work shards"):
        run_extract(make_cfg(tiny_overrides(tmp_path, tiny_dir, "extract.executor=local")))
    with pytest.raises(ConfigError, match="submitit.cluster"):
        from kimi_pipe.extraction.executors.submitit_executor import SubmititSettings

        SubmititSettings.from_job(extract_job(make_cfg(["extract.submitit.cluster=pbs"])))


@pytest.mark.slow
def test_hydra_submitit_launcher_runs_local_workers_as_a_job_array(
    child_env: None, tmp_path: Path, tiny_dir: Path
) -> None:
    """The batch route with no driver: Hydra's submitit launcher (its `submitit_local`
    launcher, the SLURM one's twin) runs two jobs, each `extract.executor=local`."""
    import subprocess
    import sys

    ids = write_records(tmp_path, 10, 256)
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kimi_pipe",
            "extract",
            "-m",
            "hydra/launcher=submitit_local",
            "extract.executor=local",
            "extract.worker=0,1",
            *tiny_overrides(tmp_path, tiny_dir, "extract.units.lease_s=5", "resolve.enabled=false"),
            f"hydra.sweep.dir={sweep}",
            "hydra.sweep.subdir=w${extract.worker}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if p.name.startswith("w")) == ["w0", "w1"]
    assert len(list(sweep.glob(".submitit/*/*_result.pkl"))) == 2  # two jobs ran to the end
    check_exactly_once(tmp_path / "hidden_hf", ids, tmp_path)
    assert not takeovers(tmp_path / "hidden_hf")


def test_local_worker_on_s3_equals_the_local_store(
    s3_endpoint: str,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    tiny_dir: Path,
) -> None:
    """The executor path on an object store (moto's S3 on 127.0.0.1): the same units, the
    same data object bytes as on local disk, and the samples read back through the
    object-store reader equal the local ones."""
    from omegaconf import OmegaConf, open_dict
    from test_unit_store import new_bucket
    from unit_store_child import FAKE_KEY

    ids = write_records(tmp_path, 8, 256)
    options = {
        "key": FAKE_KEY,
        "secret": FAKE_KEY,
        "client_kwargs": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
        "use_listings_cache": False,
    }
    url = f"s3://{new_bucket(s3_endpoint)}/run/hidden"
    remote_cfg = make_cfg(tiny_overrides(tmp_path, tiny_dir, "extract.executor=local"))
    with open_dict(remote_cfg):
        OmegaConf.update(remote_cfg, "extract.units.url", url)
        OmegaConf.update(remote_cfg, "extract.units.storage_options", options, merge=False)
    remote = run_extract(remote_cfg)
    local = run_extract(
        make_cfg(
            tiny_overrides(
                tmp_path, tiny_dir, "extract.executor=local", f"extract.output_dir={tmp_path}/u"
            )
        )
    )
    assert remote["complete"] and local["complete"]
    s3_units = UnitStore.open(url, **options)
    s3_index, local_index = s3_units.committed(), indexes(tmp_path / "u")
    assert sorted(s3_index) == sorted(local_index)
    for unit, body in local_index.items():
        got = s3_index[unit]
        assert [o["sha256"] for o in got["objects"]] == [o["sha256"] for o in body["objects"]]
        assert got["samples"] == body["samples"]
    on_s3, on_disk = UnitHiddenStore(s3_units, cache_objects=1), UnitHiddenStore(tmp_path / "u")
    assert not on_s3.local and sorted(on_s3.ids) == sorted(on_disk.ids) == sorted(ids)
    for sid in reversed(ids):  # out of order: the object cache must not mix units up
        a, b = on_s3[sid], on_disk[sid]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_stage_runs_ray_and_submitit_executors_to_the_end(
    ray_cluster: None, tmp_path: Path, tiny_dir: Path
) -> None:
    """`run_extract` with extract.executor=ray and =submitit (the command line's path): two
    workers each, the summary complete, every id once in the export."""
    ids = write_records(tmp_path, 12, 256)
    for executor in ("ray", "submitit"):
        out = tmp_path / executor
        summary = run_extract(
            make_cfg(
                tiny_overrides(
                    tmp_path,
                    tiny_dir,
                    f"extract.executor={executor}",
                    f"extract.output_dir={out}",
                    "extract.units.workers=2",
                    "resolve.enabled=false",
                )
            )
        )
        assert summary["complete"] and summary["executor"] == executor
        assert len(summary["workers"]) == 2 and not summary["worker_errors"]
        committed = [u for w in summary["workers"] for u in w["units_committed"]]
        assert sorted(committed) == sorted(indexes(out))  # each unit by exactly one worker
        assert json.loads((out / "extract_summary.json").read_text())["complete"]
        (tmp_path / f"exp_{executor}").mkdir()
        check_exactly_once(out, ids, tmp_path / f"exp_{executor}")


def test_a_bad_executor_on_the_command_line_is_one_line_and_exit_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    write_records(tmp_path, 2, 256)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kimi_pipe",
            "extract",
            f"extract.run_dir={tmp_path}",
            "extract.executor=spark",
            f"hydra.run.dir={tmp_path}/h",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "extract.executor" in line]
    assert len(lines) == 1 and "must be one of" in lines[0] and "Traceback" not in proc.stderr


def test_the_extract_job_is_built_at_the_door_and_pickles(tmp_path: Path) -> None:
    """What the workers receive: the job built once from the config, plain and picklable
    (Ray and submitit send it to other processes); run dirs travel as arguments."""
    import pickle

    from kimi_pipe.extraction.job import ExtractJob

    run = tmp_path / "run"
    cfg = make_cfg(["model=smollm2", f"extract.run_dir={run}", "extract.executor=local"])
    job = extract_job(cfg)
    assert isinstance(job, ExtractJob) and job.executor == "local"
    assert job.records_path() == run / "records.jsonl"
    assert job.store_path() == run / f"hidden_{job.backend}"
    assert job.model_name == "smollm2" and job.get("batch_tokens") == cfg.extract.batch_tokens
    assert pickle.loads(pickle.dumps(job)) == job
    # A pipeline's run dir replaces extract.run_dir; a default only fills it in when unset.
    other = tmp_path / "other"
    assert extract_job(cfg, other).records_path() == other / "records.jsonl"
    assert extract_job(cfg, default_run_dir=other).records_path() == run / "records.jsonl"
    bare = make_cfg(["model=smollm2"])
    assert extract_job(bare, default_run_dir=other).records_path() == other / "records.jsonl"
    with pytest.raises(ConfigError, match="no input"):
        extract_job(bare).records_path()
    # Filling in a run dir wrote nothing into the config itself.
    assert bare.extract.get("run_dir") is None and cfg.extract.run_dir == str(run)
