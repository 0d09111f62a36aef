"""The unit store on fsspec: local disk and S3 (moto's server on 127.0.0.1) by the same code.

Round trip equal byte for byte on both, a writer killed mid-commit leaves nothing trusted and
its unit comes back after the lease, racing claims and commits resolve to exactly one, the
plan does not depend on the workers, and a writer's memory follows the unit, not the run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from safetensors import safe_open
from unit_store_child import FAKE_KEY, H, fill, manifest, open_store, sample, sample_id

from kimi_pipe.errors import ConfigError, StoreError
from kimi_pipe.store import objects
from kimi_pipe.store.units import (
    CorruptUnit,
    Lease,
    UnitStore,
    plan_units,
    run_units,
)

CHILD = Path(__file__).with_name("unit_store_child.py")
IDS = [sample_id(i) for i in range(23)]


# --- an S3 server on this machine --------------------------------------------------------------
@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 on 127.0.0.1 (a free port), with fake credentials only."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            mp.setenv(name, FAKE_KEY)
        mp.delenv("AWS_SESSION_TOKEN", raising=False)
        mp.delenv("AWS_PROFILE", raising=False)
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


def new_bucket(endpoint: str) -> str:
    import boto3

    name = f"units-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=FAKE_KEY,
        aws_secret_access_key=FAKE_KEY,
    )
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """Where a store lives: kind, root, endpoint (what the killed child needs too)."""
    if request.param == "local":
        return {"kind": "local", "root": str(tmp_path / "store"), "endpoint": ""}
    endpoint = request.getfixturevalue("s3_endpoint")
    return {"kind": "s3", "root": f"{new_bucket(endpoint)}/run/hidden", "endpoint": endpoint}


def make_store(where: dict[str, str], lease_s: float = 600.0) -> UnitStore:
    return open_store(where["kind"], where["root"], where["endpoint"], lease_s)


def planned(where: dict[str, str], ids: list[str] = IDS, **kw: Any) -> UnitStore:
    store = make_store(where, kw.pop("lease_s", 600.0))
    store.ensure_plan(ids, unit_size=kw.pop("unit_size", 5), manifest=manifest(**kw))
    return store


def all_objects(store: UnitStore, *prefixes: str) -> dict[str, bytes]:
    """Relative path -> bytes of every object under the given prefixes."""
    out = {}
    for prefix in prefixes:
        for p in objects.listing(store.fs, store.path(prefix)):
            out[store.relative(p)] = bytes(store.fs.cat_file(p))
    plan = objects.read_once(store.fs, store.path("plan"))
    assert plan is not None
    out["plan"] = objects.encode_record(plan)
    return out


def commit_all(store: UnitStore, owner: str = "w0", part_bytes: int = 1 << 20) -> list[Any]:
    return run_units(store, owner, fill, part_bytes=part_bytes)


def check_samples(
    store: UnitStore, ids: list[str], exact: bool = True, hidden: int = H, length: int | None = None
) -> None:
    got = dict(store.iter_samples())
    assert sorted(got) == sorted(ids)
    for sid in ids:
        input_ids, mask, aux, final = sample(sid, hidden, length)
        t = got[sid]
        assert t["input_ids"].tolist() == input_ids and t["loss_mask"].tolist() == mask
        if exact:
            assert torch.equal(t["aux_hidden_state"], aux)
            assert torch.equal(t["hidden_state"], final)
        else:  # fp8 with one scale per row: within fp8's relative step, readers get bf16
            assert t["aux_hidden_state"].dtype == torch.bfloat16
            assert torch.allclose(t["aux_hidden_state"].float(), aux, rtol=0.07, atol=0.05)
            assert torch.allclose(t["hidden_state"].float(), final, rtol=0.07, atol=0.05)


# --- the plan ------------------------------------------------------------------------------------
def test_plan_depends_on_the_ids_only() -> None:
    shuffled = list(reversed(IDS))
    units = plan_units(shuffled, 5)
    assert units == plan_units(IDS, 5)
    assert [len(u.ids) for u in units] == [5, 5, 5, 5, 3]
    assert [i for u in units for i in u.ids] == sorted(IDS)
    # A token budget cuts earlier; a sample longer than the budget goes alone.
    lengths = {sid: 10 for sid in IDS} | {IDS[3]: 50}
    by_tokens = plan_units(IDS, 5, lengths, unit_tokens=30)
    assert all(len(u.ids) <= 3 for u in by_tokens)
    assert (IDS[3],) in [u.ids for u in by_tokens]
    assert all(u.tokens is not None and (u.tokens <= 30 or len(u.ids) == 1) for u in by_tokens)
    with pytest.raises(ConfigError, match="twice"):
        plan_units([*IDS, IDS[0]], 5)


def test_same_work_whatever_the_number_of_workers(tmp_path: Path) -> None:
    """One worker or three: the same plan record and the same bytes in every unit."""
    digests = []
    for workers in (1, 3):
        where = {"kind": "local", "root": str(tmp_path / f"w{workers}"), "endpoint": ""}
        store = planned(where)
        threads = [
            threading.Thread(target=commit_all, args=(make_store(where), f"w{k}"))
            for k in range(workers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        index = store.committed()
        assert len(index) == len(store.plan.units) == 5
        assert sum(len(i["samples"]) for i in index.values()) == len(IDS)
        digests.append(
            (store.plan.sha256, {u: [o["sha256"] for o in i["objects"]] for u, i in index.items()})
        )
    assert digests[0] == digests[1]


def test_a_store_planned_for_other_work_is_refused(tmp_path: Path) -> None:
    where = {"kind": "local", "root": str(tmp_path / "s"), "endpoint": ""}
    planned(where)
    planned(where)  # the same work again: fine, the first plan stands
    with pytest.raises(StoreError, match="unit_size 5 != 4"):
        planned(where, unit_size=4)
    with pytest.raises(StoreError, match="sample ids differ"):
        planned(where, ids=IDS[:-1])
    with pytest.raises(StoreError, match="dtype"):
        planned(where, dtype="bfloat16")


def test_a_filesystem_without_conditional_create_is_refused() -> None:
    with pytest.raises(ConfigError, match="conditional create"):
        UnitStore(fsspec.filesystem("memory"), "/x")


# --- round trip ----------------------------------------------------------------------------------
def test_round_trip_on_s3_equals_local_byte_for_byte(tmp_path: Path, s3_endpoint: str) -> None:
    local = {"kind": "local", "root": str(tmp_path / "store"), "endpoint": ""}
    s3 = {"kind": "s3", "root": f"{new_bucket(s3_endpoint)}/run/hidden", "endpoint": s3_endpoint}
    stores = []
    for where in (local, s3):
        store = planned(where, dtype="fp8_e4m3")
        results = commit_all(store, "w0", part_bytes=900)  # several data objects per unit
        assert [r.ours for r in results] == [True] * 5
        check_samples(store, IDS, exact=False)
        stores.append(store)
    a, b = (all_objects(s, "index", "data") for s in stores)
    assert sorted(a) == sorted(b) and len(a) > 1 + 5 + 5
    assert all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]
    raw_local = dict(stores[0].iter_samples(dequantize=False))
    raw_s3 = dict(stores[1].iter_samples(dequantize=False))
    for sid in IDS:
        assert raw_local[sid].keys() == raw_s3[sid].keys()
        assert "aux_hidden_state_scale" in raw_local[sid]
        for key, t in raw_local[sid].items():
            assert t.dtype == raw_s3[sid][key].dtype
            assert torch.equal(t.view(torch.uint8), raw_s3[sid][key].view(torch.uint8))


def test_a_data_object_is_a_hidden_store_shard(tmp_path: Path) -> None:
    """The same per-row format as hidden_store: tensors on the token axis, samples in the
    metadata, so the shard readers and tools keep working on a unit's objects."""
    where = {"kind": "local", "root": str(tmp_path / "s"), "endpoint": ""}
    store = planned(where)
    commit_all(store)
    index = store.committed()["u-000001"]
    path = store.path(index["objects"][0]["path"])
    with safe_open(path, framework="pt") as f:
        samples = json.loads(f.metadata()["samples"])
        assert sorted(f.keys()) == ["aux_hidden_state", "hidden_state", "input_ids", "loss_mask"]
        sid, offset, length = samples[1]
        aux = f.get_slice("aux_hidden_state")[offset : offset + length]
    assert [s[0] for s in samples] == list(store.plan.unit("u-000001").ids)
    assert torch.equal(aux, sample(sid)[2])


