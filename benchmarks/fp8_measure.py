"""Is an fp8 store as good as bf16? Measured on the demo model (SmolLM2-135M, real weights).

    .venv/bin/python -m benchmarks.fp8_measure --out runs/fp8 [--max-new-tokens 160]

1. Records: `--samples` chunks of `--length` tokens of real English text (this repository's
   README and docs, SmolLM2's tokenizer), the first quarter as context (loss mask 0). Not the
   model's own answers (generating them took too long on the shared CPU): the comparison of
   stores needs the same tokens for each, and the teacher agreement is reported both as
   "argmax = next token" and as "argmax = the float32 / bf16 store's argmax".
2. Stores from one capture (the hf backend's forward, pre-norm final state, written by the
   store's own `StoreWriter` into each): float32 (the reference), bfloat16 (the default),
   fp8_e4m3 for both states (round to nearest, and keeping the teacher: the writer gets the
   LM head, kimi_pipe.store.teacher_rounding), fp8 aux + bf16 final.
   (benchmarks/bench_extract.py times the whole extract stage with fp8 storage.)
3. Per state: relative error ||x - ref|| / ||ref|| and cosine per token against float32 and
   against bf16; teacher agreement: argmax of the LM head on the post-norm final state (the
   export's own conversion, `final_state_as`) = the next token, at every loss position.
4. Exports of every store in every format (SpecForge plain and gzip'ed, speculators bf16 and
   fp8, ModelOpt, tokens): bytes per token of each directory's files.

Writes OUT/fp8_figures.json and prints it; the speculators exports feed
benchmarks/drafter_cpu.py (the drafter trained on each, in the trainers' venv).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kimi_pipe.config import DATA_DIR, compose
from kimi_pipe.exporters import export
from kimi_pipe.extraction.hf_backend import HFBackend
from kimi_pipe.store.conventions import final_state_as
from kimi_pipe.store.hidden_store import (
    FP8_MAX,
    HiddenStore,
    dequantize_rows,
    quantize_rows,
)

STORES = {  # name: (dtype, final dtype, keep the teacher: the writer gets the LM head)
    "float32": ("float32", None, False),
    "bf16": ("bfloat16", None, False),
    "fp8": ("fp8_e4m3", None, False),
    "fp8_keep_teacher": ("fp8_e4m3", None, True),
    "fp8_aux_bf16_final": ("fp8_e4m3", "bfloat16", False),
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


def build_stores(
    backend: HFBackend, records: Path, out: Path
) -> tuple[dict[str, HiddenStore], dict[str, Any]]:
    """One forward per batch, the same states written into every store (StoreWriter, the
    store code the extract stage uses): the stores differ only in how they keep the states."""
    from collections import deque

    from kimi_pipe.extraction.capture import TokenBudget, next_batch
    from kimi_pipe.extraction.token_samples import read_token_records
    from kimi_pipe.store.hidden_store import StoreWriter, make_manifest

    paths = {name: out / f"store_{name}" for name in STORES}
    if all((p / "tokens").exists() for p in paths.values()):
        return {name: HiddenStore(p) for name, p in paths.items()}, {}
    samples, _ = read_token_records(records)
    writers = {}
    head = backend.output_head()
    for name, (dtype, final_dtype, keep_teacher) in STORES.items():
        shutil.rmtree(paths[name], ignore_errors=True)
        fields = {**backend.store_fields, "dtype": dtype}
        manifest = make_manifest(
            **fields,
            final_dtype=final_dtype,
            loss_mask="prompt 0, answer 1",
            source_runs=[str(out.resolve())],
            backend="hf",
        )
        writers[name] = StoreWriter(
            paths[name], manifest, head_weight=head if keep_teacher else None
        )
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
    rounding = {n: w.rounding.as_dict() for n, w in writers.items() if w.teacher is not None}
    return {name: HiddenStore(p) for name, p in paths.items()}, rounding


def files_bytes(path: Path) -> int:
    skip = {"README.md", "export_summary.json", "export_plan.json", "export_index.jsonl"}
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name not in skip)


# Scale layouts compared in memory on the float32 capture (the store writes the first; the
# second is hs-connectors' FP8 file layout; the third a power-of-two scale per row, as MX
# formats' E8M0 scales). Each returns the states as a bf16 reader gets them.
def fp8_per_row(aux: torch.Tensor, final: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    qa, sa = quantize_rows(aux, k)
    qf, sf = quantize_rows(final, 1)
    return dequantize_rows(qa, sa, torch.bfloat16), dequantize_rows(qf, sf, torch.bfloat16)


def fp8_per_row_pow2(aux: torch.Tensor, final: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    def one(x: torch.Tensor, rows: int) -> torch.Tensor:
        r = x.float().reshape(x.shape[0], rows, -1)
        amax = r.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))  # amax/scale in (224, 448]
        q = (r / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return (q.float() * scale).reshape(x.shape).to(torch.bfloat16)

    return one(aux, k), one(final, 1)


def fp8_per_token(aux: torch.Tensor, final: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    t, h = final.shape
    both = torch.cat([aux.float().reshape(t, k, h), final.float().reshape(t, 1, h)], dim=1)
    amax = both.abs().amax(dim=(1, 2), keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    back = ((both / scale).to(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16)
    return back[:, :k].reshape(t, k * h), back[:, k]


SCALE_LAYOUTS = {
    "fp8_per_row_f32_scale": (fp8_per_row, "4 x 4 B (one float32 per state)"),
    "fp8_per_row_pow2_scale": (fp8_per_row_pow2, "4 x 1 B (one exponent per state)"),
    "fp8_per_token_f32_scale": (fp8_per_token, "1 x 4 B (hs-connectors' layout)"),
}


class Errors:
    """Per state: relative error ||x - ref|| / ||ref|| and per-token cosine, accumulated."""

    def __init__(self) -> None:
        self.acc: dict[str, list[float]] = {}

    def add(self, name: str, x: torch.Tensor, ref: torch.Tensor) -> None:
        x, ref = x.float(), ref.float()
        cos = torch.nn.functional.cosine_similarity(x, ref, dim=-1)
        a = self.acc.setdefault(name, [0.0, 0.0, 0.0, 1.0, 0.0])
        a[0] += float((x - ref).pow(2).sum())
        a[1] += float(ref.pow(2).sum())
        a[2] += float(cos.sum())
        a[3] = min(a[3], float(cos.min()))
        a[4] += cos.numel()

    def result(self) -> dict[str, Any]:
        return {
            k: {
                "relative_error": (a[0] / a[1]) ** 0.5,
                "cosine_mean": a[2] / a[4],
                "cosine_min": a[3],
            }
            for k, a in self.acc.items()
        }


class Teacher:
    """argmax(lm_head(post-norm final)) at every loss position (t predicts token t + 1):
    equal to the next token, and equal to the float32 / bf16 capture's argmax."""

    def __init__(self) -> None:
        self.next_token = self.positions = self.as_f32 = self.as_bf16 = 0

    def add(self, pred: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, f32, bf16) -> None:
        at = mask[1:].bool()
        p = pred[:-1][at]
        self.next_token += int((p == ids[1:][at]).sum())
        self.as_f32 += int((p == f32[:-1][at]).sum())
        self.as_bf16 += int((p == bf16[:-1][at]).sum())
        self.positions += int(at.sum())

    def result(self) -> dict[str, Any]:
        n = max(self.positions, 1)
        return {
            "positions": self.positions,
            "argmax_is_next_token": self.next_token,
            "rate": self.next_token / n,
            "argmax_equal_to_float32": self.as_f32,
            "argmax_equal_to_bf16": self.as_bf16,
        }


