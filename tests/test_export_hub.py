"""push_to_hub: the export packed within the Hub's limits, planned before anything is written.

A real `HfApi` subclass records `upload_large_folder` (no network). The packed copy restores
to the export byte for byte; the planner's figures bound the real ones; at 100x the seeds
(4.2B tokens of Kimi K2.5, about 240 TB) every limit holds, from counts alone.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from huggingface_hub import HfApi
from test_export_parallel import local_units

from kimi_pipe.config import CONF_DIR
from kimi_pipe.exporters import export, hub
from kimi_pipe.exporters.base import ExportContext, load_exporter
from kimi_pipe.exporters.hub import (
    ExportShape,
    HubLayoutError,
    HubLimits,
    HubSettings,
    estimate_shape,
    plan_layout,
)


class RecordingHfApi(HfApi):
    """HfApi with its upload replaced by a record of the call and of the folder's files."""

    def __init__(self) -> None:
        super().__init__(token=False)  # never a real token, never the network
        self.calls: list[dict[str, Any]] = []

    def upload_large_folder(self, repo_id: str, folder_path: str | Path, **kw: Any) -> None:  # type: ignore[override]
        root = Path(folder_path)
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        self.calls.append(
            {"repo_id": repo_id, "folder_path": str(folder_path), **kw, "files": files}
        )


def restore(folder: Path, into: Path) -> None:
    """What a user does after snapshot_download: untar data/*/*.tar, join rows/<name>-*.jsonl."""
    into.mkdir()
    for tar in sorted(folder.glob("data/*/*.tar")):
        with tarfile.open(tar) as t:
            t.extractall(into, filter="data")
    parts: dict[str, list[Path]] = {}
    for part in sorted((folder / "rows").glob("*.jsonl")):
        parts.setdefault(part.name.rsplit("-", 1)[0], []).append(part)
    for stem, files in parts.items():
        (into / f"{stem}.jsonl").write_bytes(b"".join(p.read_bytes() for p in files))
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        if p.is_file() and rel.parts[0] not in ("data", "rows"):
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            (into / rel).write_bytes(p.read_bytes())


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("fmt", ["specforge", "tokens", "speculators", "modelopt"])
def test_push_packs_within_limits_and_restores_the_export(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    store = local_units(tmp_path / "units", 22, 40)
    api = RecordingHfApi()
    settings = {"repo_id": "org/k-eagle", "shard_bytes": 30_000, "files_per_folder": 3}
    out = tmp_path / "out"
    s = export([store], out, fmt, seed=1, push_to_hub=settings, hub_api=api)
    folder = tmp_path / "out.hub"
    assert len(api.calls) == 1
    call = api.calls[0]
    assert call["repo_id"] == "org/k-eagle" and call["repo_type"] == "dataset"
    assert call["folder_path"] == str(folder) and call["private"] is True
    assert not any("token" in k for k in call)
    # The layout: tars in numbered folders, at most files_per_folder each; line files cut.
    tars = sorted(folder.glob("data/*/*.tar"))
    if fmt != "tokens":
        assert len(tars) >= 2 and len({t.parent for t in tars}) >= 1
        assert max(len(list(d.iterdir())) for d in (folder / "data").iterdir()) <= 3
    assert sorted(call["files"]) == sorted(tree(folder))
    # Everything restores to the export, byte for byte.
    restore(folder, tmp_path / "restored")
    assert tree(tmp_path / "restored") == tree(out)
    # The plan (from counts, before writing) bounds what was packed.
    plan = s["push_to_hub"]["plan"]
    real = hub.check_folder(folder, HubLimits())
    assert real["files"] <= plan["files"], (real, plan)
    assert real["max_file_bytes"] <= plan["max_file_bytes"], (real, plan)
    # A second push packs the same bytes again and keeps huggingface_hub's resume cache.
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "marker").write_text("sent")
    # wall time, resumed counts; datasets' own state.json fingerprint (random, as from_dict's)
    volatile = {"export_summary.json", "README.md", "state.json"}
    before = {k: v for k, v in tree(folder).items() if k not in volatile}
    export([store], out, fmt, seed=1, push_to_hub=settings, hub_api=api)
    after = {k: v for k, v in tree(folder).items() if k not in volatile}
    assert after == before and len(api.calls) == 2
    for name, parts in plan["line_parts"].items():
        stem = name.rsplit(".", 1)[0]
        assert len(list((folder / "rows").glob(f"{stem}-*.jsonl"))) <= parts


def test_a_plan_that_cannot_fit_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    store = local_units(tmp_path / "units", 6)
    out = tmp_path / "out"
    api = RecordingHfApi()
    with pytest.raises(HubLayoutError, match=r"shard_bytes=60,000,000,000 is over the Hub.s 50,0"):
        export(
            [store],
            out,
            "specforge",
            push_to_hub={"repo_id": "o/n", "shard_bytes": 6e10},
            hub_api=api,
        )
    with pytest.raises(HubLayoutError, match="never read from a config.*HF_TOKEN"):
        export([store], out, "specforge", push_to_hub={"repo_id": "o/n", "token": "x"})
    with pytest.raises(HubLayoutError, match="files_per_folder"):
        export([store], out, "tokens", push_to_hub={"repo_id": "o/n", "files_per_folder": 10_001})
    with pytest.raises(HubLayoutError, match="owner/name"):
        export([store], out, "tokens", push_to_hub={"repo_id": "no-owner"})
    assert not out.exists() and not api.calls


