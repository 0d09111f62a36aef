"""Is an fp8 store as good as bf16? Measured on the demo model (SmolLM2-135M, real weights).

    .venv/bin/python scripts/fp8_measure.py --out runs/fp8 [--max-new-tokens 160]

1. Records: `--samples` chunks of `--length` tokens of real English text (this repository's
   README and docs, SmolLM2's tokenizer), the first quarter as context (loss mask 0). Not the
   model's own answers (generating them took too long on the shared CPU): the comparison of
   stores needs the same tokens for each, and the teacher agreement is reported both as
   "argmax = next token" and as "argmax = the float32 / bf16 store's argmax".
2. Stores from one capture (the hf backend's forward, pre-norm final state, written by the
   store's own `StoreWriter` into each): float32 (the reference), bfloat16 (the default),
   fp8_e4m3 for both states, fp8 aux + bf16 final. (scripts/bench_extract.py times the whole
   extract stage with fp8 storage.)
3. Per state: relative error ||x - ref|| / ||ref|| and cosine per token against float32 and
   against bf16; teacher agreement: argmax of the LM head on the post-norm final state (the
   export's own conversion, `final_state_as`) = the next token, at every loss position.
4. Exports of every store in every format (SpecForge plain and gzip'ed, speculators bf16 and
   fp8, ModelOpt, tokens): bytes per token of each directory's files.

Writes OUT/fp8_figures.json and prints it; the speculators exports feed
scripts/drafter_cpu.py (the drafter trained on each, in the trainers' venv).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from kimi_pipe.config import DATA_DIR, compose
from kimi_pipe.extraction.hf_backend import HFBackend
from kimi_pipe.stages.export import export
from kimi_pipe.store.conventions import final_state_as
from kimi_pipe.store.hidden_store import HiddenStore

STORES = {
    "float32": ("float32", None),
    "bf16": ("bfloat16", None),
    "fp8": ("fp8_e4m3", None),
    "fp8_aux_bf16_final": ("fp8_e4m3", "bfloat16"),
}
EXPORTS = {
    "specforge": ("specforge", {}),
    "specforge_gzip": ("specforge", {"compress": True}),
    "speculators": ("speculators", {}),
    "speculators_fp8": ("speculators", {"dtype": "fp8_e4m3"}),
    "modelopt": ("modelopt", {}),
    "tokens": ("tokens", {}),
}


def text_records(model_path: str, n: int, length: int, out: Path) -> None:
    """Token records cut from real English text (this repository's docs), `length` tokens
    each; the first quarter is context (loss mask 0), the rest is trained on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    root = DATA_DIR.parent
    text = "\n\n".join(
        p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    step = max(length, (len(ids) - length) // max(n, 1))
    lines = []
    for i in range(n):
        chunk = ids[i * step : i * step + length]
        if len(chunk) < length:
            break
        context = length // 4
        lines.append(
            json.dumps(
                {
                    "id": f"t{i:03d}",
                    "ok": True,
                    "issues": [],
                    "prompt_ids": chunk[:context],
                    "output_ids": chunk[context:],
                    "loss_mask": [0] * context + [1] * (length - context),
                }
            )
            + "\n"
        )
    out.write_text("".join(lines))


def build_stores(backend: HFBackend, records: Path, out: Path) -> dict[str, HiddenStore]:
    """One forward per batch, the same states written into every store (StoreWriter, the
    store code the extract stage uses): the stores differ only in how they keep the states."""
    from collections import deque

    from kimi_pipe.extraction.sharding import TokenBudget, next_batch
    from kimi_pipe.extraction.token_samples import read_token_records
    from kimi_pipe.store.hidden_store import StoreWriter, make_manifest

    paths = {name: out / f"store_{name}" for name in STORES}
    if all((p / "tokens").exists() for p in paths.values()):
        return {name: HiddenStore(p) for name, p in paths.items()}
    samples, _ = read_token_records(records)
    writers = {}
    for name, (dtype, final_dtype) in STORES.items():
        shutil.rmtree(paths[name], ignore_errors=True)
        fields = {**backend.store_fields, "dtype": dtype}
        manifest = make_manifest(
            **fields,
            final_dtype=final_dtype,
            loss_mask="prompt 0, answer 1",
            source_runs=[str(out.resolve())],
            backend="hf",
        )
        writers[name] = StoreWriter(paths[name], manifest)
    pending = deque(sorted(samples, key=lambda x: -len(x.input_ids)))
    budget = TokenBudget(4096)
    while pending:
        batch = next_batch(pending, budget, lambda x: len(x.input_ids), padded=True)
        states = backend.forward([x.input_ids for x in batch])
        for sample, (aux, final) in zip(batch, states, strict=True):
            for w in writers.values():
                w.add(sample.id, sample.input_ids, sample.loss_mask, aux, final)
    for w in writers.values():
        w.close()
    return {name: HiddenStore(p) for name, p in paths.items()}


def files_bytes(path: Path) -> int:
    skip = {"README.md", "export_summary.json", "export_plan.json", "export_index.jsonl"}
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name not in skip)


def state_errors(store: HiddenStore, ref: HiddenStore) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("aux_hidden_state", "hidden_state"):
        num = den = 0.0
        cos_min, cos_sum, n = 1.0, 0.0, 0
        for sid in ref.ids:
            a, b = store[sid][key].float(), ref[sid][key].float()
            num += float((a - b).pow(2).sum())
            den += float(b.pow(2).sum())
            if key == "aux_hidden_state":  # per layer state: one row per token per layer
                k = a.shape[1] // ref.manifest["hidden_size"]
                a, b = a.reshape(-1, a.shape[1] // k), b.reshape(-1, b.shape[1] // k)
            cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
            cos_min = min(cos_min, float(cos.min()))
            cos_sum += float(cos.sum())
            n += cos.numel()
        out[key] = {
            "relative_error": (num / den) ** 0.5,
            "cosine_mean": cos_sum / n,
            "cosine_min": cos_min,
        }
    return out


def teacher(store: HiddenStore, head: torch.Tensor) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """argmax(lm_head(post-norm final)) = next token at every loss position (t predicts t+1)."""
    hits = total = 0
    argmaxes = []
    for sid in store.ids:
        s = store[sid]
        post = final_state_as(store.manifest, s["hidden_state"], "post_norm").float()
        pred = (post @ head.T).argmax(-1)
        argmaxes.append(pred)
        ids, mask = s["input_ids"], s["loss_mask"]
        target = mask[1:].bool()  # position t predicts token t + 1, a loss token
        hits += int((pred[:-1][target] == ids[1:][target]).sum())
        total += int(target.sum())
    return {"agree": hits, "positions": total, "rate": hits / max(total, 1)}, argmaxes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("runs/fp8"))
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--export-seed", type=int, default=0)
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model_path = str(compose(["model=smollm2"]).model.hf_weights)
    records = out / "records.jsonl"
    if not records.exists():
        text_records(model_path, args.samples, args.length, records)
    backend = HFBackend(model_path, dtype="float32", final_state="pre_norm", model_name="smollm2")
    head = backend.model.get_output_embeddings().weight.detach().float()
    stores = build_stores(backend, records, out)
    tokens = stores["bf16"].total_tokens()
    figures: dict[str, Any] = {
        "model": model_path,
        "samples": len(stores["bf16"]),
        "tokens": tokens,
        "stores": {},
        "exports": {},
    }
    _, bf16_argmax = teacher(stores["bf16"], head)
    _, f32_argmax = teacher(stores["float32"], head)
    for name, store in stores.items():
        agree, argmax = teacher(store, head)
        same = sum(int((a == b).sum()) for a, b in zip(argmax, bf16_argmax, strict=True))
        same32 = sum(int((a == b).sum()) for a, b in zip(argmax, f32_argmax, strict=True))
        figures["stores"][name] = {
            "store_dtype": store.manifest.get("store_dtype", store.manifest["dtype"]),
            "shard_bytes_per_token": files_bytes(store.path / "shards") / tokens,
            "vs_float32": state_errors(store, stores["float32"]),
            "vs_bf16": state_errors(store, stores["bf16"]),
            "teacher_next_token": agree,
            "argmax_equal_to_bf16_store": f"{same}/{tokens}",
            "argmax_equal_to_float32_store": f"{same32}/{tokens}",
        }
    for name in ("bf16", "fp8", "fp8_aux_bf16_final"):
        for ename, (fmt, settings) in EXPORTS.items():
            dest = out / "exports" / name / ename
            if dest.exists():
                shutil.rmtree(dest)
            export([stores[name].path], dest, fmt, args.export_seed, settings=settings)
            figures["exports"].setdefault(name, {})[ename] = files_bytes(dest) / tokens
    (out / "fp8_figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
