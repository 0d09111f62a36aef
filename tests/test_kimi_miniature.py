"""The target's own classes (issue 41): a miniature Kimi K2.5 through extraction, target
resolution, the split check, the store, the four exports and the trainers' ways of reading them.

The miniature (`conf/miniature/kimi_k25.yaml`, built by `kimi_pipe.store.miniature` into a tmp
dir) has Kimi K2.5's config.json structure (the KimiK25ForConditionalGeneration wrapper around a
DeepSeek-V3 text model: MLA, 1 dense + 60 MoE layers with sigmoid routing, yarn rope, vocabulary
163,840), all 61 layers at width 64, a one-block vision tower, and random weights under the
checkpoint's own names. transformers loads it with its own Kimi K2.5 and DeepSeek-V3 classes.
No SGLang: the SGLang half runs in the sglang_cpu tier (docs/miniature.md).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from kimi_pipe.core.models import Model
from kimi_pipe.core.prompt_render import prompt_ids
from kimi_pipe.exporters import SPECFORGE_CONFIG
from kimi_pipe.extraction.hf_backend import HFBackend, load_wrapped_text_model
from kimi_pipe.extraction.layers import output_to_capture_ids, sglang_config_to_capture_ids
from kimi_pipe.extraction.resolve import HFSuffixScorer, full_sequence_logprobs
from kimi_pipe.extraction.sampler import Sampling
from kimi_pipe.stages.extract import run_extract
from kimi_pipe.store import miniature
from kimi_pipe.store.conventions import rms_norm
from kimi_pipe.store.hidden_store import HiddenStore, default_layer_ids
from kimi_pipe.store.records import read_records
from tests.support.export_readback import read_back_exports, records_by_id
from tests.support.miniature import QUESTIONS, greedy, kimi_records, split_check_records

REPO = Path(__file__).resolve().parent.parent
LAYERS = 61  # Kimi K2.5's depth, kept
HIDDEN = 64  # the miniature's width
OUTPUT_IDS = [1, 29, 57]  # "output of layer": the default rule at 61 layers
CAPTURE_IDS = [2, 30, 58]  # SGLang's capture ids = transformers hidden_states indices


@pytest.fixture(scope="module")
def mini_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return miniature.build(miniature.load_spec("kimi_k25"), tmp_path_factory.mktemp("kimi-mini"))


@pytest.fixture(scope="module")
def mini(mini_dir: Path) -> Iterator[HFBackend]:
    backend = HFBackend(mini_dir, store_dtype="float32", final_state="pre_norm")
    yield backend
    backend.close()


def cfg_for(overrides: list[str]) -> Any:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


# --------------------------------------------------------------------------- the miniature


def test_the_miniature_has_the_real_structure_names_and_depth(
    mini_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForImageTextToText

    config = json.loads((mini_dir / "config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert (config["model_type"], text["model_type"]) == ("kimi_k25", "kimi_k2")
    assert (text["num_hidden_layers"], text["vocab_size"], text["hidden_size"]) == (61, 163840, 64)
    assert (text["first_k_dense_replace"], text["scoring_func"], text["topk_method"]) == (
        1, "sigmoid", "noaux_tc",
    )  # fmt: skip
    assert text["rope_scaling"]["type"] == "yarn" and text["rope_scaling"]["factor"] == 64.0
    assert "quantization_config" not in config and "quantization_config" not in text
    # Kimi's marker ids (conf/model/kimi_k25.yaml) and special ids are rows of its vocabulary.
    markers = yaml.safe_load((REPO / "conf/model/kimi_k25.yaml").read_text())["markers"]
    assert max(markers.values()) < text["vocab_size"]
    assert config["media_placeholder_token_id"] == 163605 and config["pad_token_id"] == 163839
    # The checkpoint's own names: the wrapper's language_model./vision_tower./mm_projector.
    names = set(json.loads((mini_dir / "model.safetensors.index.json").read_text())["weight_map"])
    for name in (
        "language_model.lm_head.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.model.norm.weight",
        "language_model.model.layers.0.mlp.down_proj.weight",
        "language_model.model.layers.60.self_attn.kv_a_proj_with_mqa.weight",
        "language_model.model.layers.60.mlp.experts.7.down_proj.weight",
        "language_model.model.layers.1.mlp.gate.e_score_correction_bias",
        "vision_tower.encoder.blocks.0.wqkv.weight",
        "mm_projector.proj.2.weight",
    ):
        assert name in names, name
    assert "language_model.model.layers.0.mlp.gate.weight" not in names  # layer 0 is dense
    assert not any(n.startswith("model.") for n in names)
    # The same spec gives the same bytes.
    again = miniature.build(miniature.load_spec("kimi_k25"), tmp_path / "again")
    first, second = (json.loads((d / miniature.MARKER).read_text()) for d in (mini_dir, again))
    assert first == second and len(first["files"]) == 4
    # transformers' own classes take every tensor, under its checkpoint conversion of the names.
    loaded: Any = AutoModelForImageTextToText.from_pretrained(
        str(mini_dir), dtype=torch.float32, output_loading_info=True
    )
    model, info = loaded
    assert {k: list(v) for k, v in info.items() if v} == {}
    assert type(model).__name__ == "Kimi_K25ForConditionalGeneration"
    decoder = model.get_decoder()
    assert type(decoder).__name__ == "DeepseekV3Model" and len(decoder.layers) == LAYERS
    kinds = {type(layer.mlp).__name__ for layer in decoder.layers[1:]}
    assert (type(decoder.layers[0].mlp).__name__, kinds) == ("DeepseekV3MLP", {"DeepseekV3MoE"})
    assert hasattr(decoder.layers[30].self_attn, "kv_a_proj_with_mqa")  # MLA
    # A transformers without Kimi K2.5's classes (SGLang's venv pins 5.8.1) loads the text model
    # alone, by text_config's own class (DeepseekV3ForCausalLM) under the checkpoint's names:
    # the same logits as the wrapper on text ids.
    text_only = load_wrapped_text_model(mini_dir, "float32")
    assert type(text_only).__name__ == "DeepseekV3ForCausalLM"
    ids = torch.tensor([[163587, 1008, 17, 163601, 99, 163588, 163606, 250, 163607, 163586]])
    with torch.inference_mode():
        assert torch.equal(text_only(input_ids=ids).logits, model(input_ids=ids).logits)


# --------------------------------------------------------------------------- layer mapping


def test_the_layer_mapping_holds_at_the_real_depth(mini: HFBackend) -> None:
    """Captured "output of layer" ids, SGLang's capture ids and transformers' hidden_states
    indices name the same tensors at 61 layers; a neighbouring layer is far off."""
    assert mini.num_layers == LAYERS and mini.hidden_size == HIDDEN
    assert mini.layer_ids == OUTPUT_IDS == default_layer_ids(LAYERS)
    assert output_to_capture_ids(OUTPUT_IDS) == CAPTURE_IDS
    assert CAPTURE_IDS == [2, LAYERS // 2, LAYERS - 3]  # SGLang's own default rule
    # A drafter config naming either list makes SGLang capture these ids (+1 only after a 1).
    assert sglang_config_to_capture_ids(OUTPUT_IDS) == CAPTURE_IDS
    assert sglang_config_to_capture_ids(CAPTURE_IDS) == CAPTURE_IDS
    ids = [163587, 1008, 17, 42, 163601, 7, 99, 163588, 3, 163606, 250, 11, 163607, 163586]
    [(aux, pre)] = mini.forward([ids])
    assert aux.shape == (len(ids), 3 * HIDDEN) and pre.shape == (len(ids), HIDDEN)
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        mini.decoder.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: seen.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i in [*OUTPUT_IDS, LAYERS - 1]
    ]
    try:
        with torch.inference_mode():
            out = mini.decoder(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    states = out.hidden_states
    assert len(states) == LAYERS + 1  # embeddings, then one per layer
    for k, (layer, index) in enumerate(zip(OUTPUT_IDS, CAPTURE_IDS, strict=True)):
        block = aux[:, k * HIDDEN : (k + 1) * HIDDEN]
        torch.testing.assert_close(block, seen[layer][0])
        torch.testing.assert_close(block, states[index][0])
        for off in (index - 1, index + 1):
            gap = (states[off][0] - block).norm() / block.norm()
            assert gap > 1e-2, (index, off, float(gap))
    # The final state: the last layer's output before the final norm; the norm recorded in
    # the manifest gives the decoder's post-norm state (the head's input).
    torch.testing.assert_close(pre, seen[LAYERS - 1][0])
    post = rms_norm(pre, mini.store_fields["extra"]["final_norm"])
    torch.testing.assert_close(post, out.last_hidden_state[0], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(post, pre, atol=1e-2)


# --------------------------------------------------------------------------- extract + export


@pytest.fixture(scope="module")
def store_run(tmp_path_factory: pytest.TempPathFactory, mini_dir: Path, kimi: Model) -> Path:
    """The extract stage as a user runs it: model=kimi_k25, the hf backend's defaults (fp8 store
    keeping the teacher, pre-norm final state), the miniature's directory as the weights."""
    run = tmp_path_factory.mktemp("kimi-run")
    rows = kimi_records(kimi, 6)
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run_extract(
        cfg_for(
            [
                "model=kimi_k25",
                f"extract.run_dir={run}",
                f"extract.model_path={mini_dir}",
                "resolve.split_check=false",
                "extract.shard_samples=4",
            ]
        )  # fmt: skip
    )
    assert summary["capture"]["written"] == 6, summary
    return run