def test_skipped_samples_are_named_in_the_index(where: dict[str, str]) -> None:
    store = planned(where)

    def work(writer: Any) -> None:
        for sid in writer.unit.ids:
            if sid == IDS[6]:
                writer.skip(sid, "nonfinite_hidden_state")
            else:
                writer.add(sid, *sample(sid))

    run_units(store, "w0", work)
    assert store.committed()["u-000001"]["issues"] == [[IDS[6], "nonfinite_hidden_state", ""]]
    check_samples(store, [i for i in IDS if i != IDS[6]])
    assert store.status() == {
        "units": 5,
        "committed": 5,
        "held": 0,
        "free": 0,
        "samples": len(IDS) - 1,
        "skipped": 1,
    }
    lease = make_store(where).claim("u-000000", "late")
    assert lease is None  # committed: nothing to claim


def test_an_incomplete_unit_does_not_commit(tmp_path: Path) -> None:
    store = planned({"kind": "local", "root": str(tmp_path / "s"), "endpoint": ""})
    lease = store.claim("u-000000", "w0")
    assert lease is not None
    writer = store.writer(lease)
    writer.add(IDS[0], *sample(IDS[0]))
    with pytest.raises(ValueError, match="not in unit"):
        writer.add(IDS[9], *sample(IDS[9]))
    with pytest.raises(ValueError, match="already added"):
        writer.add(IDS[0], *sample(IDS[0]))
    with pytest.raises(StoreError, match="neither added nor skipped"):
        writer.commit()
    assert store.committed() == {}