def compare(stores: dict[str, HiddenStore], head: torch.Tensor) -> dict[str, Any]:
    """Every store and every in-memory scale layout against the float32 and bf16 stores."""
    ref_store = stores["float32"]
    manifest = ref_store.manifest
    hidden, layer_ids = manifest["hidden_size"], manifest["layer_ids"]
    k = len(layer_ids)
    names = [*stores, *SCALE_LAYOUTS]
    vs_f32 = {n: Errors() for n in names}
    vs_bf16 = {n: Errors() for n in names}
    teach = {n: Teacher() for n in names}

    def post(final: torch.Tensor) -> torch.Tensor:
        return final_state_as(manifest, final.float(), "post_norm")

    for sid in ref_store.ids:
        ref = ref_store[sid]
        ids, mask = ref["input_ids"], ref["loss_mask"]
        states = {
            n: (s[sid]["aux_hidden_state"], s[sid]["hidden_state"]) for n, s in stores.items()
        }
        for n, (fn, _) in SCALE_LAYOUTS.items():
            states[n] = fn(ref["aux_hidden_state"], ref["hidden_state"], k)
        argmax = {n: (post(f) @ head.T).argmax(-1) for n, (_, f) in states.items()}
        for n, (aux, final) in states.items():
            for errs, base in ((vs_f32[n], states["float32"]), (vs_bf16[n], states["bf16"])):
                for i, layer in enumerate(layer_ids):
                    cut = slice(i * hidden, (i + 1) * hidden)
                    errs.add(f"aux_layer_{layer}", aux[:, cut], base[0][:, cut])
                errs.add("final_pre_norm", final, base[1])
                errs.add("final_post_norm", post(final), post(base[1]))
            teach[n].add(argmax[n], ids, mask, argmax["float32"], argmax["bf16"])
    return {
        n: {
            "vs_float32": vs_f32[n].result(),
            "vs_bf16": vs_bf16[n].result(),
            "teacher": teach[n].result(),
        }
        for n in names
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("runs/fp8"))
    ap.add_argument(
        "--records", type=Path, default=None, help="token records (e.g. the demo's records.jsonl)"
    )
    ap.add_argument("--samples", type=int, default=48, help="text chunks when no --records")
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--export-seed", type=int, default=0)
    ap.add_argument("--no-exports", action="store_true")
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model_path = str(compose(["model=smollm2"]).model.hf_weights)
    records = out / "records.jsonl"
    if args.records is not None:
        shutil.copyfile(args.records, records)
    elif not records.exists():
        text_records(model_path, args.samples, args.length, records)
    backend = HFBackend(model_path, dtype="float32", final_state="pre_norm", model_name="smollm2")
    head = backend.model.get_output_embeddings().weight.detach().float()
    started = time.monotonic()
    stores, rounding = build_stores(backend, records, out)
    capture_s = time.monotonic() - started
    tokens = stores["bf16"].total_tokens()
    h = stores["bf16"].manifest["hidden_size"]
    figures: dict[str, Any] = {
        "model": model_path,
        "records": str(args.records or f"text chunks: {args.samples} x {args.length} tokens"),
        "samples": len(stores["bf16"]),
        "tokens": tokens,
        "hidden_size": h,
        "capture_s": round(capture_s, 1),
        "load_average_start": os.getloadavg(),
        "store_bytes_per_token": {
            n: files_bytes(s.path / "shards") / tokens for n, s in stores.items()
        },
        "scale_layouts": {n: d for n, (_, d) in SCALE_LAYOUTS.items()},
        "final_fp8_rounding": rounding,
        "compare": compare(stores, head),
        "exports": {},
    }
    for name in (
        () if args.no_exports else ("bf16", "fp8", "fp8_keep_teacher", "fp8_aux_bf16_final")
    ):
        for ename, (fmt, settings) in EXPORTS.items():
            dest = out / "exports" / name / ename
            if dest.exists():
                shutil.rmtree(dest)
            export([stores[name].path], dest, fmt, args.export_seed, settings=settings)
            figures["exports"].setdefault(name, {})[ename] = files_bytes(dest) / tokens
    figures["load_average_end"] = os.getloadavg()
    (out / "fp8_figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
