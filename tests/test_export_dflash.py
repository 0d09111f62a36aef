"""The DFlash family and DSpark: capture layers from the drafter's own config, and exports in
SpecForge's offline contracts (docs/export.md, "DFlash family and DSpark").

Fast parts: synthetic stores and the tiny random Llama. The last test loads the exports with
SpecForge's own offline reader (a current commit, in a separate venv named by
KIMI_PIPE_SPECFORGE_PYTHON; skipped without it, saying how to make one).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from kimi_pipe.errors import ConfigError
from kimi_pipe.exporters import INDEX_FILE, export
from kimi_pipe.exporters.dflash import has_consecutive_loss
from kimi_pipe.extraction.draft_config import (
    capture_request,
    check_target_layers,
    draft_layers,
    read_draft_config,
)
from kimi_pipe.stages.extract import run_extract
from kimi_pipe.store.conventions import rms_norm
from kimi_pipe.store.hidden_store import HiddenStore
from tests.test_export_formats import HIDDEN, make_store
from tests.test_extract_hf import (
    TINY_HIDDEN,
    extract_cfg,
    hooked_states,
    make_tiny_model,
    random_records,
    write_jsonl,
)

REPO = Path(__file__).resolve().parents[1]

# The layer facts of SpecForge's own Kimi drafter configs (their source in each file's
# `_source`): the files benchmarks/drafters_miniature.py extracts with too.
DRAFTER_CONFIGS = REPO / "benchmarks" / "drafter_configs"
KIMI_K25_EAGLE3 = json.loads((DRAFTER_CONFIGS / "kimi-k25-eagle3.json").read_text())
KIMI_K27_DFLASH = json.loads((DRAFTER_CONFIGS / "kimi-k2.7-code-dflash.json").read_text())


def write_config(path: Path, config: dict) -> Path:
    path.write_text(json.dumps(config))
    return path


def dflash_config(layers: list[int], num_target_layers: int = 8) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "block_size": 4,
        "dflash_config": {"mask_token_id": 0, "target_layer_ids": layers},
        "num_target_layers": num_target_layers,
    }


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / INDEX_FILE).read_text().splitlines()]


# --------------------------------------------------------------------------- draft configs


def test_specforge_kimi_configs_name_the_layers_their_trainers_read() -> None:
    for engine in ("sglang", "vllm"):
        eagle = draft_layers(KIMI_K25_EAGLE3, engine=engine)
        # [2, 30, 58] are input-of-layer ids in both engines: outputs of [1, 29, 57], the
        # project's default EAGLE-3 store.
        assert (eagle.family, eagle.output_ids) == ("eagle3", [1, 29, 57])
    # The same layers written as output ids: right in SGLang, off by one in vLLM.
    as_output = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}
    assert draft_layers(as_output, engine="sglang").output_ids == [1, 29, 57]
    assert draft_layers(as_output, engine="vllm").output_ids == [0, 28, 56]
    dflash = draft_layers(KIMI_K27_DFLASH)
    assert (dflash.family, dflash.output_ids) == ("dflash", [1, 12, 24, 35, 47, 58])
    check_target_layers([dflash], 61)
    with pytest.raises(ConfigError, match="num_target_layers 61"):
        check_target_layers([dflash], 93)
    with pytest.raises(ConfigError, match="names no capture layers"):
        draft_layers({"architectures": ["DFlashDraftModel"], "dflash_config": {}})
    with pytest.raises(ConfigError, match="non-negative whole numbers"):
        draft_layers({"dflash_config": {"target_layer_ids": [1, "12"]}})


def test_capture_request_reads_the_union_of_the_configs(tmp_path: Path) -> None:
    a = write_config(tmp_path / "eagle.json", KIMI_K25_EAGLE3)
    b = write_config(tmp_path / "dflash.json", KIMI_K27_DFLASH)
    ids, drafts = capture_request(None, [str(a), str(b)])
    assert ids == [1, 12, 24, 29, 35, 47, 57, 58]
    assert [d.family for d in drafts] == ["eagle3", "dflash"]
    assert drafts[1].sha256 == read_draft_config(b).sha256 and len(drafts[1].sha256 or "") == 64
    assert capture_request([1, 2], None) == ([1, 2], [])
    assert capture_request(None, None) == (None, [])  # the default rule, unchanged
    with pytest.raises(ConfigError, match="not both"):
        capture_request([1, 2], str(a))


# --------------------------------------------------------------------------- exports


def test_dflash_export_writes_the_draft_configs_layers_in_its_order(tmp_path: Path) -> None:
    store = make_store(tmp_path / "store", n=5, layers=(1, 2, 3, 5))
    draft = write_config(tmp_path / "draft.json", dflash_config([5, 1, 3]))
    out = tmp_path / "dflash"
    summary = export([store], out, "dflash", settings={"draft_config": str(draft)})
    # s0 (3 tokens, mask [0, 0, 1]) has no two consecutive loss tokens: SpecForge would raise.
    assert summary["counts"]["skipped_no_consecutive_loss"] == 1
    assert summary["samples"] == 4
    assert summary["files"]["layer_ids"] == [5, 1, 3]
    assert summary["converted"]["layer_ids"]["how"].startswith("selected")
    assert summary["draft_config"]["output_ids"] == [5, 1, 3]
    columns = [3, 0, 2]  # positions of layers 5, 1, 3 in the store's (1, 2, 3, 5)
    for row in rows_of(out):
        f = torch.load(out / row["file"], weights_only=True)
        assert set(f) == {"input_ids", "loss_mask", "hidden_states"}
        have = HiddenStore(store)[row["id"]]
        length = have["input_ids"].shape[0]
        assert f["input_ids"].dtype == torch.int64 and f["loss_mask"].dtype == torch.int64
        assert torch.equal(f["input_ids"], have["input_ids"].long())
        assert torch.equal(f["loss_mask"], have["loss_mask"].long())
        assert f["hidden_states"].shape == (1, length, 3 * HIDDEN)
        for k, col in enumerate(columns):
            got = f["hidden_states"][0, :, k * HIDDEN : (k + 1) * HIDDEN]
            assert torch.equal(got, have["aux_hidden_state"][:, col * HIDDEN : (col + 1) * HIDDEN])
    card = (out / "README.md").read_text()
    assert "[5, 1, 3]" in card and "left out" in card
    assert summary["bytes_per_token"] > 3 * HIDDEN * 4  # float32 states, plus ids and mask


def test_a_layer_the_store_lacks_or_an_eagle3_config_is_refused_before_writing(
    tmp_path: Path,
) -> None:
    store = make_store(tmp_path / "store", layers=(1, 2, 3, 5))
    draft = write_config(tmp_path / "draft.json", dflash_config([1, 4]))
    with pytest.raises(ConfigError, match=r"layers \[4\].*extract.draft_config"):
        export([store], tmp_path / "no", "dflash", settings={"draft_config": str(draft)})
    eagle = write_config(tmp_path / "eagle.json", {"eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [2, 3, 4]}})  # fmt: skip
    with pytest.raises(ConfigError, match="EAGLE-3 config"):
        export([store], tmp_path / "no", "dspark", settings={"draft_config": str(eagle)})
    assert not (tmp_path / "no").exists()


def test_dspark_adds_the_post_norm_last_hidden_state(tmp_path: Path) -> None:
    store = make_store(tmp_path / "store", final_state="pre_norm", layers=(1, 3, 4))
    out = tmp_path / "dspark"
    summary = export([store], out, "dspark", settings={"layer_ids": [1, 4]})
    assert summary["files"]["final_state"] == "post_norm"
    assert summary["converted"]["final_state"]["from"] == "pre_norm"
    manifest = HiddenStore(store).manifest
    for row in rows_of(out):
        f = torch.load(out / row["file"], weights_only=True)
        assert set(f) == {"input_ids", "loss_mask", "hidden_states", "target_last_hidden_states"}
        have = HiddenStore(store)[row["id"]]
        want = rms_norm(have["hidden_state"], manifest["final_norm"]).to(have["hidden_state"].dtype)
        assert torch.equal(f["target_last_hidden_states"][0], want)
        assert torch.equal(f["hidden_states"][0, :, :HIDDEN], have["aux_hidden_state"][:, :HIDDEN])
        tail = have["aux_hidden_state"][:, 2 * HIDDEN :]
        assert torch.equal(f["hidden_states"][0, :, HIDDEN:], tail)


def test_modelopt_takes_a_dflash_config_as_its_aux_states(tmp_path: Path) -> None:
    """ModelOpt's DFlash reads `aux_hidden_states` of its offline .pt files as the target
    hidden (`DFlashBaseModelOutput.from_offline_dict`)."""
    store = make_store(tmp_path / "store", layers=(1, 2, 3, 5))
    draft = write_config(tmp_path / "draft.json", dflash_config([2, 5]))
    out = tmp_path / "mo"
    summary = export([store], out, "modelopt", settings={"draft_config": str(draft)})
    assert summary["files"]["layer_ids"] == [2, 5]
    for row in rows_of(out):
        f = torch.load(out / row["file"], weights_only=True)
        have = HiddenStore(store)[row["id"]]
        aux = have["aux_hidden_state"]
        assert torch.equal(f["aux_hidden_states"][:, :HIDDEN], aux[:, HIDDEN : 2 * HIDDEN])
        assert torch.equal(f["aux_hidden_states"][:, HIDDEN:], aux[:, 3 * HIDDEN :])


def test_defaults_are_unchanged_every_store_layer_as_stored(tmp_path: Path) -> None:
    store = make_store(tmp_path / "store", layers=(1, 3, 4))
    summary = export([store], tmp_path / "sf", "specforge")
    assert summary["files"]["layer_ids"] == [1, 3, 4]
    assert "layer_ids" not in summary["converted"]
    assert "layer_selection" not in summary["conventions"]


def test_consecutive_loss_rule() -> None:
    assert not has_consecutive_loss(torch.tensor([0, 1, 0, 1]))
    assert has_consecutive_loss(torch.tensor([0, 1, 1]))
    assert not has_consecutive_loss(torch.tensor([1]))


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Records -> extract with two drafter configs (the union) -> dflash and dspark exports."""
    root = tmp_path_factory.mktemp("drafters")
    model = make_tiny_model(root / "model")
    write_jsonl(root / "records.jsonl", random_records(6))
    eagle = write_config(root / "eagle.json", {"eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}})  # fmt: skip
    dflash = write_config(root / "dflash.json", dflash_config([1, 2, 5]))
    cfg = extract_cfg(
        [
            f"extract.run_dir={root}",
            f"extract.model_path={model}",
            f"extract.draft_config=[{eagle},{dflash}]",
            "extract.store_dtype=float32",
            "extract.shard_samples=4",
        ]
    )
    run_extract(cfg)
    store = root / "hidden_hf"
    for fmt in ("dflash", "dspark"):
        export([store], root / fmt, fmt, settings={"draft_config": str(dflash)})
    return {"root": root, "model": model, "store": store, "dflash": dflash}


def test_extract_captures_the_layers_the_drafter_configs_name(tiny_run: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    store = HiddenStore(tiny_run["store"])
    m = store.manifest
    # EAGLE-3 [2, 4, 5] (SGLang: input of layer) = outputs of [1, 3, 4]; DFlash [1, 2, 5].
    assert m["layer_ids"] == [1, 2, 3, 4, 5]
    assert [d["family"] for d in m["draft_configs"]] == ["eagle3", "dflash"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_run["model"]))
    for sid in store.ids[:3]:
        sample = store[sid]
        seen = hooked_states(model, sample["input_ids"].tolist(), [1, 2, 3, 4, 5])
        for k, layer in enumerate([1, 2, 3, 4, 5]):
            got = sample["aux_hidden_state"][:, k * TINY_HIDDEN : (k + 1) * TINY_HIDDEN]
            torch.testing.assert_close(got, seen[f"layer{layer}"][0], rtol=1e-5, atol=1e-5)


def test_specforge_offline_reader_loads_every_sample(tiny_run: dict[str, Path]) -> None:
    python = os.environ.get("KIMI_PIPE_SPECFORGE_PYTHON")
    if not python:
        pytest.skip(
            "SpecForge's own reader not run: set KIMI_PIPE_SPECFORGE_PYTHON to a venv python "
            "holding SpecForge at a current commit (pip install --no-deps; docs/export.md)"
        )
    store = HiddenStore(tiny_run["store"])
    manifest = store.manifest
    for fmt in ("dflash", "dspark"):
        out = tiny_run["root"] / fmt
        result_path = out.parent / f"{fmt}_specforge_result.json"
        tensors_path = out.parent / f"{fmt}_specforge_loaded.pt"
        subprocess.run(
            [python, "-m", "tools.specforge_offline_check", "--export", str(out),
             "--strategy", fmt, "--draft-config", str(tiny_run["dflash"]),
             "--out", str(result_path), "--tensors", str(tensors_path)],
            cwd=REPO, check=True, timeout=600,
        )  # fmt: skip
        result = json.loads(result_path.read_text())
        rows = rows_of(out)
        assert result["reader_refs"] == result["loaded_batches"] == len(rows) > 0
        assert result["capture_layers_from_draft_config"] == [1, 2, 5]
        loaded = torch.load(tensors_path, weights_only=True)
        for row in rows:
            got, have = loaded[row["file"]], store[row["id"]]
            assert torch.equal(got["input_ids"][0], have["input_ids"].long())
            assert torch.equal(got["loss_mask"][0], have["loss_mask"].long())
            for k, col in enumerate([0, 1, 4]):  # layers 1, 2, 5 of the store's 1..5
                part = got["hidden_states"][0, :, k * TINY_HIDDEN : (k + 1) * TINY_HIDDEN]
                want = have["aux_hidden_state"][:, col * TINY_HIDDEN : (col + 1) * TINY_HIDDEN]
                assert torch.equal(part, want)
            if fmt == "dspark":
                final = rms_norm(have["hidden_state"], manifest["final_norm"])
                got_final = got["target_last_hidden_states"][0]
                assert torch.equal(got_final, final.to(have["hidden_state"].dtype))


def kimi_shaped_store(path: Path, layers: list[int], n: int = 3) -> Path:
    """A store shaped like Kimi K2.5's (61 layers), small states: the layer bookkeeping only."""
    from kimi_pipe.store.hidden_store import StoreWriter, make_manifest

    manifest = make_manifest(
        model="kimi-shaped", num_layers=61, layer_ids=layers, layer_convention="output_of_layer",
        final_state="post_norm", hidden_size=HIDDEN, dtype="float32", loss_mask="test",
        source_runs=[str(path.parent)], backend="test",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    with StoreWriter(path, manifest, shard_samples=4) as w:
        for i in range(n):
            length = 6 + i
            aux = torch.randn(length, len(layers) * HIDDEN, generator=gen)
            w.add(f"k{i}", list(range(length)), [0, 0] + [1] * (length - 2), aux,
                  torch.randn(length, HIDDEN, generator=gen))  # fmt: skip
    return path


def test_one_kimi_store_serves_specforges_eagle3_and_dflash_configs(tmp_path: Path) -> None:
    eagle = write_config(tmp_path / "kimi-k25-eagle3.json", KIMI_K25_EAGLE3)
    dflash = write_config(tmp_path / "kimi-k2.7-code-dflash.json", KIMI_K27_DFLASH)
    ids, _ = capture_request(None, [str(eagle), str(dflash)])
    store = kimi_shaped_store(tmp_path / "store", ids)
    # The union store cannot go to SpecForge's EAGLE-3 as it is (it takes three layers).
    with pytest.raises(ConfigError, match="exactly three aux layers"):
        export([store], tmp_path / "no", "specforge")
    sf = export([store], tmp_path / "sf", "specforge", settings={"draft_config": str(eagle)})
    assert sf["files"]["layer_ids"] == [1, 29, 57]
    assert sf["conventions"]["drafter_config_ids"]["sglang"] == [2, 30, 58]
    cfg = (tmp_path / "sf" / "specforge_train.yaml").read_text()
    assert "aux_hidden_state_layer_ids:\n  - 1\n  - 29\n  - 57" in cfg
    df = export([store], tmp_path / "df", "dflash", settings={"draft_config": str(dflash)})
    assert df["files"]["layer_ids"] == [1, 12, 24, 35, 47, 58]
    have = HiddenStore(store)
    for row in rows_of(tmp_path / "df"):
        f = torch.load(tmp_path / "df" / row["file"], weights_only=True)
        aux = have[row["id"]]["aux_hidden_state"]
        for k, layer in enumerate([1, 12, 24, 35, 47, 58]):
            col = ids.index(layer)
            got = f["hidden_states"][0, :, k * HIDDEN : (k + 1) * HIDDEN]
            assert torch.equal(got, aux[:, col * HIDDEN : (col + 1) * HIDDEN])
