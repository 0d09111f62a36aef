"""extract.backend=hf: a tiny random-weight Llama for the fast cases, real SmolLM2 for shapes."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from kimi_pipe.errors import ConfigError
from kimi_pipe.extraction.hf_backend import HFBackend, HFSettings
from kimi_pipe.extraction.job import ExtractJob
from kimi_pipe.extraction.token_samples import apply_max_len, load_backend, read_token_records
from kimi_pipe.stages.extract import run_extract
from kimi_pipe.stages.jobs.extract import extract_job
from kimi_pipe.store.hidden_store import SHARDS, HiddenStore

REPO = Path(__file__).resolve().parent.parent
TINY_LAYERS = 8  # default rule [1, N//2 - 1, N - 4] = [1, 3, 4]
TINY_HIDDEN = 32


# --------------------------------------------------------------------------- helpers


def make_tiny_model(directory: Path, seed: int = 0) -> Path:
    """A random-weight Llama saved like any transformers model directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=TINY_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def token_record(sid: str, prompt: Sequence[int], output: Sequence[int], ok: bool = True) -> dict:
    """A flat token record as generate/reconstruct write it (docs/design.md)."""
    return {
        "id": sid,
        "ok": ok,
        "issues": [],
        "prompt_ids": list(prompt),
        "output_ids": list(output),
        "loss_mask": [0] * len(prompt) + [1] * len(output),
        "completion_tokens_reported": len(output),
        "completion_tokens_reconstructed": len(output),
    }


def random_records(n: int, seed: int = 1, vocab: int = 256) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        plen = int(torch.randint(3, 20, (1,), generator=gen))
        olen = int(torch.randint(1, 25, (1,), generator=gen))
        ids = torch.randint(0, vocab, (plen + olen,), generator=gen).tolist()
        out.append(token_record(f"s{i:03d}", ids[:plen], ids[plen:]))
    return out


