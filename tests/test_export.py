"""Export to SpecForge's offline layout: loads back like SpecForge does, ids equal the records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kimi_pipe.exporters import (
    INDEX_FILE,
    ROWS_PER_DIR,
    export_specforge,
    run_export,
    specforge_path,
)
from kimi_pipe.extraction.hf_backend import HFBackend
from kimi_pipe.stages.extract import run_extract
from kimi_pipe.stages.jobs.export import export_job
from kimi_pipe.store.hidden_store import HiddenStore, StoreWriter, make_manifest
from tests.test_extract_hf import (
    TINY_HIDDEN,
    extract_cfg,
    make_tiny_model,
    random_records,
    write_jsonl,
)

REPO = Path(__file__).resolve().parent.parent


def load_like_specforge(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    """What SpecForge's offline dataset does: walk for *.ckpt, torch.load each."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for directory, _, files in os.walk(root):
        for name in files:
            if name.endswith(".ckpt"):
                path = Path(directory) / name
                found[str(path.relative_to(root))] = torch.load(path, weights_only=False)
    return found


def synthetic_store(path: Path, ids: list[str], hidden: int = 4, layers: tuple = (1, 3, 4)) -> Path:
    """A store written through the writer API with random states (export does not care how)."""
    manifest = make_manifest(
        model="m",
        num_layers=8,
        layer_ids=list(layers),
        hidden_size=hidden,
        dtype="float32",
        loss_mask="test",
        source_runs=[str(path.parent)],
        backend="test",
    )
    gen = torch.Generator().manual_seed(len(ids))
    with StoreWriter(path, manifest, shard_samples=3) as w:
        for i, sid in enumerate(ids):
            n = 2 + i % 5
            w.add(
                sid,
                list(range(i, i + n)),
                [0] + [1] * (n - 1),
                torch.randn(n, len(layers) * hidden, generator=gen),
                torch.randn(n, hidden, generator=gen),
            )
    return path


def read_index(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / INDEX_FILE).read_text().splitlines()]


# --------------------------------------------------------------------------- real extraction


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], dict]:
    """Two generate-like run dirs extracted with a tiny random Llama (same ids in both)."""
    root = tmp_path_factory.mktemp("runs")
    model_dir = make_tiny_model(root / "tiny")
    backend = HFBackend(model_dir, store_dtype="bfloat16")
    records: dict[tuple[str, str], dict] = {}
    stores = []
    for name, seed in (("runA", 3), ("runB", 4)):
        run = root / name
        run.mkdir()
        rows = random_records(5, seed=seed)
        write_jsonl(run / "records.jsonl", rows)
        run_extract(
            extract_cfg([f"extract.run_dir={run}", f"extract.model_path={model_dir}"]), backend
        )
        stores.append(run / "hidden_hf")
        for r in rows:
            records[(str((run / "hidden_hf").resolve()), r["id"])] = r
    return stores, records


def test_export_loads_back_with_record_ids_shapes_and_dtypes(
    tmp_path: Path, two_runs: tuple[list[Path], dict]
) -> None:
    stores, records = two_runs
    out = tmp_path / "export"
    summary = export_specforge(stores, out, seed=0)
    files = load_like_specforge(out)
    assert len(files) == summary["samples"] == 10  # same ids in both runs: both kept
    index = {row["file"]: row for row in read_index(out)}
    assert set(index) == set(files)
    for rel, data in files.items():
        assert set(data) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        rec = records[(index[rel]["store"], index[rel]["id"])]
        n = len(rec["prompt_ids"]) + len(rec["output_ids"])
        assert data["input_ids"].dtype == torch.int64
        assert data["loss_mask"].dtype == torch.int64
        assert data["input_ids"].tolist() == rec["prompt_ids"] + rec["output_ids"]
        assert data["loss_mask"].tolist() == rec["loss_mask"]
        assert data["hidden_state"].shape == (1, n, TINY_HIDDEN)
        assert data["aux_hidden_state"].shape == (1, n, 3 * TINY_HIDDEN)
        assert data["hidden_state"].dtype == torch.bfloat16  # the store's dtype
        # The file holds this sample only (not the storage of a whole shard).
        payload = sum(t.numel() * t.element_size() for t in data.values())
        assert (out / rel).stat().st_size < payload + 4096  # torch.save adds ~2.3 KB
        stored = HiddenStore(index[rel]["store"])[index[rel]["id"]]
        assert torch.equal(data["aux_hidden_state"][0], stored["aux_hidden_state"])
        assert torch.equal(data["hidden_state"][0], stored["hidden_state"])
    card = (out / "README.md").read_text()
    total = sum(len(r["loss_mask"]) for r in records.values())
    loss = sum(sum(r["loss_mask"]) for r in records.values())
    assert f"| tokens | {total} |" in card
    assert f"| loss tokens (loss_mask = 1) | {loss} |" in card
    assert "[1, 3, 4]" in card and "post_norm" in card and "model.loss_mask" in card


def test_rows_directories_follow_specforge_grouping(tmp_path: Path) -> None:
    assert specforge_path(tmp_path, 0) == tmp_path / "rows_0-2000" / "data_0.ckpt"
    assert specforge_path(tmp_path, ROWS_PER_DIR - 1).parent.name == "rows_0-2000"
    assert specforge_path(tmp_path, ROWS_PER_DIR) == tmp_path / "rows_2000-4000" / "data_2000.ckpt"


