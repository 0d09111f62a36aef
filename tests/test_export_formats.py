"""Every trainer format: conventions converted or refused, files laid out as each trainer reads.

Fast: synthetic stores through the writer API and a tiny random Llama; no trainer installed.
The trainers' own loaders run in `make interop` (tools/interop.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from kimi_pipe.exporters import (
    INDEX_FILE,
    SPECFORGE_CONFIG,
    TOKENS_FILE,
    export,
    modelopt_path,
    specforge_path,
    specforge_weight_keys,
    speculators_path,
)
from kimi_pipe.extraction.hf_backend import HFBackend
from kimi_pipe.extraction.layers import (
    drafter_config_ids,
    engine_capture_ids,
    manifest_output_ids,
    sglang_config_to_capture_ids,
    vllm_config_to_capture_ids,
)
from kimi_pipe.store.conventions import ConventionError, final_norm_spec, rms_norm
from kimi_pipe.store.hidden_store import StoreWriter, make_manifest
from tests.test_extract_hf import TINY_HIDDEN, TINY_LAYERS, hooked_states, make_tiny_model

HIDDEN = 4


def make_store(
    path: Path,
    n: int = 5,
    *,
    final_state: str = "post_norm",
    norm: bool = True,
    convention: str = "output_of_layer",
    layers: tuple[int, ...] = (1, 3, 4),
    model_path: str | None = None,
) -> Path:
    """A store with random states; a pre_norm store records a random RMSNorm when `norm`."""
    gen = torch.Generator().manual_seed(n)
    extra: dict = {}
    if final_state == "pre_norm" and norm:
        extra["final_norm"] = final_norm_spec(torch.rand(HIDDEN, generator=gen) + 0.5, 1e-5, "norm")
    if model_path:
        extra["model_path"] = model_path
    manifest = make_manifest(
        model="m",
        num_layers=8,
        layer_ids=list(layers),
        layer_convention=convention,
        final_state=final_state,
        hidden_size=HIDDEN,
        dtype="float32",
        loss_mask="test",
        source_runs=[str(path.parent)],
        backend="test",
        extra=extra,
    )
    with StoreWriter(path, manifest, shard_samples=2) as w:
        for i in range(n):
            length = 3 + i
            w.add(
                f"s{i}",
                list(range(10 + i, 10 + i + length)),
                [0] * 2 + [1] * (length - 2),
                torch.randn(length, len(layers) * HIDDEN, generator=gen),
                torch.randn(length, HIDDEN, generator=gen) * 3,
            )
    return path


def index_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / INDEX_FILE).read_text().splitlines()]


def stored(store: Path, sid: str) -> dict[str, torch.Tensor]:
    from kimi_pipe.store.hidden_store import HiddenStore

    return HiddenStore(store)[sid]


# --------------------------------------------------------------------------- layer rules


def test_engine_rules_for_drafter_config_ids() -> None:
    kimi = [1, 29, 57]
    # SGLang adds 1 only when the first id is 1; vLLM takes the ids as given.
    assert sglang_config_to_capture_ids(kimi) == [2, 30, 58]
    assert sglang_config_to_capture_ids([2, 30, 58]) == [2, 30, 58]
    assert vllm_config_to_capture_ids(kimi) == [1, 29, 57]  # off by one for these states
    for engine in ("sglang", "vllm"):
        named = drafter_config_ids(kimi, engine)
        assert named == [2, 30, 58]
        assert engine_capture_ids(named, engine) == [i + 1 for i in kimi]
    with pytest.raises(ValueError, match="output of layer 0"):
        drafter_config_ids([0, 14, 26], "sglang")
    assert drafter_config_ids([0, 14, 26], "vllm") == [1, 15, 27]


def test_manifest_ids_are_converted_to_output_of_layer() -> None:
    base = {"layer_ids": [2, 15, 27]}
    assert manifest_output_ids({**base, "layer_convention": "input_of_layer"}) == [1, 14, 26]
    assert manifest_output_ids({**base, "layer_convention": "output_of_layer"}) == [2, 15, 27]
    with pytest.raises(ValueError, match="embeddings"):
        manifest_output_ids({"layer_ids": [0, 4], "layer_convention": "input_of_layer"})
    with pytest.raises(ValueError, match="unknown layer_convention"):
        manifest_output_ids({**base, "layer_convention": None})


# --------------------------------------------------------------------------- pre-norm capture


def test_pre_norm_capture_records_a_norm_that_gives_the_post_norm_state(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():  # a norm weight of ones would hide a missing weight
        model.model.norm.weight.copy_(torch.rand(TINY_HIDDEN) + 0.5)
    model.save_pretrained(model_dir)
    pre_backend = HFBackend(model_dir, final_state="pre_norm")
    post_backend = HFBackend(model_dir, final_state="post_norm")
    ids = [5, 17, 42, 7, 99, 3, 250, 11]
    [(aux_pre, pre)] = pre_backend.forward([ids])
    [(aux_post, post)] = post_backend.forward([ids])
    torch.testing.assert_close(aux_pre, aux_post)
    last = hooked_states(pre_backend.model, ids, [TINY_LAYERS - 1])[f"layer{TINY_LAYERS - 1}"][0]
    assert torch.equal(pre, last)  # the last layer's output, before the norm
    spec = pre_backend.store_fields["extra"]["final_norm"]
    assert pre_backend.store_fields["final_state"] == "pre_norm"
    assert spec["weight"] == model.model.norm.weight.tolist()
    # Same float32 arithmetic as transformers' RMSNorm: bit-identical.
    assert torch.equal(rms_norm(pre, spec), post)


# --------------------------------------------------------------------------- conversions


def test_specforge_and_modelopt_get_post_norm_computed_from_a_pre_norm_store(
    tmp_path: Path,
) -> None:
    store = make_store(tmp_path / "run" / "store", final_state="pre_norm")
    from kimi_pipe.store.hidden_store import HiddenStore

    spec = HiddenStore(store).manifest["final_norm"]
    for fmt, path_of, key in (
        ("specforge", specforge_path, "hidden_state"),
        ("modelopt", modelopt_path, "hidden_states"),
    ):
        out = tmp_path / fmt
        summary = export([store], out, fmt, seed=0)
        assert summary["conventions"]["final_state_conversion"] == "apply_norm"
        for row in index_rows(out):
            data = torch.load(path_of(out, row["index"]), weights_only=fmt == "modelopt")
            pre = stored(store, row["id"])["hidden_state"]
            got = data[key].reshape(pre.shape)
            assert torch.equal(got, rms_norm(pre, spec))
            assert not torch.allclose(got, pre)  # the old exporter wrote the pre-norm state
        assert "computed at export" in (out / "README.md").read_text()


def test_speculators_gets_the_pre_norm_state_as_stored(tmp_path: Path) -> None:
    from datasets import load_from_disk
    from safetensors.torch import load_file

    store = make_store(tmp_path / "run" / "store", final_state="pre_norm", layers=(2, 4, 5),
                       convention="input_of_layer")  # fmt: skip
    out = tmp_path / "spec"
    summary = export([store], out, "speculators", seed=3)
    rows = load_from_disk(str(out))
    index = index_rows(out)
    assert len(rows) == len(index) == 5
    for i, entry in enumerate(index):
        assert entry["index"] == i
        s = stored(store, entry["id"])
        f = load_file(str(speculators_path(out, i)))
        length = s["input_ids"].numel()
        assert f["hidden_states"].shape == (length, 4, HIDDEN)
        assert torch.equal(f["hidden_states"][:, :3].flatten(1), s["aux_hidden_state"])
        assert torch.equal(f["hidden_states"][:, 3], s["hidden_state"])  # pre-norm, untouched
        assert torch.equal(f["token_ids"], s["input_ids"])
        assert torch.equal(rows[i]["input_ids"], s["input_ids"])  # torch format, as its loader
        assert rows[i]["loss_mask"].tolist() == s["loss_mask"].tolist()
        assert int(rows[i]["seq_len"]) == length
    # Stored as input-of-layer [2, 4, 5]: speculators' --target-layer-ids are those ids.
    assert summary["conventions"]["output_layer_ids"] == [1, 3, 4]
    assert "--target-layer-ids 2 4 5" in (out / "README.md").read_text()


def test_impossible_conventions_are_refused_before_writing(tmp_path: Path) -> None:
    post = make_store(tmp_path / "a" / "store")
    bare_pre = make_store(tmp_path / "b" / "store", final_state="pre_norm", norm=False)
    with pytest.raises(ConventionError, match="cannot be undone"):
        export([post], tmp_path / "o1", "speculators")
    for fmt in ("specforge", "modelopt"):
        with pytest.raises(ConventionError, match="final norm"):
            export([bare_pre], tmp_path / f"o-{fmt}", fmt)
        assert not (tmp_path / f"o-{fmt}").exists()
    assert not (tmp_path / "o1").exists()
    # Tokens carry no states: any store serves them.
    export([bare_pre], tmp_path / "tok", "tokens")


# --------------------------------------------------------------------------- layouts


def test_modelopt_files_load_with_weights_only(tmp_path: Path) -> None:
    store = make_store(tmp_path / "run" / "store")
    out = tmp_path / "mo"
    export([store], out, "modelopt", seed=1)
    for row in index_rows(out):
        data = torch.load(modelopt_path(out, row["index"]), weights_only=True)
        s = stored(store, row["id"])
        assert set(data) == {
            "input_ids",
            "hidden_states",
            "aux_hidden_states",
            "loss_mask",
            "hidden_states_prenorm",
        }
        assert data["hidden_states_prenorm"] is False
        assert torch.equal(data["input_ids"], s["input_ids"])
        assert torch.equal(data["loss_mask"], s["loss_mask"])
        assert torch.equal(data["hidden_states"], s["hidden_state"])  # post-norm store: as is
        assert torch.equal(data["aux_hidden_states"], s["aux_hidden_state"])
    assert "answer_only_loss=true" in (out / "README.md").read_text()


def test_tokens_rows_equal_the_store(tmp_path: Path) -> None:
    store = make_store(tmp_path / "run" / "store")
    out = tmp_path / "tok"
    export([store], out, "tokens", seed=2)
    rows = [json.loads(line) for line in (out / TOKENS_FILE).read_text().splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in index_rows(out)]
    for r in rows:
        s = stored(store, r["id"])
        assert r["input_ids"] == s["input_ids"].tolist()
        assert r["loss_mask"] == s["loss_mask"].tolist()


# --------------------------------------------------------------------------- SpecForge config


def write_index(directory: Path, names: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return directory


def test_weight_keys_come_from_the_checkpoint_index(tmp_path: Path) -> None:
    # Kimi K2.5's naming: a multimodal wrapper around a DeepSeek-V3 language model.
    kimi = write_index(
        tmp_path / "kimi",
        [
            "language_model.lm_head.weight",
            "language_model.model.embed_tokens.weight",
            "language_model.model.norm.weight",
            "vision_tower.patch_embed.proj.weight",
            "mm_projector.proj.0.weight",
        ],
    )
    assert specforge_weight_keys(kimi) == {
        "embedding_key": "language_model.model.embed_tokens.weight",
        "lm_head_key": "language_model.lm_head.weight",
    }
    tied = write_index(tmp_path / "tied", ["model.embed_tokens.weight", "model.norm.weight"])
    assert specforge_weight_keys(tied)["lm_head_key"] == "model.embed_tokens.weight"
    with pytest.raises(FileNotFoundError, match="target_model_path"):
        specforge_weight_keys(tmp_path / "nothing")


def test_specforge_config_names_data_length_layers_and_keys(tmp_path: Path) -> None:
    kimi = write_index(
        tmp_path / "kimi",
        ["language_model.lm_head.weight", "language_model.model.embed_tokens.weight"],
    )
    store = make_store(tmp_path / "run" / "store", layers=(2, 4, 5), convention="input_of_layer")
    out = tmp_path / "sf"
    summary = export([store], out, "specforge", target_model_path=kimi)
    cfg = yaml.safe_load((out / SPECFORGE_CONFIG).read_text())
    assert cfg["data"] == {"hidden_states_path": str(out.resolve()), "max_length": 7}
    assert summary["tokens"]["max_len"] == 7
    assert cfg["model"]["target_model_path"] == str(kimi)
    assert cfg["model"]["aux_hidden_state_layer_ids"] == [1, 3, 4]  # output of layer
    assert cfg["model"]["lm_head_key"] == "language_model.lm_head.weight"
    assert cfg["model"]["embedding_key"] == "language_model.model.embed_tokens.weight"
    card = (out / "README.md").read_text()
    assert f"specforge train --config {out.resolve() / SPECFORGE_CONFIG}" in card
    assert "--train-hidden-states-path" not in card
    with pytest.raises(ValueError, match="cut it silently"):
        export([store], tmp_path / "sf2", "specforge", max_length=6)
    assert export([store], tmp_path / "sf3", "specforge", max_length=4096)["max_length"] == 4096


def test_card_names_per_engine_layer_ids(tmp_path: Path) -> None:
    store = make_store(tmp_path / "run" / "store")
    out = tmp_path / "sf"
    export([store], out, "specforge")
    card = (out / "README.md").read_text()
    # 8 layers: [1, 3, 4] is the default rule, so naming none is right in both engines.
    assert "| SGLang | [2, 4, 5] | [1, 3, 4] (SGLang adds 1 when the first id is 1); none" in card
    assert "| vLLM | [2, 4, 5] | none (its default" in card
    assert "never [1, 3, 4]: vLLM would read them off by one" in card
    custom = make_store(tmp_path / "run2" / "store", layers=(2, 3, 4))
    export([custom], tmp_path / "sf2", "specforge")
    card = (tmp_path / "sf2" / "README.md").read_text()
    assert "| SGLang | [3, 4, 5] | - |" in card  # not the default: the ids must be named
    assert "none" not in card.split("## Serve")[1].split("## Counts")[0]


def test_run_export_reads_format_model_path_and_max_length(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from kimi_pipe.exporters import run_export
    from kimi_pipe.stages.jobs.export import export_job

    tied = write_index(tmp_path / "tied", ["model.embed_tokens.weight"])
    store = make_store(tmp_path / "run" / "store", final_state="pre_norm")
    cfg = {"stores": [str(store)], "seed": 0, "target_model_path": str(tied), "max_length": 64}
    summary = run_export(
        export_job(OmegaConf.create({**cfg, "format": "specforge", "output": str(tmp_path / "a")}))
    )
    assert summary["max_length"] == 64
    assert summary["weight_keys"]["lm_head_key"] == "model.embed_tokens.weight"
    summary = run_export(
        export_job(
            OmegaConf.create({**cfg, "format": "speculators", "output": str(tmp_path / "b")})
        )
    )
    assert summary["conventions"]["final_state_conversion"] == "as_is"
    with pytest.raises(ValueError, match="another export"):  # same directory, other format
        run_export(
            export_job(
                OmegaConf.create({**cfg, "format": "modelopt", "output": str(tmp_path / "b")})
            )
        )


def test_pre_norm_is_refused_for_a_norm_export_could_not_recompute(tmp_path: Path) -> None:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    backend = HFBackend(make_tiny_model(tmp_path / "tiny"))
    assert backend._final_norm() is backend.decoder.norm  # Llama's RMSNorm: the formula holds
    gemma = GemmaRMSNorm(TINY_HIDDEN, eps=1e-6)  # x * (1 + weight): same name, other formula
    backend.decoder.norm = gemma
    with pytest.raises(ValueError, match="could not recompute"):
        backend._final_norm()
