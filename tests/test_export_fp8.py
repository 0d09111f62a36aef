"""The compact (fp8) store, the exports' own descriptions, SpecForge gzip and speculators fp8.

Every export must describe the files it wrote (`files`), apart from the store it came from
(`source_manifest`) and what it changed (`converted`); these tests read the files back and hold
the description against the tensors, for every format.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kimi_pipe.config import compose
from kimi_pipe.exporters import (
    FORMATS,
    export,
    modelopt_path,
    run_export,
    specforge_path,
    speculators_path,
)
from kimi_pipe.stages.jobs.export import export_job
from kimi_pipe.store.conventions import final_norm_spec
from kimi_pipe.store.hidden_store import (
    FP8_MAX,
    HiddenStore,
    StoreWriter,
    dequantize_rows,
    make_manifest,
    quantize_rows,
)

HIDDEN = 32
LAYERS = (1, 3, 4)
# One row scale per layer state: the three aux layers differ by 100x, as real ones do.
AUX_SCALE = torch.tensor([1.0] * HIDDEN + [10.0] * HIDDEN + [100.0] * HIDDEN)


def states(n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(length, len(LAYERS) * HIDDEN, generator=gen) * AUX_SCALE
    final = torch.randn(length, HIDDEN, generator=gen) * 20
    return aux, final


def make_store(
    path: Path, dtype: str, *, final_dtype: str | None = None, n: int = 4, norm: bool = True
) -> Path:
    gen = torch.Generator().manual_seed(99)
    extra = {"final_norm": final_norm_spec(torch.rand(HIDDEN, generator=gen) + 0.5, 1e-5, "norm")}
    manifest = make_manifest(
        model="m",
        num_layers=8,
        layer_ids=list(LAYERS),
        final_state="pre_norm",
        hidden_size=HIDDEN,
        dtype=dtype,
        final_dtype=final_dtype,
        loss_mask="test",
        source_runs=[str(path.parent)],
        backend="test",
        extra=extra if norm else None,
    )
    with StoreWriter(path, manifest, shard_samples=3) as w:
        for i in range(n):
            length = 5 + i
            aux, final = states(n, length, i)
            w.add(f"s{i}", list(range(length)), [0, 0] + [1] * (length - 2), aux, final)
    return path


def shard_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in (store / "shards").glob("*.safetensors"))


# --------------------------------------------------------------------------- the fp8 store


def test_quantize_rows_keeps_every_row_within_fp8_rounding() -> None:
    aux, _ = states(1, 64, 0)
    q, scale = quantize_rows(aux, len(LAYERS))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, len(LAYERS))
    # The largest value of each row lands on 448 exactly: the scale is amax / 448.
    rows = aux.reshape(64, len(LAYERS), HIDDEN)
    assert torch.allclose(scale, rows.abs().amax(-1) / FP8_MAX)
    back = dequantize_rows(q, scale, torch.float32).reshape(64, len(LAYERS), HIDDEN)
    # e4m3: 3 mantissa bits (relative step 2^-3, rounding 2^-4); below 2^-6 x scale the
    # subnormal step is 2^-9 x scale.
    bound = rows.abs() * 2**-4 + scale.unsqueeze(-1) * 2**-9
    assert ((back - rows).abs() <= bound * (1 + 1e-6)).all()
    # Per-row scales: the small layer is as exact as the large one (not drowned by it).
    rel = (back - rows).norm(dim=-1) / rows.norm(dim=-1)
    assert float(rel.max()) < 0.05
    assert float(rel[:, 0].mean()) == pytest.approx(float(rel[:, 2].mean()), rel=0.3)


def test_fp8_store_is_half_the_bytes_records_itself_and_reads_back(tmp_path: Path) -> None:
    bf16 = make_store(tmp_path / "bf16", "bfloat16")
    fp8 = make_store(tmp_path / "fp8", "fp8_e4m3")
    mixed = make_store(tmp_path / "mixed", "fp8_e4m3", final_dtype="bfloat16")
    m = HiddenStore(fp8).manifest
    assert m["dtype"] == "bfloat16"  # what readers get
    assert m["store_dtype"] == {"aux_hidden_state": "fp8_e4m3", "hidden_state": "fp8_e4m3"}
    assert "per_row" in m["scale_layout"]
    assert "store_dtype" not in HiddenStore(bf16).manifest
    assert HiddenStore(mixed).manifest["store_dtype"]["hidden_state"] == "bfloat16"
    # States at 1 byte + 4 bytes of scale per row of H values, ids and mask as before.
    tokens = HiddenStore(bf16).total_tokens()
    per_token = {
        p.name: sum(
            t.numel() * t.element_size()
            for sid in HiddenStore(p).ids
            for t in HiddenStore(p).raw(sid).values()
        )
        / tokens
        for p in (bf16, fp8, mixed)
    }
    rows = len(LAYERS) + 1
    assert per_token["bf16"] == rows * HIDDEN * 2 + 16
    assert per_token["fp8"] == rows * (HIDDEN + 4) + 16
    assert per_token["mixed"] == len(LAYERS) * (HIDDEN + 4) + HIDDEN * 2 + 16
    assert shard_bytes(fp8) < shard_bytes(mixed) < shard_bytes(bf16)
    raw = HiddenStore(fp8).raw("s2")
    assert raw["aux_hidden_state"].dtype == torch.float8_e4m3fn
    assert raw["aux_hidden_state_scale"].shape == (7, 3)
    assert raw["hidden_state_scale"].shape == (7, 1)
    for sid in HiddenStore(fp8).ids:
        exact = HiddenStore(bf16)[sid]
        got = HiddenStore(fp8)[sid]
        assert got["aux_hidden_state"].dtype == torch.bfloat16
        assert torch.equal(got["input_ids"], exact["input_ids"])
        for key in ("aux_hidden_state", "hidden_state"):
            a, b = got[key].float(), exact[key].float()
            cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
            assert float(cos.min()) > 0.998
    with pytest.raises(ValueError, match="different settings"):
        StoreWriter(fp8, HiddenStore(bf16).manifest)  # one store never mixes two layouts


def test_fp8_and_bf16_stores_are_not_mixed_in_one_export(tmp_path: Path) -> None:
    a = make_store(tmp_path / "a", "bfloat16")
    b = make_store(tmp_path / "b", "fp8_e4m3")
    with pytest.raises(ValueError, match="cannot be mixed.*store_dtype"):
        export([a, b], tmp_path / "out", "specforge")


# --------------------------------------------------------------------------- self-description


def read_files(out: Path, fmt: str, summary: dict) -> list[dict[str, torch.Tensor]]:
    """Every exported sample's tensors, read back as the trainer would find them."""
    samples = []
    for row in (out / "export_index.jsonl").read_text().splitlines():
        i = json.loads(row)["index"]
        if fmt == "specforge":
            f = summary["files"]
            path = specforge_path(out, i, compress=bool(f["compression"]))
            if f["compression"]:
                with gzip.open(path, "rb") as gz:
                    data = torch.load(io.BytesIO(gz.read()), weights_only=True)
            else:
                data = torch.load(path, weights_only=True)
            samples.append({**data, "final": data["hidden_state"][0]})
        elif fmt == "modelopt":
            data = torch.load(modelopt_path(out, i), weights_only=True)
            samples.append({**data, "final": data["hidden_states"]})
        elif fmt == "speculators":
            data = load_file(str(speculators_path(out, i)))
            states = data["hidden_states"].float()
            if "hidden_states_scales" in data:
                states = states * data["hidden_states_scales"]
            samples.append({**data, "final": states[:, -1]})
        elif fmt in ("dflash", "dspark"):  # SpecForge's DFlash family: no final state; DSpark's
            data = torch.load(specforge_path(out, i), weights_only=True)
            last = data.get("target_last_hidden_states")
            samples.append(data if last is None else {**data, "final": last[0]})
    return samples