@pytest.fixture(scope="module")
def float_states(store_run: Path, mini: HFBackend) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What one float32 forward (a batch of every record) gives: id -> (aux, pre-norm)."""
    rows = list(read_records(store_run / "records.jsonl"))
    states = mini.forward([r["prompt_ids"] + r["output_ids"] for r in rows])
    return {r["id"]: s for r, s in zip(rows, states, strict=True)}


def test_extract_stores_every_sample_at_the_real_layers(
    store_run: Path, mini: HFBackend, float_states: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    store = HiddenStore(store_run / "hidden_hf")
    rows = {r["id"]: r for r in read_records(store_run / "records.jsonl")}
    assert sorted(store.ids) == sorted(rows)
    m = store.manifest
    assert (m["num_layers"], m["hidden_size"], m["layer_ids"]) == (LAYERS, HIDDEN, OUTPUT_IDS)
    assert (m["final_state"], m["layer_convention"]) == ("pre_norm", "output_of_layer")
    norm = mini.decoder.norm.weight.detach().float()
    assert torch.equal(torch.tensor(m["final_norm"]["weight"], dtype=torch.float32), norm)
    for sid, rec in rows.items():
        s = store[sid]
        assert s["input_ids"].tolist() == rec["prompt_ids"] + rec["output_ids"]
        assert s["loss_mask"].tolist() == rec["loss_mask"]
        # fp8 storage of what the float32 forward gives (one scale per row: ~6 % per value).
        aux, pre = float_states[sid]
        for got, want in ((s["aux_hidden_state"], aux), (s["hidden_state"], pre)):
            rel = (got.float() - want).norm() / want.norm()
            assert rel < 0.05, (sid, float(rel))


def test_four_exports_read_back_as_the_trainers_read_them(
    store_run: Path,
    mini_dir: Path,
    mini: HFBackend,
    float_states: dict[str, tuple[torch.Tensor, torch.Tensor]],
    tmp_path: Path,
) -> None:
    store_dir = store_run / "hidden_hf"
    spec = HiddenStore(store_dir).manifest["final_norm"]
    # Every sample once in each format, ids and masks equal the records, states equal the store
    # (SpecForge's post-norm state is the norm applied to the stored pre-norm state).
    teacher = read_back_exports(
        store_dir, tmp_path, target_model_path=mini_dir,
        records=records_by_id(store_run / "records.jsonl"),
    )  # fmt: skip
    head = mini.model.lm_head.weight.detach().float()
    agree = total = 0
    for sid, post in teacher.items():
        # The teacher: the post-norm state through Kimi's own head predicts what the model's
        # float32 logits predict (the fp8 store keeps the bf16 store's argmax; bf16 against
        # float32 may part at a near tie).
        want = (rms_norm(float_states[sid][1], spec) @ head.T).argmax(-1)
        agree += int(((post @ head.T).argmax(-1) == want).sum())
        total += len(want)
    assert agree >= 0.98 * total, (agree, total)
    assert "--target-layer-ids 2 30 58" in (tmp_path / "speculators" / "README.md").read_text()
    # SpecForge's config names Kimi's checkpoint keys, read from the checkpoint's index.
    train = yaml.safe_load((tmp_path / "specforge" / SPECFORGE_CONFIG).read_text())
    flat = json.dumps(train)
    assert "language_model.lm_head.weight" in flat
    assert "language_model.model.embed_tokens.weight" in flat


# --------------------------------------------------------------------------- resolution


@pytest.fixture(scope="module")
def greedy_answers(mini: HFBackend, kimi: Model) -> list[tuple[list[int], list[int]]]:
    """Kimi-rendered prompts and the miniature's own greedy continuations (8 ids each)."""
    out = []
    for question in QUESTIONS[:3]:
        prompt = prompt_ids(kimi, [{"role": "user", "content": question}])
        out.append((prompt, greedy(mini.model, prompt, 8)))
    return out