# --- crashes -------------------------------------------------------------------------------------
def test_writer_killed_mid_commit_leaves_nothing_trusted(where: dict[str, str]) -> None:
    lease_s = 3.0
    store = planned(where, lease_s=lease_s)
    env = {
        **os.environ,
        "UNIT_TEST_KIND": where["kind"],
        "UNIT_TEST_ROOT": where["root"],
        "UNIT_TEST_ENDPOINT": where["endpoint"],
        "UNIT_TEST_LEASE_S": str(lease_s),
    }
    child = subprocess.Popen(
        [sys.executable, str(CHILD)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "READY"  # data written, index not yet
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    killed_at = time.time()
    victim = objects.listing(store.fs, store.path("data", "u-000000", "g000000-victim"))
    assert len(victim) > 1  # the kill came after several data objects
    assert store.committed() == {} and list(store.iter_samples()) == []
    assert store.status()["held"] == 1
    # The dead writer's lease still runs: nobody may take the unit yet.
    assert make_store(where, lease_s).claim("u-000000", "w1") is None
    time.sleep(max(0.0, killed_at + lease_s + 0.2 - time.time()))
    lease = make_store(where, lease_s).claim("u-000000", "w1")
    assert lease is not None and lease.generation == 1
    writer = store.writer(lease)
    fill(writer)
    assert writer.commit().ours
    index = store.committed()["u-000000"]
    assert index["attempt"] == "g000001-w1"
    check_samples(store, list(store.plan.unit("u-000000").ids))
    assert sorted(store.orphans()) == sorted(victim)


def test_a_torn_index_on_local_disk_is_not_trusted(tmp_path: Path) -> None:
    """A kill inside the index write (only local disk can show a half-written object)."""
    where = {"kind": "local", "root": str(tmp_path / "s"), "endpoint": ""}
    store = UnitStore(fsspec.filesystem("file"), where["root"], lease_s=60, grace_s=0.3)
    store.ensure_plan(IDS, unit_size=5, manifest=manifest())
    lease = store.claim("u-000000", "w0")
    assert lease is not None
    writer = store.writer(lease)
    fill(writer)
    whole = objects.encode_record(writer.index_body())
    slot0 = Path(objects.slot_path(store.path("index", "u-000000"), 0))
    slot0.parent.mkdir(parents=True)
    slot0.write_bytes(whole[: len(whole) // 2])  # torn
    assert store.committed() == {}
    started = time.monotonic()
    result = writer.commit()  # waits out the grace, then takes the next slot
    assert result.ours and time.monotonic() - started >= 0.2
    assert Path(objects.slot_path(store.path("index", "u-000000"), 1)).exists()
    assert UnitStore(store.fs, store.root).committed()["u-000000"]["attempt"] == "g000000-w0"


def test_a_torn_lease_counts_from_its_last_write(tmp_path: Path) -> None:
    store = planned({"kind": "local", "root": str(tmp_path / "s"), "endpoint": ""}, lease_s=0.5)
    path = Path(store.path("leases", "u-000000.g000000.json"))
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"kind":"lea')  # a renewal killed mid-write
    assert store.claim("u-000000", "w1") is None
    time.sleep(0.6)
    lease = store.claim("u-000000", "w1")
    assert lease is not None and lease.generation == 1


def test_reader_checks_every_object_against_its_index(tmp_path: Path) -> None:
    store = planned({"kind": "local", "root": str(tmp_path / "s"), "endpoint": ""})
    commit_all(store)
    ref = store.committed()["u-000002"]["objects"][0]
    path = Path(store.path(ref["path"]))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptUnit, match="sha256"):
        dict(store.iter_samples())
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(CorruptUnit, match="bytes, its index says"):
        dict(store.iter_samples())
    path.unlink()
    with pytest.raises(CorruptUnit, match="missing"):
        dict(store.iter_samples())


# --- races ---------------------------------------------------------------------------------------
def race(n: int, fn: Any) -> list[Any]:
    """Run fn(k) for k < n in threads released together; their results."""
    barrier = threading.Barrier(n)
    out: list[Any] = [None] * n

    def run(k: int) -> None:
        barrier.wait()
        out[k] = fn(k)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_two_workers_claiming_one_unit_exactly_one_wins(where: dict[str, str]) -> None:
    planned(where)
    for unit in ("u-000000", "u-000001"):
        leases = race(4, lambda k, u=unit: make_store(where).claim(u, f"w{k}"))
        winners = [lease for lease in leases if lease is not None]
        assert len(winners) == 1 and winners[0].generation == 0, leases
    assert make_store(where).status()["held"] == 2


def test_a_unit_committed_twice_keeps_its_first_index(where: dict[str, str]) -> None:
    store = planned(where, lease_s=0.5)
    first = store.claim("u-000003", "slow")
    assert first is not None
    slow = store.writer(first)
    fill(slow)  # ... then stalls past its lease
    time.sleep(0.6)
    second = make_store(where, 0.5).claim("u-000003", "fast")
    assert second is not None and second.generation == 1
    assert first.superseded() and not first.renew()
    fast = store.writer(second)
    fill(fast)
    assert fast.commit().ours
    late = slow.commit()
    assert not late.ours and late.attempt == "g000001-fast"
    fresh = make_store(where)
    assert fresh.committed()["u-000003"]["attempt"] == "g000001-fast"
    assert all("g000000-slow" in p for p in fresh.orphans()) and fresh.orphans()
    # Two writers publishing at the same moment: one index, whoever wins.
    third = make_store(where, 0.5).claim("u-000004", "a")
    assert third is not None
    rival = Lease(store, third.unit, 7, "b", time.time() + 60)  # as if taken over
    writers = [store.writer(third), store.writer(rival)]
    for w in writers:
        fill(w)
    results = race(2, lambda k: writers[k].commit())
    assert sorted(r.ours for r in results) == [False, True]


def test_workers_share_the_units_without_a_scheduler(where: dict[str, str]) -> None:
    planned(where)
    done = race(3, lambda k: commit_all(make_store(where), f"w{k}"))
    units = [r.unit for results in done for r in results]
    assert sorted(units) == [f"u-{i:06d}" for i in range(5)]  # each committed exactly once
    assert all(r.ours for results in done for r in results)
    check_samples(make_store(where), IDS)


# --- memory ------------------------------------------------------------------------------------
def traced_peak(root: Path, units: int, unit_size: int, hidden: int, length: int) -> int:
    """Peak traced memory while writing `units` units (states made outside the trace)."""
    ids = [sample_id(i) for i in range(units * unit_size)]
    store = UnitStore(fsspec.filesystem("file"), str(root))
    store.ensure_plan(ids, unit_size=unit_size, manifest=manifest(hidden=hidden))
    made = {sid: sample(sid, hidden, length) for sid in ids}
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        while (lease := store.claim_next("w0")) is not None:
            writer = store.writer(lease)
            for sid in lease.unit.ids:
                writer.add(sid, *made[sid])
            writer.commit()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_writer_memory_follows_the_unit_not_the_run(tmp_path: Path) -> None:
    hidden, length, unit_size = 128, 64, 4
    # Bytes of one unit as stored: float32 states (3 aux + 1 final) + two int64 columns.
    unit_bytes = unit_size * length * (4 * hidden * 4 + 2 * 8)
    small = traced_peak(tmp_path / "a", 2, unit_size, hidden, length)
    large = traced_peak(tmp_path / "b", 8, unit_size, hidden, length)
    print(f"unit {unit_bytes} B; peak traced: 2 units {small} B, 8 units {large} B")
    assert large <= 1.5 * unit_bytes + (256 << 10)
    assert large <= small * 1.15 + (64 << 10)
    # With parts smaller than the unit, the rows held at once follow the part size.
    store = UnitStore(fsspec.filesystem("file"), str(tmp_path / "c"))
    store.ensure_plan(IDS[:8], unit_size=8, manifest=manifest(hidden=hidden))
    lease = store.claim("u-000000", "w0")
    assert lease is not None
    writer = store.writer(lease, part_bytes=unit_bytes // 4)
    fill(writer, hidden, length)
    writer.commit()
    sample_bytes = unit_bytes // unit_size
    assert writer.peak_buffered <= unit_bytes // 4 + sample_bytes
    assert len(store.committed()["u-000000"]["objects"]) >= 4
    check_samples(store, IDS[:8], hidden=hidden, length=length)


def test_a_renewed_lease_outlives_its_term_and_a_released_one_frees_the_unit(
    tmp_path: Path,
) -> None:
    where = {"kind": "local", "root": str(tmp_path / "s"), "endpoint": ""}
    store = planned(where, lease_s=0.6)
    lease = store.claim("u-000000", "w0")
    assert lease is not None
    with lease.keepalive(every_s=0.1):
        time.sleep(1.0)  # past the first term: the heartbeat renewed it
        assert make_store(where, 0.6).claim("u-000000", "w1") is None
    lease.release()
    assert not lease.renew()  # released: a late heartbeat cannot hold the unit again
    again = make_store(where, 0.6).claim("u-000000", "w1")
    assert again is not None and again.generation == 1

    def broken(writer: Any) -> None:
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        run_units(make_store(where, 600.0), "w2", broken)
    # The failed unit is free at once, not after 600 s.
    assert make_store(where, 600.0).status()["free"] == 4


def test_a_live_worker_finishes_the_units_of_a_dead_one(where: dict[str, str]) -> None:
    store = planned(where, lease_s=2.0)
    dead = store.claim("u-000002", "dead")  # claims, then never renews nor commits
    assert dead is not None
    results = run_units(make_store(where, 2.0), "stayer", fill, wait_for_held=True, poll_s=0.2)
    assert sorted(r.unit for r in results) == [f"u-{i:06d}" for i in range(5)]
    assert [r.attempt for r in results if r.unit == "u-000002"] == ["g000001-stayer"]
    check_samples(make_store(where), IDS)
