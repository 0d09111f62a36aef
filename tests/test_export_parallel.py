"""Export over units in several processes, with memory that follows a unit, not the run.

A unit store written by the unit protocol (several units, several data objects a unit) is
exported with `workers=1` and `workers=2` (spawned processes): every data file is the same
byte for byte in all four formats. The export of the same units from moto's S3 server equals
the local one. tracemalloc's peak of an export at two run sizes grows by the ids' metadata
only, never by the rows (token ids) or the states.
"""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from test_unit_store import new_bucket, s3_endpoint  # noqa: F401  (the moto S3 fixture)
from unit_store_child import FAKE_KEY, LAYERS, H, fill, s3_fs, sample_id

from kimi_pipe.errors import ConfigError
from kimi_pipe.exporters import FORMATS, INDEX_FILE, TOKENS_FILE, export
from kimi_pipe.exporters import parallel as export_parallel
from kimi_pipe.store import arrow_rows
from kimi_pipe.store.conventions import final_norm_spec
from kimi_pipe.store.hidden_store import make_manifest
from kimi_pipe.store.units import UnitStore, run_units

# Files that name the output directory or the wall time: compared apart (see below).
PATH_BEARING = {"README.md", "export_summary.json", "specforge_train.yaml", "state.json"}


def manifest() -> dict[str, Any]:
    """A pre-norm store that records its norm: every format can be exported from it."""
    weight = torch.rand(H, generator=torch.Generator().manual_seed(1)) + 0.5
    return make_manifest(
        model="tiny",
        num_layers=8,
        layer_ids=list(LAYERS),
        final_state="pre_norm",
        hidden_size=H,
        dtype="float32",
        loss_mask="prompt=0 output=1",
        source_runs=[],
        backend="test",
        extra={"final_norm": final_norm_spec(weight, 1e-5, "norm")},
    )


def build(store: UnitStore, n: int, length: int | None = None, unit_size: int = 4) -> UnitStore:
    """`n` samples in units of `unit_size`, about two data objects a unit."""
    store.ensure_plan([sample_id(i) for i in range(n)], unit_size=unit_size, manifest=manifest())
    per_sample = (length or 6) * (len(LAYERS) + 1) * H * 4
    run_units(store, "w0", lambda w: fill(w, H, length), part_bytes=2 * per_sample)
    return store


def local_units(root: Path, n: int, length: int | None = None) -> Path:
    build(UnitStore.open(str(root)), n, length)
    return root


def files(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in PATH_BEARING
    }


def summary(out: Path) -> dict[str, Any]:
    s = json.loads((out / "export_summary.json").read_text())
    for key in ("output", "wall_s"):
        s.pop(key)
    return s


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_workers_write_the_same_bytes_as_one(tmp_path: Path, fmt: str) -> None:
    store = local_units(tmp_path / "units", 22)
    one, two = tmp_path / "one" / "out", tmp_path / "two" / "out"
    s1 = export([store], one, fmt, seed=3, workers=1)
    s2 = export([store], two, fmt, seed=3, workers=2)
    # The DFlash family leaves out samples its reader rejects (no two consecutive loss tokens).
    left_out = s1["counts"].get("skipped_no_consecutive_loss", 0)
    assert s2["counts"].get("skipped_no_consecutive_loss", 0) == left_out
    assert left_out == 0 or fmt in ("dflash", "dspark")
    assert s1["samples"] == s2["samples"] == 22 - left_out
    a, b = files(one), files(two)
    assert sorted(a) == sorted(b)
    assert {k for k in a if a[k] != b[k]} == set()
    assert summary(one) == summary(two)
    assert not (one / export_parallel.PARTS_DIR).exists()
    assert not (two / export_parallel.PARTS_DIR).exists()
    ids = [json.loads(line)["id"] for line in (two / INDEX_FILE).read_text().splitlines()]
    if not left_out:
        assert sorted(ids) == [sample_id(i) for i in range(22)]
    indexes = [json.loads(line)["index"] for line in (two / INDEX_FILE).read_text().splitlines()]
    assert indexes == sorted(indexes) and len(indexes) == 22 - left_out
    assert left_out or indexes == list(range(22))
    if fmt == "speculators":
        # datasets' own state.json: only its fingerprint may differ (random for from_dict too).
        st = [json.loads((o / "state.json").read_text()) for o in (one, two)]
        for s in st:
            s.pop("_fingerprint")
        assert st[0] == st[1]


