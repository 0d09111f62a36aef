"""The sharded hidden-state store: round trip, crash recovery, no duplicates, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk

from kimi_pipe.store.hidden_store import (
    INDEX,
    SHARDS,
    TOKENS,
    HiddenStore,
    StoreWriter,
    default_layer_ids,
    make_manifest,
)

H = 8


def manifest(dtype: str = "float32", layer_ids: tuple[int, ...] = (1, 3, 4)) -> dict:
    return make_manifest(
        model="tiny",
        num_layers=8,
        layer_ids=list(layer_ids),
        hidden_size=H,
        dtype=dtype,
        loss_mask="prompt=0 output=1",
        source_runs=["runs/x"],
        backend="test",
    )


def sample(i: int) -> tuple[str, list[int], list[int], torch.Tensor, torch.Tensor]:
    """Sample i: length 1 + i % 6, states that encode the id so mix-ups show."""
    n = 1 + i % 6
    gen = torch.Generator().manual_seed(i)
    ids = torch.randint(0, 1000, (n,), generator=gen).tolist()
    mask = [0] * (n // 2) + [1] * (n - n // 2)
    return (
        f"id{i}",
        ids,
        mask,
        torch.randn(n, 3 * H, generator=gen),
        torch.randn(n, H, generator=gen),
    )


def shard_files(path: Path) -> list[str]:
    return sorted(p.name for p in (path / SHARDS).iterdir())


def test_round_trip_across_shards(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, manifest(), shard_samples=4) as w:
        for i in range(10):
            w.add(*sample(i))
    assert shard_files(tmp_path) == [f"shard_0000{k}.safetensors" for k in range(3)]
    store = HiddenStore(tmp_path)
    assert len(store) == 10 and store.ids == [f"id{i}" for i in range(10)]
    for i in range(10):
        sid, ids, mask, aux, final = sample(i)
        got = store[sid]
        assert got["input_ids"].tolist() == ids and got["input_ids"].dtype == torch.int64
        assert got["loss_mask"].tolist() == mask and got["loss_mask"].dtype == torch.int64
        assert torch.equal(got["aux_hidden_state"], aux)
        assert torch.equal(got["hidden_state"], final)
        # A sample owns its rows: saving it must not drag the whole shard along.
        t = got["aux_hidden_state"]
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert store.total_tokens() == sum(len(sample(i)[1]) for i in range(10))
    entry = store.entry("id5")
    assert (entry.shard, entry.offset) == (
        "shard_00001.safetensors",
        sum(len(sample(i)[1]) for i in range(4, 5)),
    )
    ds = load_from_disk(str(tmp_path / TOKENS))
    assert ds["id"] == store.ids
    assert ds[3]["input_ids"] == sample(3)[1] and ds[3]["loss_mask"] == sample(3)[2]
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["layer_ids"] == [1, 3, 4] and m["final_state"] == "post_norm"
    assert m["aux_hidden_size"] == 3 * H and m["dtype"] == "float32"


def test_states_are_stored_in_the_manifest_dtype(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, manifest("bfloat16")) as w:
        w.add(*sample(2))
    got = HiddenStore(tmp_path)["id2"]
    assert got["aux_hidden_state"].dtype == torch.bfloat16
    assert torch.equal(got["aux_hidden_state"], sample(2)[3].to(torch.bfloat16))


def test_killed_run_resumes_after_last_complete_shard(tmp_path: Path) -> None:
    w = StoreWriter(tmp_path, manifest(), shard_samples=3)
    for i in range(8):  # commits shards of id0-2 and id3-5; id6, id7 only buffered
        w.add(*sample(i))
    del w  # killed: no flush, no close
    # What a kill can leave: a half-written shard and a torn index line.
    (tmp_path / SHARDS / "shard_00002.safetensors.tmp").write_bytes(b"\x00" * 10)
    with open(tmp_path / INDEX, "a") as f:
        f.write('{"id": "id6", "shard": "shard_0000')
    assert sorted(HiddenStore(tmp_path).ids) == sorted(f"id{i}" for i in range(6))

    w = StoreWriter(tmp_path, manifest(), shard_samples=3)
    assert w.done_ids == {f"id{i}" for i in range(6)}
    assert not list((tmp_path / SHARDS).glob("*.tmp"))
    with pytest.raises(ValueError, match="already in the store"):
        w.add(*sample(4))
    for i in range(10):
        if f"id{i}" not in w.done_ids:
            w.add(*sample(i))
    w.close()
    store = HiddenStore(tmp_path)
    lines = (tmp_path / INDEX).read_text().splitlines()
    assert sorted(json.loads(x)["id"] for x in lines) == sorted(f"id{i}" for i in range(10))
    for i in range(10):
        assert torch.equal(store[f"id{i}"]["hidden_state"], sample(i)[4])


def test_lost_index_is_rebuilt_from_the_shards(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, manifest(), shard_samples=2) as w:
        for i in range(5):
            w.add(*sample(i))
    (tmp_path / INDEX).write_text("")  # e.g. a crash between shard rename and index append
    assert len(HiddenStore(tmp_path)) == 0
    StoreWriter(tmp_path, manifest()).close()
    store = HiddenStore(tmp_path)
    assert len(store) == 5
    assert torch.equal(store["id3"]["aux_hidden_state"], sample(3)[3])


def test_reopening_with_other_settings_is_refused(tmp_path: Path) -> None:
    StoreWriter(tmp_path, manifest()).close()
    with pytest.raises(ValueError, match="layer_ids"):
        StoreWriter(tmp_path, manifest(layer_ids=(1, 2, 4)))
    with pytest.raises(ValueError, match="dtype"):
        StoreWriter(tmp_path, manifest("bfloat16"))


def test_bad_shapes_name_the_sample(tmp_path: Path) -> None:
    w = StoreWriter(tmp_path, manifest())
    sid, ids, mask, aux, final = sample(5)
    with pytest.raises(ValueError, match="id5.*aux"):
        w.add(sid, ids, mask, aux[:, :H], final)
    with pytest.raises(ValueError, match="id5.*loss_mask"):
        w.add(sid, ids, mask[:-1], aux, final)
    w.add(sid, ids, mask, aux.unsqueeze(0), final.unsqueeze(0))  # [1, L, .] is accepted
    w.close()
    assert len(HiddenStore(tmp_path)) == 1


def test_token_cap_commits_a_shard_early(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, manifest(), shard_samples=100, shard_tokens=6) as w:
        for i in range(6):  # lengths 1..6
            w.add(*sample(i))
    assert len(shard_files(tmp_path)) == 3  # lengths [1, 2, 3] [4, 5] [6]: each reaches 6 tokens


def test_missing_store_and_unknown_sample_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="kimi_pipe.extract"):
        HiddenStore(tmp_path / "none")
    StoreWriter(tmp_path, manifest()).close()
    with pytest.raises(KeyError, match="nope"):
        HiddenStore(tmp_path)["nope"]


def test_default_layer_rule() -> None:
    assert default_layer_ids(61) == [1, 29, 57]  # Kimi K2.5
    assert default_layer_ids(30) == [1, 14, 26]  # SmolLM2-135M
    with pytest.raises(ValueError, match="layer_ids"):
        default_layer_ids(6)