@pytest.fixture(scope="module")
def own_answer(greedy_answers: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[int]]:
    prompt, answer = greedy_answers[1]
    return prompt, answer[:6]  # greedy: the first 6 ids are the 6-id greedy continuation


def test_prefix_reuse_equals_full_forwards_under_mla(
    mini: HFBackend, kimi: Model, own_answer: tuple[list[int], list[int]]
) -> None:
    """Target resolution's cached prefix (DeepSeek-V3's MLA cache, repeated per option) gives
    what full forwards give (the samplers' arithmetic is tests/test_resolve.py's)."""
    sampling = Sampling(1.0)
    prefix, own = own_answer
    suffixes = [
        own[:5],  # the model's own greedy ids: drawable under every sampling here
        [*own[:4], (own[4] + 1) % 163584],  # same length: one batch with the first
        kimi.encode([" is the answer."]),
    ]
    scorer = HFSuffixScorer(mini.model, "kimi-mini")
    cached = scorer.score_suffixes(prefix, suffixes, sampling)
    full = [full_sequence_logprobs(mini.model, prefix + s, len(prefix), sampling) for s in suffixes]
    assert full[0] > -math.inf
    for c, f in zip(cached, full, strict=True):
        assert c == -math.inf if f == -math.inf else c == pytest.approx(f, abs=1e-3)