def write_jsonl(path: Path, rows: Sequence[dict | str]) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def extract_cfg(overrides: Sequence[str]) -> DictConfig:
    """The one composed config every stage uses, with test overrides."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def hooked_states(model: Any, ids: list[int], layer_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """Ground truth from forward hooks: what each decoder layer and the final norm return."""
    seen: dict[str, torch.Tensor] = {}
    base = model.base_model

    def keep(name: str):
        def hook(_module: Any, _args: Any, output: Any) -> None:
            seen[name] = (output[0] if isinstance(output, tuple) else output).detach()

        return hook

    handles = [base.layers[i].register_forward_hook(keep(f"layer{i}")) for i in layer_ids]
    handles.append(base.norm.register_forward_hook(keep("norm")))
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return seen


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Iterator[HFBackend]:
    backend = HFBackend(tiny_dir, dtype="float32", store_dtype="float32")
    yield backend
    backend.close()


# --------------------------------------------------------------------------- capture semantics


def test_default_layers_are_output_of_layer_and_final_is_post_norm(tiny: HFBackend) -> None:
    assert tiny.layer_ids == [1, TINY_LAYERS // 2 - 1, TINY_LAYERS - 4]
    ids = [5, 17, 42, 7, 99, 3, 250, 11]
    [(aux, final)] = tiny.forward([ids])
    assert aux.shape == (len(ids), 3 * TINY_HIDDEN)
    assert final.shape == (len(ids), TINY_HIDDEN)
    truth = hooked_states(tiny.model, ids, tiny.layer_ids)
    for k, layer in enumerate(tiny.layer_ids):
        block = aux[:, k * TINY_HIDDEN : (k + 1) * TINY_HIDDEN]
        torch.testing.assert_close(block, truth[f"layer{layer}"][0])
    torch.testing.assert_close(final, truth["norm"][0])
    # The final state is not the raw output of the last layer (the norm was applied).
    last = hooked_states(tiny.model, ids, [TINY_LAYERS - 1])[f"layer{TINY_LAYERS - 1}"][0]
    assert not torch.allclose(final, last)


def test_explicit_layer_ids(tiny_dir: Path) -> None:
    backend = HFBackend(tiny_dir, layer_ids=[0, 2, 6])
    ids = [1, 2, 3, 4]
    [(aux, _)] = backend.forward([ids])
    truth = hooked_states(backend.model, ids, [0, 2, 6])
    torch.testing.assert_close(aux[:, 2 * TINY_HIDDEN :], truth["layer6"][0])
    with pytest.raises(ValueError, match="out of range"):
        HFBackend(tiny_dir, layer_ids=[1, 3, TINY_LAYERS - 1])


def test_padded_batch_equals_each_sample_alone(tiny: HFBackend) -> None:
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12], [200, 201, 202, 203, 204]]
    batched = tiny.forward(seqs)
    for seq, (aux, final) in zip(seqs, batched, strict=True):
        [(aux1, final1)] = tiny.forward([seq])
        assert aux.shape[0] == len(seq)
        torch.testing.assert_close(aux, aux1, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(final, final1, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- shared stage logic


def test_read_records_reports_bad_lines_and_keeps_going(tmp_path: Path) -> None:
    good = token_record("a", [1, 2], [3])
    bad_mask = {**token_record("b", [1, 2], [3]), "loss_mask": [0, 1]}
    failed = {"id": "c", "ok": False, "error": {"class": "RateLimitError"}}
    retried = token_record("a", [1, 2], [3, 4])  # the later record of an id wins
    path = write_jsonl(tmp_path / "r.jsonl", [good, bad_mask, '{"id": "torn', failed, retried])
    samples, counts = read_token_records(path)
    assert [(s.id, s.input_ids) for s in samples] == [("a", [1, 2, 3, 4])]
    assert counts["skipped_loss_mask_length"] == 1
    assert counts["skipped_bad_json"] == 1
    assert counts["skipped_not_ok"] == 1
    assert counts["replaced_duplicate_id"] == 1
    with pytest.raises(FileNotFoundError, match="kimi_pipe.generate"):
        read_token_records(tmp_path / "missing.jsonl")


def test_max_len_truncate_and_skip_are_counted(tmp_path: Path) -> None:
    rows = [
        token_record("short", [1, 2], [3, 4]),
        token_record("long", [1, 2, 3], [4, 5, 6, 7, 8]),
        token_record("long_prompt", [1] * 7, [2, 3]),  # truncation leaves no loss token
    ]
    samples, _ = read_token_records(write_jsonl(tmp_path / "r.jsonl", rows))
    kept, counts = apply_max_len(samples, 5, "truncate")
    assert {s.id: s.input_ids for s in kept} == {"short": [1, 2, 3, 4], "long": [1, 2, 3, 4, 5]}
    assert {s.id: s.loss_mask for s in kept}["long"] == [0, 0, 0, 1, 1]
    assert counts == {
        "truncated": 1,
        "tokens_dropped_by_truncation": 3,
        "skipped_no_loss_after_truncation": 1,
    }
    kept, counts = apply_max_len(samples, 5, "skip")
    assert [s.id for s in kept] == ["short"]
    assert counts == {"skipped_over_max_len": 2}
    with pytest.raises(ValueError, match="over_max_len"):
        apply_max_len(samples, 5, "drop")


# --------------------------------------------------------------------------- the stage end to end


def test_stage_writes_store_with_record_ids_and_counts(
    tmp_path: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows: list[dict | str] = [*random_records(9)]
    rows.append(token_record("too_long", list(range(30)), list(range(30, 70))))
    rows.append({"id": "failed", "ok": False, "error": {"class": "APIError"}})
    records = write_jsonl(tmp_path / "records.jsonl", rows)
    cfg = extract_cfg(
        [
            f"extract.run_dir={tmp_path}",
            f"extract.model_path={tiny_dir}",
            "extract.max_len=48",
            "extract.over_max_len=truncate",
            "extract.batch_tokens=96",
            "extract.shard_samples=4",
        ]
    )
    summary = run_extract(cfg)
    store = HiddenStore(tmp_path / "hidden_hf")
    assert summary["counts"]["truncated"] == 1
    assert summary["counts"]["skipped_not_ok"] == 1
    said = capsys.readouterr().err  # the counts as a reader reads them, not a dict
    # `truncated` is generate's word for an answer cut by max_tokens; here: extract.max_len
    assert "cut to extract.max_len 1, skipped 1 (not ok 1)" in said and "{" not in said, said
    assert len(store) == 10
    by_id = {r["id"]: r for r in rows if isinstance(r, dict) and r.get("ok")}
    for sid in store.ids:
        sample = store[sid]
        rec = by_id[sid]
        want = (rec["prompt_ids"] + rec["output_ids"])[:48]
        assert sample["input_ids"].tolist() == want
        assert sample["loss_mask"].tolist() == rec["loss_mask"][:48]
        assert sample["aux_hidden_state"].shape == (len(want), 3 * TINY_HIDDEN)
        assert sample["hidden_state"].shape == (len(want), TINY_HIDDEN)
        assert sample["aux_hidden_state"].dtype == torch.bfloat16  # store_dtype default
    m = store.manifest
    assert m["layer_ids"] == [1, 3, 4]
    assert m["layer_convention"] == "output_of_layer"
    # conf default: the final norm's input, with the norm recorded so export can apply it.
    assert m["final_state"] == "pre_norm"
    assert m["final_norm"]["type"] == "rms_norm" and len(m["final_norm"]["weight"]) == TINY_HIDDEN
    assert m["source_runs"] == [str(records.parent.resolve())]
    assert "loss_mask" in m and "model.loss_mask" in m["loss_mask"]
    assert len(list((tmp_path / "hidden_hf" / SHARDS).glob("*.safetensors"))) == 3
    # The token data as a datasets dataset.
    from datasets import load_from_disk

    ds = load_from_disk(str(tmp_path / "hidden_hf" / "tokens"))
    assert sorted(ds["id"]) == sorted(store.ids)


def test_skip_mode_leaves_long_samples_out(tmp_path: Path, tiny_dir: Path) -> None:
    rows = [*random_records(3), token_record("too_long", list(range(30)), list(range(30, 70)))]
    write_jsonl(tmp_path / "records.jsonl", rows)
    cfg = extract_cfg(
        [
            f"extract.records={tmp_path / 'records.jsonl'}",
            f"extract.model_path={tiny_dir}",
            f"extract.output_dir={tmp_path / 'store'}",
            "extract.max_len=48",
            "extract.over_max_len=skip",
        ]
    )
    summary = run_extract(cfg)
    assert summary["counts"]["skipped_over_max_len"] == 1
    assert "too_long" not in HiddenStore(tmp_path / "store")
    assert len(HiddenStore(tmp_path / "store")) == 3


class KilledAfter:
    """Wraps a backend; raises after `calls` forwards, like a run killed mid-way."""

    def __init__(self, inner: HFBackend, calls: int | None) -> None:
        self.inner, self.calls, self.seen = inner, calls, 0
        self.store_fields = inner.store_fields
        self.forwarded: list[int] = []

    def forward(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.calls is not None and self.seen >= self.calls:
            raise KeyboardInterrupt("killed")
        self.seen += 1
        self.forwarded.extend(len(s) for s in batch)
        return self.inner.forward(batch)

    def close(self) -> None:
        pass


def test_resume_after_kill_continues_after_last_shard(tmp_path: Path, tiny_dir: Path) -> None:
    rows = random_records(12, seed=7)
    write_jsonl(tmp_path / "records.jsonl", rows)
    overrides = [
        f"extract.run_dir={tmp_path}",
        f"extract.model_path={tiny_dir}",
        "extract.batch_tokens=40",  # about one or two samples per forward
        "extract.shard_samples=3",
        "extract.store_dtype=float32",
    ]
    cfg = extract_cfg(overrides)
    backend = HFBackend(tiny_dir, store_dtype="float32")
    with pytest.raises(KeyboardInterrupt):
        run_extract(cfg, KilledAfter(backend, calls=5))
    store_dir = tmp_path / "hidden_hf"
    first = HiddenStore(store_dir)
    committed = set(first.ids)
    assert 0 < len(committed) < 12 and len(committed) % 3 == 0  # whole shards only
    # A crash mid-commit leaves a temp file behind: it must be ignored and cleaned.
    (store_dir / SHARDS / "shard_00099.safetensors.tmp").write_bytes(b"half a shard")

    resumed = KilledAfter(backend, calls=None)
    summary = run_extract(cfg, resumed)
    store = HiddenStore(store_dir)
    assert sorted(store.ids) == sorted(r["id"] for r in rows)  # each sample exactly once
    index_ids = [
        json.loads(line)["id"] for line in (store_dir / "index.jsonl").read_text().splitlines()
    ]
    assert sorted(index_ids) == sorted(store.ids)
    assert not list((store_dir / SHARDS).glob("*.tmp"))
    # Only the samples not committed before were run again.
    assert len(resumed.forwarded) == 12 - len(committed)
    assert summary["capture"]["skipped_done"] == len(committed)
    # And the resumed store equals a clean run.
    clean_dir = tmp_path / "clean"
    run_extract(extract_cfg([*overrides, f"extract.output_dir={clean_dir}"]), backend)
    clean = HiddenStore(clean_dir)
    for sid in clean.ids:
        a, b = store[sid], clean[sid]
        for key in a:
            torch.testing.assert_close(a[key], b[key])


def test_missing_model_dir_says_how_to_get_it(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "records.jsonl", random_records(1))
    cfg = extract_cfg([f"extract.run_dir={tmp_path}", f"extract.model_path={tmp_path / 'nope'}"])
    with pytest.raises(FileNotFoundError, match="config.json"):
        run_extract(cfg)


# --------------------------------------------------------------------------- typed settings


def test_hf_settings_are_typed_from_the_composed_config() -> None:
    job = extract_job(extract_cfg(["extract.threads=2", "extract.layer_ids=[1,3,4]"]))
    settings = HFSettings.from_job(job)
    # conf/extract/hf.yaml's values, typed: the backend reads these fields, not the mapping.
    assert settings == HFSettings(
        device="cpu",
        dtype="float32",
        store_dtype="fp8_e4m3",
        threads=2,
        trust_remote_code=False,
        final_state="pre_norm",
        layer_ids=(1, 3, 4),
        draft_config=(),
        draft_engine="sglang",
    )


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("extract.final_state=middle", "extract.final_state"),
        ("extract.dtype=float8", "extract.dtype"),
        ("extract.device=gpu", "extract.device"),
        ("extract.threads=many", "extract.threads"),
        ("extract.layer_ids=3", "extract.layer_ids"),
    ],
)
def test_a_bad_hf_setting_is_one_config_error_naming_it(override: str, named: str) -> None:
    job = extract_job(extract_cfg([override]))
    with pytest.raises(ConfigError) as caught:
        HFSettings.from_job(job)
    message = str(caught.value)
    assert named in message and "\n" not in message


def test_a_backend_of_your_own_gets_the_job_with_its_own_plain_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_capture_backend.py").write_text(
        "def open_backend(job):\n    return job\n"  # hands back what it was given
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = extract_cfg(["extract.backend=my_capture_backend:open_backend", "+extract.my_key=7"])
    given = load_backend(extract_job(cfg))
    assert isinstance(given, ExtractJob)
    assert given.settings["my_key"] == 7 and given.get("my_key") == 7
    assert given.settings["batch_tokens"] == 8192  # the loop's keys travel as before


# --------------------------------------------------------------------------- real SmolLM2 weights


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (converted once, cached)."""
    from omegaconf import OmegaConf

    from kimi_pipe.store.local_model import LocalModelSpec, ensure_local_model

    conf = REPO / "conf" / "model" / "smollm2.yaml"
    if not conf.exists():
        pytest.skip("conf/model/smollm2.yaml not in this checkout yet")
    spec = LocalModelSpec.from_cfg(OmegaConf.load(conf).local_model)
    return ensure_local_model(spec)