def test_without_hf_token_the_push_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    store = local_units(tmp_path / "units", 4)
    with pytest.raises(HubLayoutError, match="HF_TOKEN"):
        export([store], tmp_path / "out", "tokens", push_to_hub={"repo_id": "o/n"})
    assert not (tmp_path / "out").exists()


def shape(**kw: Any) -> ExportShape:
    base = dict(
        samples=1000,
        tokens=1000 * 3000,
        longest=16384,
        sample_bytes_per_token=57_360,
        sample_file_overhead=65_536,
        line_files={"export_index.jsonl": 256_000},
        longest_line=200_000,
        dataset_bytes=0,
        small_files=8,
    )
    base.update(kw)
    return ExportShape(**base)  # type: ignore[arg-type]


def test_each_limit_names_itself_and_the_setting_to_change() -> None:
    many = shape(samples=10**7, tokens=10**7 * 3000)  # 1.7 PB
    with pytest.raises(HubLayoutError, match=r"files a repository: raise .*shard_bytes"):
        plan_layout(many, HubSettings(repo_id="o/n", shard_bytes=10**9))
    huge = shape(samples=10**8, tokens=10**8 * 3000)  # 17 PB: 430k files even at 40 GB
    with pytest.raises(HubLayoutError, match="several repositories"):
        plan_layout(huge, HubSettings(repo_id="o/n", shard_bytes=40 * 10**9))
    assert plan_layout(many, HubSettings(repo_id="o/n", shard_bytes=20 * 10**9)).files < 100_000
    with pytest.raises(HubLayoutError, match="re-extract with a lower extract.max_len"):
        plan_layout(shape(longest=10**6), HubSettings(repo_id="o/n"))
    folders = shape(samples=10**5, tokens=10**5 * 3000)  # 17 TB: 17k tars of 1 GB
    one_each = HubSettings(repo_id="o/n", shard_bytes=10**9, files_per_folder=1)
    with pytest.raises(HubLayoutError, match="entries, over the Hub's 10,000.*files_per_folder"):
        plan_layout(folders, one_each)  # data/ would hold 17k folders
    assert plan_layout(shape(longest=262_144), HubSettings(repo_id="o/n")).warnings  # > 20 GB


# --- 100x the seeds ------------------------------------------------------------------------------
SEED_SAMPLES = 13_800  # conf/dataset B3-B8 num_samples (docs/datasets.md)
SEED_TOKENS = 42_000_000  # six sets of about 7M tokens
KIMI_HIDDEN = 7168  # Kimi K2.5's hidden size (docs/sglang.md, "Disk"), 3 aux layers, bf16


def kimi_files(fmt: str) -> tuple[dict[str, Any], Any]:
    manifest = {"hidden_size": KIMI_HIDDEN, "aux_hidden_size": 3 * KIMI_HIDDEN, "dtype": "bfloat16"}
    conv = {"output_layer_ids": [1, 29, 57], "capture_layer_ids": [2, 30, 58]}
    exporter = load_exporter(fmt)
    return exporter.files(ExportContext(Path("x"), manifest, conv, None)), exporter


@pytest.mark.parametrize("fmt", ["specforge", "speculators", "modelopt", "tokens"])
@pytest.mark.parametrize("longest", [16_384, 262_144])
def test_100x_the_seeds_fits_the_hub(fmt: str, longest: int) -> None:
    samples, tokens = 100 * SEED_SAMPLES, 100 * SEED_TOKENS
    files, exporter = kimi_files(fmt)
    per_sample = exporter.sample_path(Path("x"), 0) is not None
    s = estimate_shape(
        files,
        exporter.row_bytes(samples, tokens),
        exporter.dataset_bytes(samples, tokens),
        samples=samples,
        tokens=tokens,
        longest=longest,
        per_sample_files=per_sample,
    )
    defaults = yaml.safe_load((CONF_DIR / "config.yaml").read_text())["export"]["push_to_hub"]
    settings = HubSettings.from_mapping({**defaults, "repo_id": "o/n"})
    plan = plan_layout(s, settings)
    lim = HubLimits()
    assert plan.files <= lim.repo_files
    assert plan.max_file_bytes <= lim.max_file_bytes
    assert plan.max_folder_entries <= lim.folder_entries
    if per_sample:
        assert s.sample_bytes_per_token >= 57_344  # 4 states x 7168 x 2 bytes
        assert plan.total_bytes > 240 * 10**12
    if longest == 16_384:
        assert plan.max_file_bytes <= lim.advised_file_bytes and not plan.warnings
    print(fmt, longest, json.dumps({k: v for k, v in plan.figures().items() if k != "limits"}))