def test_extract_resolves_a_closed_set_to_the_models_own_ids(
    tmp_path: Path, mini_dir: Path, own_answer: tuple[list[int], list[int]]
) -> None:
    """Under greedy sampling the only option the target could have drawn is its own greedy
    continuation: resolution must choose it, and the store must hold it (an answer cut by
    its length: no end id)."""
    prompt, own = own_answer
    other = [*own[:3], (own[3] + 1) % 163584, *own[4:]]
    options = [
        {"output_ids": other, "loss_mask": [1] * len(own), "label": "other"},
        {"output_ids": own, "loss_mask": [1] * len(own), "label": "own"},
    ]
    rec = {
        "id": "r0", "ok": False, "evidence": "unresolved",
        "issues": ["reasoning_tail_unverifiable"], "notes": [],
        "prompt_ids": prompt, "output_ids": other,
        "loss_mask": [0] * len(prompt) + [1] * len(own),
        "sampling": {"temperature": 0.0},
        "candidates": {"closed": True, "why_open": None, "classes": ["reasoning_tail"],
                       "diverge_at": 3, "options": options},
    }  # fmt: skip
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps(rec) + "\n")
    summary = run_extract(
        cfg_for(
            [
                "model=kimi_k25",
                f"extract.run_dir={tmp_path}",
                f"extract.model_path={mini_dir}",
                "resolve.split_check=false",
            ]
        )  # fmt: skip
    )
    assert summary["resolve"]["counts"] == {"resolved": 1}
    [after] = list(read_records(records))
    assert after["evidence"] == "target_resolved" and after["ok"]
    assert after["resolution"]["chosen"] == 1
    store = HiddenStore(tmp_path / "hidden_hf")
    assert store.tokens("r0")["input_ids"].tolist() == [*prompt, *own]


# --------------------------------------------------------------------------- split check


