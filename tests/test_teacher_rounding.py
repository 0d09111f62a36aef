"""An fp8 final state that keeps the teacher: the LM head's argmax of the plain store.

Round-to-nearest fp8 flips the head's argmax where the top two logits are close; the writer,
given the head, re-rounds a few values of those rows to their other fp8 neighbour
(kimi_pipe.store.teacher_rounding). Checked on a random head built to have close calls, through
the store, and on the demo model's real weights through the extract stage.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from kimi_pipe.errors import ConfigError
from kimi_pipe.extraction.output_head import head_tensor_name, read_output_head
from kimi_pipe.stages.extract import run_extract
from kimi_pipe.stages.jobs.extract import extract_job
from kimi_pipe.store.conventions import final_norm_spec, final_state_as
from kimi_pipe.store.hidden_store import HiddenStore, StoreWriter, make_manifest, quantize_rows
from kimi_pipe.store.teacher_rounding import (
    TeacherHead,
    fp8_grid,
    quantize_keeping_argmax,
    teacher_rows,
)

REPO = Path(__file__).resolve().parent.parent
HIDDEN = 48
VOCAB = 300


def close_calls(rows: int, seed: int = 0) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """A head, a final norm and pre-norm states whose best two logits are close on many rows."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randn(VOCAB, HIDDEN, generator=gen)
    norm = final_norm_spec(torch.rand(HIDDEN, generator=gen) + 0.5, 1e-5, "norm")
    # Each state sits between two tokens' directions: their logits nearly tie.
    a = torch.randint(0, VOCAB, (rows,), generator=gen)
    b = torch.randint(0, VOCAB, (rows,), generator=gen)
    weight = torch.tensor(norm["weight"])
    mix = 0.5 + 0.02 * torch.randn(rows, 1, generator=gen)
    states = (mix * head[a] + (1 - mix) * head[b]) / weight
    states += 0.05 * torch.randn(rows, HIDDEN, generator=gen)
    states[:, 0] *= 30  # one large channel, as real final states have: it sets the row scale
    return head, norm, states


def argmax_as_read(head: TeacherHead, values: torch.Tensor) -> torch.Tensor:
    return head.top(values.to(head.read_dtype))[0]


def test_keeps_every_rows_argmax_and_each_value_within_one_fp8_step() -> None:
    weight, norm, states = close_calls(2000)
    head = TeacherHead(weight, norm)
    assert head.readings == (False, True)  # float32 norm on the reading; an export's bf16 file
    ref = {pc: head.top(states.to(torch.bfloat16), post_cast=pc)[0] for pc in head.readings}
    agree = ref[False] == ref[True]  # the plain store's own readings tie elsewhere
    q_near, scale_near = quantize_rows(states, 1)
    near = (q_near.float() * scale_near).to(torch.bfloat16)
    flipped = head.top(near)[0] != ref[False]
    flipped |= agree & (head.top(near, post_cast=True)[0] != ref[True])
    assert int(flipped.sum()) > 20  # round to nearest does flip close calls

    q, scale, counts = quantize_keeping_argmax(states, head)
    assert counts.flipped == int(flipped.sum())
    assert counts.kept == counts.flipped and counts.not_kept == 0
    assert counts.readings_disagree == int((~agree).sum())
    kept = (q.float() * scale).to(torch.bfloat16)
    assert torch.equal(head.top(kept)[0], ref[False])
    assert torch.equal(head.top(kept, post_cast=True)[0][agree], ref[True][agree])
    # Same scales and bytes; rows round to nearest did not flip are untouched.
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(scale, scale_near)
    assert torch.equal(q[~flipped].float(), q_near[~flipped].float())
    # Every value is one of the two fp8 values around the state (within one step).
    grid = fp8_grid()
    target = states / scale
    hi = grid[torch.searchsorted(grid, target).clamp(max=grid.numel() - 1)]
    lo_idx = (torch.searchsorted(grid, target, right=True) - 1).clamp(min=0)
    lo = grid[lo_idx]
    got = q.float()
    assert ((got == lo) | (got == hi)).all()
    changed = int((got != q_near.float()).sum())
    assert counts.values_changed == changed
    assert 0 < changed < int(flipped.sum()) * 5  # a few values per flipped row


def test_only_the_rows_a_trainer_reads_are_checked() -> None:
    weight, norm, states = close_calls(400, seed=2)
    head = TeacherHead(weight, norm)
    mask = torch.zeros(400, dtype=torch.long)
    mask[250:] = 1  # a prompt of 250 rows, then the answer
    read = teacher_rows(mask)
    assert read[249] and read[250:].all() and not read[:249].any()  # 249 predicts token 250
    q, scale, counts = quantize_keeping_argmax(states, head, rows_read=read)
    q_near, _ = quantize_rows(states, 1)
    assert counts.rows == 151 and counts.kept == counts.flipped > 0
    assert torch.equal(q[:249].float(), q_near[:249].float())  # prompt rows: round to nearest
    ref = argmax_as_read(head, states)
    assert torch.equal(argmax_as_read(head, q.float() * scale)[read], ref[read])


def test_nearest_already_right_is_left_alone() -> None:
    weight, norm, states = close_calls(50, seed=3)
    far = states.clone()
    far[:, 1:] = weight[7, 1:] * 10  # every row points at token 7 by a wide margin
    q, scale, counts = quantize_keeping_argmax(far, TeacherHead(weight, None))
    q_near, _ = quantize_rows(far, 1)
    assert counts.flipped == 0 and torch.equal(q.float(), q_near.float())