# Every format with its defaults, plus the settings that change the files' own layout.
EXPORT_VARIANTS = [
    *((fmt, {}) for fmt in FORMATS),
    ("specforge", {"compress": True}),
    ("speculators", {"dtype": "fp8_e4m3"}),
]
# Store layouts: (aux dtype, final dtype).
STORE_VARIANTS = [("bfloat16", None), ("fp8_e4m3", None), ("fp8_e4m3", "bfloat16")]


@pytest.mark.parametrize(("store_dtype", "final_dtype"), STORE_VARIANTS)
@pytest.mark.parametrize(("fmt", "settings"), EXPORT_VARIANTS)
def test_every_export_describes_its_own_files(
    tmp_path: Path, fmt: str, settings: dict, store_dtype: str, final_dtype: str | None
) -> None:
    store = make_store(tmp_path / "store", store_dtype, final_dtype=final_dtype)
    out = tmp_path / "out"
    summary = export([store], out, fmt, settings=settings)
    on_disk = json.loads((out / "export_summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert "manifest" not in on_disk  # the store's description is only `source_manifest`
    files, source, converted = on_disk["files"], on_disk["source_manifest"], on_disk["converted"]
    assert source["final_state"] == "pre_norm" and source["dtype"] == "bfloat16"
    card = (out / "README.md").read_text()
    held = card.split("## What these files hold")[1].split("## Hidden states")[0]
    assert f"| final_state | {files['final_state'] or '-'} |" in held
    if fmt == "tokens":
        assert files["final_state"] is None and converted == {}
        rows = (out / "tokens.jsonl").read_text().splitlines()
        assert len(rows) == 4
        return
    manifest = HiddenStore(store).manifest
    samples = read_files(out, fmt, on_disk)
    assert len(samples) == 4
    weight = torch.tensor(manifest["final_norm"]["weight"])
    for data in samples:
        if "final" not in data:
            assert files["final_state"] is None and fmt == "dflash"
        elif files["final_state"] == "post_norm":
            final = data["final"].float()
            assert float((final / weight).pow(2).mean(-1).sqrt().mean()) == pytest.approx(
                1.0, abs=0.02
            )
        else:
            final = data["final"].float()
            post_norm_rms = float((final / weight).pow(2).mean(-1).sqrt().mean())
            assert files["final_state"] == "pre_norm" and post_norm_rms > 5  # as stored, x20
        # dtype: every state tensor is what the description says.
        for name, (shape, dtype) in files["tensors"].items():
            tensor = data[name]
            assert str(tensor.dtype).removeprefix("torch.") == dtype, name
            dims = [d.strip() for d in shape.split(",")]
            assert len(dims) == tensor.dim(), name
            for size, dim in zip(tensor.shape, dims, strict=True):
                assert dim == "L" or int(dim) == size, name
        for flag, value in files.get("flags", {}).items():
            assert data[flag] is value
    assert ("final_state" in converted) == (files["final_state"] == "post_norm")
    if "final_state" in converted:
        assert converted["final_state"]["from"] == "pre_norm"
        assert converted["final_state"]["to"] == "post_norm"
    fp8_files = settings.get("dtype") == "fp8_e4m3"
    assert ("dtype" in converted) == (store_dtype == "fp8_e4m3" or fp8_files)
    assert files["dtype"] == ("float8_e4m3fn" if fp8_files else "bfloat16")
    assert (files["scale_layout"] is not None) == fp8_files
    suffixes = {p.name.split(".", 1)[1] for p in out.rglob("data_*")}
    if fmt == "specforge":
        assert files["compression"] == ("gzip" if settings.get("compress") else None)
        assert suffixes == {"ckpt.gz" if settings.get("compress") else "ckpt"}
    assert ("layer_ids" in converted) == (fmt == "speculators")  # input-of-layer naming
    if fmt == "speculators":
        assert files["layer_ids"] == [i + 1 for i in LAYERS]
    else:
        assert files["layer_ids"] == list(LAYERS)
    for key in converted:
        assert f"- {key}:" in held


def test_specforge_gzip_files_hold_the_same_tensors(tmp_path: Path) -> None:
    store = make_store(tmp_path / "store", "bfloat16")
    plain = export([store], tmp_path / "plain", "specforge")
    packed = export([store], tmp_path / "gz", "specforge", settings={"compress": True})
    assert packed["files"]["compression"] == "gzip"
    assert plain["files"]["compression"] is None
    a = read_files(tmp_path / "plain", "specforge", plain)
    b = read_files(tmp_path / "gz", "specforge", packed)
    for x, y in zip(a, b, strict=True):
        for key in ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state"):
            assert torch.equal(x[key], y[key])
    assert list((tmp_path / "gz").rglob("*.ckpt")) == []
    assert "`.ckpt.gz`" in (tmp_path / "gz" / "README.md").read_text()
    with pytest.raises(ValueError, match="another export"):  # same dir, other file layout
        export([store], tmp_path / "gz", "specforge")


def test_speculators_fp8_export_is_hs_connectors_layout(tmp_path: Path) -> None:
    store = make_store(tmp_path / "store", "bfloat16")
    bf16 = export([store], tmp_path / "bf16", "speculators")
    fp8 = export([store], tmp_path / "fp8", "speculators", settings={"dtype": "fp8_e4m3"})
    assert fp8["files"]["dtype"] == "float8_e4m3fn" and "per_token" in fp8["files"]["scale_layout"]
    assert fp8["converted"]["dtype"]["to"]["dtype"] == "float8_e4m3fn"
    assert "--hidden-states-backend fp8" in (tmp_path / "fp8" / "README.md").read_text()
    assert "--hidden-states-backend" not in (tmp_path / "bf16" / "README.md").read_text()
    for i in range(4):
        raw = load_file(str(speculators_path(tmp_path / "fp8", i)))
        ref = load_file(str(speculators_path(tmp_path / "bf16", i)))["hidden_states"].float()
        assert raw["hidden_states"].dtype == torch.float8_e4m3fn
        assert raw["hidden_states_scales"].shape == (ref.shape[0], 1, 1)
        back = raw["hidden_states"].float() * raw["hidden_states_scales"]
        # One scale per token over its 4 states: the small layer keeps less precision.
        assert torch.allclose(raw["hidden_states_scales"][:, 0, 0], ref.abs().amax((1, 2)) / 448)
        assert float((back - ref).abs().max()) <= float(ref.abs().max()) * 2**-4 + 1e-6
    assert bf16["files"]["scale_layout"] is None
    store_fp8 = make_store(tmp_path / "store8", "fp8_e4m3")
    with pytest.raises(ValueError, match="export.dtype"):
        export([store_fp8], tmp_path / "bad", "speculators", settings={"dtype": "int4"})


def test_post_norm_from_an_fp8_store_matches_the_bf16_one(tmp_path: Path) -> None:
    """The export's post-norm state from fp8 pre-norm rows stays close to the bf16 one."""
    a = export([make_store(tmp_path / "a", "bfloat16")], tmp_path / "ea", "modelopt")
    b = export([make_store(tmp_path / "b", "fp8_e4m3")], tmp_path / "eb", "modelopt")
    pairs = zip(
        read_files(tmp_path / "ea", "modelopt", a),
        read_files(tmp_path / "eb", "modelopt", b),
        strict=True,
    )
    for x, y in pairs:
        cos = torch.nn.functional.cosine_similarity(x["final"].float(), y["final"].float(), dim=-1)
        assert float(cos.min()) > 0.998


# --------------------------------------------------------------------------- the config group


def test_export_group_and_format_alias(tmp_path: Path) -> None:
    store = make_store(tmp_path / "store", "bfloat16")
    cfg = compose(["export=speculators", "export.dtype=fp8_e4m3", f"output={tmp_path / 'a'}"])
    assert cfg.format == "speculators"  # format follows the group choice
    cfg.stores = [str(store)]
    summary = run_export(export_job(cfg))
    assert summary["files"]["dtype"] == "float8_e4m3fn"
    cfg = compose(["format=tokens", f"output={tmp_path / 'b'}"])
    cfg.stores = [str(store)]
    assert run_export(export_job(cfg))["format"] == "tokens"
    cfg = compose(["export=specforge", "export.compress=true", f"output={tmp_path / 'c'}"])
    cfg.stores = [str(store)]
    assert run_export(export_job(cfg))["files"]["compression"] == "gzip"
    with pytest.raises(ValueError, match="not supported"):
        cfg = compose(["format=nosuch", f"output={tmp_path / 'd'}"])
        cfg.stores = [str(store)]
        run_export(export_job(cfg))