def test_split_check_branches_reuse_the_mla_cache(
    mini: HFBackend, own_answer: tuple[list[int], list[int]]
) -> None:
    """The split check's scorer cuts the record's KV cache back to a branch point (DeepSeek-V3's
    cache): its rows equal plain forwards over each branch."""
    from kimi_pipe.extraction.split_check import HFNextTokenScorer

    prompt, out = own_answer
    ids = prompt + out
    sampling = Sampling(1.0, 0.9)
    scorer = HFNextTokenScorer(mini.model, sampling, chunk_tokens=3)
    own = scorer.logprobs_along(ids, len(prompt), [[t] for t in out])
    k = 3
    branch = [*ids[: len(prompt) + k], out[k + 1], out[k]]
    before = scorer.tokens
    rows = scorer.logprobs_along(branch, len(branch), [[out[k], out[k + 2]]])
    assert scorer.tokens - before == 2  # the two branch ids, on the cached prefix
    plain_own = HFNextTokenScorer(mini.model, sampling).logprobs_along(
        ids, len(prompt), [[t] for t in out]
    )
    plain_rows = HFNextTokenScorer(mini.model, sampling).logprobs_along(
        branch, len(branch), [[out[k], out[k + 2]]]
    )
    finite = 0
    for got, want in zip([*own, *rows], [*plain_own, *plain_rows], strict=True):
        for a, b in zip(got, want, strict=True):
            assert (a == -math.inf) == (b == -math.inf)
            if a != -math.inf:
                finite += 1
                assert a == pytest.approx(b, abs=1e-3)
    assert finite >= len(out)  # greedy ids are drawable under top_p 0.9


def test_extract_split_check_recovers_the_models_own_ids(
    tmp_path: Path, mini_dir: Path, kimi: Model, greedy_answers: list[tuple[list[int], list[int]]]
) -> None:
    """Records rebuilt from text alone (the canonical encoding of the miniature's greedy text,
    billed at the true count): the split check through the stage keeps a canonical answer and
    recovers a non-canonical one, under greedy sampling, on Kimi's 163,840-id vocabulary."""
    rows, truths = split_check_records(kimi, greedy_answers)
    # These prompts' greedy texts: one re-encodes to other ids (the case to recover).
    assert any(not same for _, same in truths.values())
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run_extract(
        cfg_for(
            [
                "model=kimi_k25",
                f"extract.run_dir={tmp_path}",
                f"extract.model_path={mini_dir}",
                "resolve.billing_splits=true",
            ]
        )  # fmt: skip
    )
    counts = summary["resolve"]["counts"]
    assert sum(counts.values()) == len(rows) and set(counts) <= {
        "split_checked", "split_resolved_other",
    }, counts  # fmt: skip
    store = HiddenStore(tmp_path / "hidden_hf")
    for r in read_records(records):
        truth, same = truths[r["id"]]
        assert r["output_ids"] == truth, (r["id"], r.get("split_check"))
        assert r["evidence"] == ("text_proven" if same else "target_resolved")
        prompt = greedy_answers[int(r["id"][1:])][0]
        assert store.tokens(r["id"])["input_ids"].tolist() == prompt + truth


# --------------------------------------------------------------------------- the audit


def test_audit_runs_on_the_miniature_from_the_records_prompts(
    tmp_path: Path, mini_dir: Path, greedy_answers: list[tuple[list[int], list[int]]]
) -> None:
    """The fidelity audit loads the target as extraction does (the vision wrapper's own class,
    no remote code); the miniature ships no tokenizer or chat template, so each record's
    prompt ids are the prompt and the output is compared with the model's greedy ids."""
    from kimi_pipe.reporting.audit import run_audit
    from kimi_pipe.stages.jobs.audit import audit_job

    rows = []
    for i, (prompt, answer) in enumerate(greedy_answers[:2]):
        output = list(answer) if i == 0 else [*answer[:3], (answer[3] + 1) % 1000 + 10, *answer[4:]]
        rows.append({
            "id": f"a{i}", "ok": True, "issues": [], "messages": [{"role": "user", "content": "q"}],
            "request": {"max_tokens": len(answer)},
            "prompt_ids": prompt, "output_ids": output,
        })  # fmt: skip
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = audit_job(
        cfg_for(["model=kimi_k25", f"audit.records={records}", f"audit.model_path={mini_dir}"])
    )
    summary = run_audit(job)
    assert summary["audited"] == 2 and summary["exact"] == 1, summary
    assert summary["prompt_checked"] == 0  # no chat template: the prompt is the record's own
