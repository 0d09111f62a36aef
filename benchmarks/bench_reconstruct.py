"""Reconstruction throughput on one core, beside raw tiktoken encoding of the same text.

    python -m benchmarks.bench_reconstruct [--samples 400] [--repeat 3]

Both sides encode exactly the same strings (prompt text, reasoning, content, tool-call
arguments) with the same tiktoken Encoding object; the ratio is reconstruct tokens/s over
raw tokens/s, measured in one process, interleaved, best of --repeat runs each. The raw side
keeps an answer's ids until its last string is encoded, as a record keeps them (`--raw-free`:
each list freed at once, as before 2026-12-06). Text comes from the Python standard library
sources and docstrings (prose, code, whitespace), deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sysconfig
import time
from pathlib import Path

from omegaconf import OmegaConf  # noqa: E402

from kimi_pipe.core.models import load_model  # noqa: E402
from kimi_pipe.core.reconstruction import reconstruct  # noqa: E402


def corpus(n: int, seed: int = 0) -> list[dict]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files[:200]]
    rng = random.Random(seed)
    samples = []

    def pick(size: int) -> str:
        text = rng.choice(texts)
        start = rng.randrange(max(1, len(text) - size))
        return text[start : start + size]

    for i in range(n):
        call = []
        if i % 4 == 0:
            call = [
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": "run_code", "arguments": json.dumps({"code": pick(600)})},
                }
            ]
        samples.append(
            {
                "messages": [
                    {"role": "system", "content": "You are a coding assistant."},
                    {"role": "user", "content": pick(1500)},
                ],
                "response": {
                    "choices": [
                        {
                            "message": {
                                "reasoning": pick(6000),
                                "content": pick(3000),
                                "tool_calls": call,
                            },
                            "finish_reason": "stop",
                        }
                    ]
                },
            }
        )
    return samples


def raw_strings(sample: dict) -> list[str]:
    message = sample["response"]["choices"][0]["message"]
    out = [m["content"] for m in sample["messages"]] + [message["reasoning"], message["content"]]
    out += [c["function"]["arguments"] for c in message["tool_calls"]]
    return out


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=3)
    # record: the one reconstruction entry the stages call (logprobs, candidate sets of
    # flagged answers, evidence rung), instead of core reconstruct alone.
    parser.add_argument("--entry", choices=("reconstruct", "record"), default="reconstruct")
    parser.add_argument("--raw-free", action="store_true", help="raw: free each id list at once")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    model = load_model(OmegaConf.load(Path(__file__).parent.parent / "conf/model/kimi_k25.yaml"))
    samples = corpus(args.samples)
    encode = model.tokenizer.encode_ordinary
    answers = [raw_strings(sample) for sample in samples]
    strings = [s for answer in answers for s in answer]
    tokens = sum(len(encode(s)) for s in strings)

    def run_raw_kept() -> None:
        # An answer's ids live until its record is built, as reconstruct's do. Freed at once,
        # each list's ints go back to memory the next encode reuses while it is still in the
        # CPU cache: about 2-3 % faster than any caller that keeps its ids (benchmarks/README.md).
        for answer in answers:
            [encode(s) for s in answer]

    def run_raw_free() -> None:
        for s in strings:
            encode(s)

    run_raw = run_raw_free if args.raw_free else run_raw_kept

    if args.entry == "record":
        from kimi_pipe.core.record_builder import RecordBuilder

        build = RecordBuilder(model).build

        def run_reconstruct() -> None:
            for sample in samples:
                build(sample["messages"], None, sample["response"])

    else:

        def run_reconstruct() -> None:
            for sample in samples:
                reconstruct(model, sample["messages"], None, sample["response"])

    run_raw(), run_reconstruct()  # warm caches
    # Interleaved, best of each: a load change on the machine hits both sides alike.
    pairs = [(timed(run_raw), timed(run_reconstruct)) for _ in range(args.repeat)]
    raw, rec = min(p[0] for p in pairs), min(p[1] for p in pairs)
    print(f"samples={len(samples)} text tokens={tokens:,} (one core, best of {args.repeat})")
    kept = "each list freed at once" if args.raw_free else "ids kept per answer"
    print(f"raw tiktoken encode_ordinary : {tokens / raw:12,.0f} tokens/s ({kept})")
    print(f"kimi_pipe {args.entry:<19}: {tokens / rec:12,.0f} tokens/s")
    print(f"ratio reconstruct/raw        : {raw / rec:.3f}")


if __name__ == "__main__":
    main()