def test_many_fragments_merge_in_rounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = local_units(tmp_path / "units", 22)
    export([store], tmp_path / "a", "tokens", seed=5)
    monkeypatch.setattr(export_parallel, "MAX_OPEN_FRAGMENTS", 2)  # 11+ tasks: 3 rounds
    export([store], tmp_path / "b", "tokens", seed=5)
    for name in (TOKENS_FILE, INDEX_FILE):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_resume_after_a_killed_export_keeps_files_and_drops_fragments(tmp_path: Path) -> None:
    store = local_units(tmp_path / "units", 10)
    out = tmp_path / "out"
    export([store], out, "modelopt", seed=1)
    first = files(out)
    victim = out / "4.pt"
    victim.unlink()
    (out / export_parallel.PARTS_DIR).mkdir()
    (out / export_parallel.PARTS_DIR / "00000000.jsonl").write_text('{"i": 99, torn')
    s = export([store], out, "modelopt", seed=1, workers=2)
    assert s["counts"] == {"written": 1, "already_written": 9, "skipped_non_finite": 0}
    assert files(out) == first


def test_bad_worker_counts_are_refused(tmp_path: Path) -> None:
    store = local_units(tmp_path / "units", 4)
    for bad in (0, -2, "two"):
        with pytest.raises(ConfigError, match="export.workers"):
            export([store], tmp_path / "out", "tokens", workers=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


# --- an S3 unit store --------------------------------------------------------------------------
def test_export_from_s3_equals_the_local_export(tmp_path: Path, s3_endpoint: str) -> None:  # noqa: F811
    root = f"{new_bucket(s3_endpoint)}/run/hidden"
    build(UnitStore(s3_fs(s3_endpoint), root), 13)
    local = local_units(tmp_path / "units", 13)
    options = {
        "key": FAKE_KEY,
        "secret": FAKE_KEY,
        "client_kwargs": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"},
    }
    url = f"s3://{root}"
    for fmt in ("specforge", "tokens"):
        from_s3 = tmp_path / f"s3-{fmt}"
        s = export([url + "/"], from_s3, fmt, seed=2, workers=2, storage_options=options)
        export([local], tmp_path / f"local-{fmt}", fmt, seed=2)
        assert s["samples"] == 13 and s["per_store"][0]["store"] == url
        a, b = files(from_s3), files(tmp_path / f"local-{fmt}")
        index = INDEX_FILE
        assert sorted(a) == sorted(b)
        assert {k for k in a if k not in (index, "export_plan.json") and a[k] != b[k]} == set()
        rows_a = [json.loads(x) for x in a[index].decode().splitlines()]
        rows_b = [json.loads(x) for x in b[index].decode().splitlines()]
        assert {r.pop("store") for r in rows_a} == {url}
        assert {r.pop("store") for r in rows_b} == {str(local.resolve())}
        assert rows_a == rows_b


def test_a_url_without_a_unit_plan_is_a_clear_error(tmp_path: Path, s3_endpoint: str) -> None:  # noqa: F811
    options = {"key": FAKE_KEY, "secret": FAKE_KEY, "client_kwargs": {"endpoint_url": s3_endpoint}}
    with pytest.raises(Exception, match="holds no unit plan"):
        export([f"s3://{new_bucket(s3_endpoint)}/nothing"], tmp_path / "o", storage_options=options)


# --- memory ------------------------------------------------------------------------------------
LENGTH = 2048  # tokens a sample: a row held in Python costs >= 2 x 8 x 2048 bytes (two lists)
ROW_BYTES = 2 * 8 * LENGTH


def peak_of_export(
    tmp_path: Path, n: int, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, int]:
    """(tracemalloc peak during the export, the export's sample count)."""
    store = local_units(tmp_path / f"units-{n}", n, LENGTH)
    monkeypatch.setattr(arrow_rows, "DEFAULT_BATCH_ROWS", 8)  # the Arrow writer's batch
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        s = export([store], tmp_path / f"out-{fmt}-{n}", fmt, seed=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, s["samples"]


@pytest.mark.parametrize("fmt", ["tokens", "speculators", "specforge"])
def test_export_memory_does_not_grow_with_the_run(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    peak_of_export(tmp_path, 4, fmt, monkeypatch)  # imports (datasets, ...) happen here
    # Each size twice, the lower peak kept: one-time costs (a lazy import, a cache's first
    # growth) land in whichever export meets them first, whatever its size.
    runs = [
        peak_of_export(tmp_path / f"r{k}", n, fmt, monkeypatch) for k in (0, 1) for n in (24, 96)
    ]
    small, n_small = min(runs[0], runs[2])
    large, n_large = min(runs[1], runs[3])
    assert (n_small, n_large) == (24, 96)
    # What may grow: the plan, the stores' indexes (units of 4 here: the index JSON of a
    # unit read whole is a few kB), 1.5-4.1 kB an id measured here. What may
    # not: rows or states. Holding every row would add >= 72 x ROW_BYTES (2.4 MB) here.
    per_id = 8192
    growth = large - small
    print(f"{fmt}: peak {small} B at {n_small} samples, {large} B at {n_large}")
    assert growth <= (n_large - n_small) * per_id, (growth, small, large)
    assert 4 * per_id <= ROW_BYTES  # so a held row (or a quarter of one) shows
    # And the whole peak stays under a bound set by a unit (4 samples) and the Arrow batch,
    # not by the run: a generous constant for imports and a few units' rows.
    assert large < 4_000_000 + 16 * ROW_BYTES * 8, large


def test_row_file_helpers_give_the_same_digest(tmp_path: Path) -> None:
    """save_rows (streamed) equals Dataset.from_dict's data file (what speculators wrote)."""
    from datasets import Dataset

    rows = {"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [1, 1]], "seq_len": [3, 2]}
    ds = Dataset.from_dict(rows)
    ds.set_format(type="torch")
    ds.save_to_disk(str(tmp_path / "a"))
    gen = ({k: v[i] for k, v in rows.items()} for i in range(2))
    assert arrow_rows.save_rows(gen, tmp_path / "b", rows, torch_format=True, batch_rows=1) == 2
    for name in ("data-00000-of-00001.arrow", "dataset_info.json"):
        digest = [hashlib.sha256((tmp_path / d / name).read_bytes()).hexdigest() for d in "ab"]
        assert digest[0] == digest[1], name


def test_workers_from_the_command_line(tmp_path: Path) -> None:
    """`export.workers=2` on the command line gives the same rows; a bad count is one line
    on stderr and exit 2, before anything is written."""
    import subprocess
    import sys

    store = local_units(tmp_path / "units", 9)
    export([store], tmp_path / "ref", "tokens", seed=0)
    repo = Path(__file__).resolve().parent.parent

    def cli(out: Path, workers: str) -> subprocess.CompletedProcess[str]:
        cmd = [
            sys.executable,
            "-m",
            "kimi_pipe",
            "export",
            "format=tokens",
            f"++stores=[{store}]",
            f"output={out}",
            f"export.workers={workers}",
            f"hydra.run.dir={tmp_path / 'hydra'}",
        ]
        return subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300)

    done = cli(tmp_path / "two", "2")
    assert done.returncode == 0, done.stderr
    ref = tmp_path / "ref"
    for name in (TOKENS_FILE, INDEX_FILE):
        assert (tmp_path / "two" / name).read_bytes() == (ref / name).read_bytes()
    bad = cli(tmp_path / "bad", "0")
    assert bad.returncode == 2, bad.stderr
    assert "export.workers" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()