# --------------------------------------------------------------------------- merge and shuffle


def test_merge_shuffle_is_deterministic_and_seeded(tmp_path: Path) -> None:
    a = synthetic_store(tmp_path / "B3" / "store", [f"a{i}" for i in range(8)])
    b = synthetic_store(tmp_path / "B5" / "store", [f"b{i}" for i in range(7)])

    def order(out: Path) -> list[tuple[str, str]]:
        return [(Path(r["store"]).parent.name, r["id"]) for r in read_index(out)]

    export_specforge([a, b], tmp_path / "e1", seed=0)
    export_specforge([b, a], tmp_path / "e2", seed=0)  # listing order does not matter
    export_specforge([a, b], tmp_path / "e3", seed=1)
    assert order(tmp_path / "e1") == order(tmp_path / "e2")
    assert order(tmp_path / "e1") != order(tmp_path / "e3")
    assert sorted(order(tmp_path / "e1")) == sorted(order(tmp_path / "e3"))
    assert len(order(tmp_path / "e1")) == 15
    stores_in_order = [s for s, _ in order(tmp_path / "e1")]
    assert stores_in_order != sorted(stores_in_order)  # really mixed, not concatenated
    # Same plan -> byte-identical files.
    f1 = load_like_specforge(tmp_path / "e1")
    f2 = load_like_specforge(tmp_path / "e2")
    assert f1.keys() == f2.keys()
    for k in f1:
        assert torch.equal(f1[k]["aux_hidden_state"], f2[k]["aux_hidden_state"])


def test_resume_rewrites_only_missing_files_and_refuses_another_plan(tmp_path: Path) -> None:
    store = synthetic_store(tmp_path / "run" / "store", [f"s{i}" for i in range(6)])
    out = tmp_path / "export"
    export_specforge([store], out, seed=0)
    before = load_like_specforge(out)
    victim = specforge_path(out, 2)
    victim.unlink()
    victim.with_name(victim.name + ".tmp").write_bytes(b"torn")  # a killed write
    summary = export_specforge([store], out, seed=0)
    assert summary["counts"] == {"written": 1, "already_written": 5, "skipped_non_finite": 0}
    after = load_like_specforge(out)
    assert after.keys() == before.keys()
    assert torch.equal(
        after[str(victim.relative_to(out))]["input_ids"],
        before[str(victim.relative_to(out))]["input_ids"],
    )
    with pytest.raises(ValueError, match="another export"):
        export_specforge([store], out, seed=1)


def test_incompatible_stores_are_refused(tmp_path: Path) -> None:
    a = synthetic_store(tmp_path / "a" / "store", ["x"])
    b = synthetic_store(tmp_path / "b" / "store", ["y"], layers=(1, 2, 4))
    with pytest.raises(ValueError, match="layer_ids"):
        export_specforge([a, b], tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="kimi_pipe.extract"):
        export_specforge([tmp_path / "nothing"], tmp_path / "out2")


def test_non_finite_sample_is_skipped_and_counted(tmp_path: Path) -> None:
    store = synthetic_store(tmp_path / "run" / "store", ["ok1", "ok2"])
    manifest = json.loads((store / "manifest.json").read_text())
    with StoreWriter(store, manifest) as w:  # reopen: appends a new shard
        w.add("nan", [1, 2], [0, 1], torch.full((2, 12), float("nan")), torch.zeros(2, 4))
    summary = export_specforge([store], tmp_path / "out")
    assert summary["counts"]["skipped_non_finite"] == 1
    assert summary["samples"] == 2
    assert "nan" not in {r["id"] for r in read_index(tmp_path / "out")}


# --------------------------------------------------------------------------- dataset card


def test_card_reports_fidelity_and_billing_drift_of_the_source_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    rows = random_records(4, seed=9)
    rows[1]["completion_tokens_reported"] += 2  # the provider billed 2 tokens more
    write_jsonl(run / "records.jsonl", rows)
    (run / "audit.json").write_text(
        json.dumps(
            {"samples": 4, "exact_match_rate": 0.75, "mismatches": {"non_canonical_split": 1}}
        )
    )
    (run / "summary.json").write_text(
        json.dumps({"billing_drift": {"reconstructed_minus_reported": -2, "ratio": 0.98}})
    )
    store = synthetic_store(run / "store", [r["id"] for r in rows])
    export_specforge([store], tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| exact_match_rate | 0.75 |" in card
    assert "| mismatches.non_canonical_split | 1 |" in card
    assert "| reconstructed_minus_reported | -2 |" in card
    assert "| samples_differing | 1 |" in card
    assert '"ratio": 0.98' in card


def test_cli_export(tmp_path: Path) -> None:
    store = synthetic_store(tmp_path / "run" / "store", ["p", "q", "r"])
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "kimi_pipe",
        "export",
        "++format=specforge",
        f"++stores=[{store}]",
        "++seed=3",
        f"output={out}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(load_like_specforge(out)) == 3
    with pytest.raises(ValueError, match="not supported"):
        job = export_job(
            OmegaConf.create({"format": "eagle", "stores": [str(store)], "output": "x"})
        )
        run_export(job)