def manifest(path: Path, norm: dict) -> dict:
    return make_manifest(
        model="m",
        num_layers=8,
        layer_ids=[1, 3, 4],
        final_state="pre_norm",
        hidden_size=HIDDEN,
        dtype="fp8_e4m3",
        loss_mask="test",
        source_runs=[str(path)],
        backend="test",
        extra={"final_norm": norm},
    )


def test_store_records_the_rounding_and_reads_back_the_teacher(tmp_path: Path) -> None:
    weight, norm, states = close_calls(600, seed=1)
    aux = torch.randn(600, 3 * HIDDEN)
    path = tmp_path / "store"
    with StoreWriter(path, manifest(tmp_path, norm), head_weight=weight) as w:
        for i in range(6):
            rows = slice(i * 100, (i + 1) * 100)
            w.add(f"s{i}", list(range(100)), [1] * 100, aux[rows], states[rows])
    assert w.rounding.flipped > 0 and w.rounding.kept == w.rounding.flipped
    store = HiddenStore(path)
    assert "argmax_kept" in store.manifest["final_rounding"]
    # What an export computes (the post-norm state from the bf16 reading) keeps the argmax.
    m = store.manifest
    got = torch.cat(
        [final_state_as(m, store[s]["hidden_state"].float(), "post_norm") for s in store]
    )
    want = final_state_as(m, states.to(torch.bfloat16).float(), "post_norm")
    assert torch.equal((got @ weight.T).argmax(-1), (want @ weight.T).argmax(-1))
    # Reopening with plain rounding would mix two methods in one store: refused.
    with pytest.raises(ConfigError, match="final_rounding"):
        StoreWriter(path, manifest(tmp_path, norm))


def test_head_is_read_from_a_checkpoint(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    for tied in (False, True):
        config.tie_word_embeddings = tied
        model = LlamaForCausalLM(config)
        model.save_pretrained(tmp_path / str(tied))
        head = read_output_head(tmp_path / str(tied))
        assert torch.equal(head, model.lm_head.weight.detach().float())
    with pytest.raises(ConfigError, match="no LM-head tensor"):
        head_tensor_name(["model.embed_tokens.weight"], tied=False)
    with pytest.raises(ConfigError, match="several"):
        head_tensor_name(["a.lm_head.weight", "b.lm_head.weight"], tied=False)


# --------------------------------------------------------------------------- real SmolLM2 weights


def text_records(path: Path, tokenizer_dir: Path, n: int, length: int) -> Path:
    """n chunks of this repository's docs, SmolLM2's tokenizer, a quarter as context."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    ids = tok.encode(text, add_special_tokens=False)
    context = length // 4
    with open(path, "w") as f:
        for i in range(n):
            chunk = ids[i * length : (i + 1) * length]
            rec = {
                "id": f"t{i:03d}",
                "ok": True,
                "issues": [],
                "prompt_ids": chunk[:context],
                "output_ids": chunk[context:],
                "loss_mask": [0] * context + [1] * (length - context),
            }
            f.write(json.dumps(rec) + "\n")
    return path


@pytest.mark.slow
def test_demo_model_fp8_store_keeps_the_bf16_stores_teacher(tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        base = compose(config_name="config", overrides=["model=smollm2"])
    from kimi_pipe.extraction.hf_backend import resolve_model_path

    model_dir = resolve_model_path(extract_job(base))
    text_records(tmp_path / "records.jsonl", model_dir, n=8, length=160)
    stores = {}
    for name, store_dtype, rounding in (
        ("bf16", "bfloat16", "keep_teacher"),
        ("nearest", "fp8_e4m3", "nearest"),
        ("kept", "fp8_e4m3", "keep_teacher"),
    ):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(
                config_name="config",
                overrides=[
                    "model=smollm2",
                    f"extract.run_dir={tmp_path}",
                    f"extract.output_dir={tmp_path / name}",
                    f"extract.store_dtype={store_dtype}",
                    f"extract.final_fp8_rounding={rounding}",
                ],
            )
        summary = run_extract(cfg)
        stores[name] = HiddenStore(tmp_path / name)
        if name == "kept":
            counts = summary["final_fp8_rounding"]
        else:
            assert summary["final_fp8_rounding"] is None
    head = read_output_head(model_dir)
    m = stores["bf16"].manifest

    def teacher(store: HiddenStore) -> torch.Tensor:
        out = []
        for sid in store.ids:
            sample = store[sid]
            post = final_state_as(m, sample["hidden_state"].float(), "post_norm")
            out.append((post @ head.T).argmax(-1)[sample["loss_mask"].bool()])
        return torch.cat(out)

    ref = teacher(stores["bf16"])
    assert int((teacher(stores["nearest"]) != ref).sum()) > 0  # nearest flips some
    assert torch.equal(teacher(stores["kept"]), ref)
    assert counts["flipped_by_round_to_nearest"] > 0 and counts["not_kept"] == 0
    assert "argmax_kept" in stores["kept"].manifest["final_rounding"]
    assert "final_rounding" not in stores["nearest"].manifest
    size = {
        n: sum(p.stat().st_size for p in (s.path / "shards").iterdir()) for n, s in stores.items()
    }
    assert size["kept"] == size["nearest"] < size["bf16"] * 0.52