@pytest.mark.slow
def test_smollm2_layer_shapes_and_truncation(tmp_path: Path, smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    rows = []
    for i, (q, a) in enumerate(
        [("What is 2+2?", "4."), ("Name a colour.", "Blue is a colour of the sky at noon.")]
    ):
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        prompt = tok.encode(text, add_special_tokens=False)
        output = tok.encode(a + "<|im_end|>", add_special_tokens=False)
        rows.append(token_record(f"q{i}", prompt, output))
    write_jsonl(tmp_path / "records.jsonl", rows)
    max_len = len(rows[0]["prompt_ids"]) + len(rows[0]["output_ids"])  # keeps the first whole
    # ... and cuts the second one inside its answer.
    assert len(rows[1]["prompt_ids"]) < max_len < len(rows[1]["loss_mask"])
    cfg = extract_cfg(
        [
            "model=smollm2",  # weights found through model.hf_weights / model.local_model
            f"extract.run_dir={tmp_path}",
            f"extract.max_len={max_len}",
        ]
    )
    summary = run_extract(cfg)
    assert summary["counts"]["truncated"] == 1
    store = HiddenStore(tmp_path / "hidden_hf")
    m = store.manifest
    assert (m["num_layers"], m["hidden_size"]) == (30, 576)
    assert m["layer_ids"] == [1, 14, 26]
    for rec in rows:
        sample = store[rec["id"]]
        ids = (rec["prompt_ids"] + rec["output_ids"])[:max_len]
        assert sample["input_ids"].tolist() == ids
        assert sample["aux_hidden_state"].shape == (len(ids), 3 * 576)
        assert sample["hidden_state"].shape == (len(ids), 576)
        assert torch.isfinite(sample["aux_hidden_state"].float()).all()
    # The stored final state is the post-norm state that feeds the LM head: its logits
    # predict the model's own greedy next token at the end of the prompt.
    backend = HFBackend(smollm2_dir)
    prompt = rows[0]["prompt_ids"]
    [(_, final)] = backend.forward([prompt])
    with torch.inference_mode():
        logits = backend.model.lm_head(final[-1])
        ref = backend.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, ref, atol=1e-3, rtol=1e-3)
    assert int(logits.argmax()) == int(ref.argmax())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_states_match_cpu(tiny_dir: Path, tiny: HFBackend) -> None:
    seqs = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    gpu = HFBackend(tiny_dir, device="cuda", dtype="float32")
    for (aux_g, final_g), (aux_c, final_c) in zip(
        gpu.forward(seqs), tiny.forward(seqs), strict=True
    ):
        assert aux_g.device.type == "cpu"  # handed back on the host for the store
        torch.testing.assert_close(aux_g, aux_c, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(final_g, final_c, atol=1e-4, rtol=1e-3)
    gpu.close()


def test_skipped_counts_each_record_once() -> None:
    """A skipped record with ids is counted by why and by its rung: said once, not twice."""
    from kimi_pipe.reporting.formatting import skipped_line

    counts = {"lines": 32, "skipped_not_ok": 1, "skipped_evidence_unresolved": 1, "usable": 31}
    assert skipped_line(counts) == "1 (not ok 1; rung unresolved 1)"
    assert skipped_line({"lines": 3, "usable": 3}) == "0"
    two = {"skipped_not_ok": 1, "skipped_bad_json": 1, "skipped_evidence_unresolved": 1}
    assert skipped_line(two) == "2 (not ok 1, bad json 1; rung unresolved 1)"
