"""What the logprob check costs beside reconstruction alone, on one core.

    python -m benchmarks.bench_logprobs [--samples 200] [--repeat 3]

The samples are those of bench_reconstruct.py (standard-library prose and code). Each answer
gets whole-output `logprobs.content[]` built from its reconstructed ids, with one
non-canonical split, so the check maps every entry, aligns, finds the split and swaps the
ids in. Both sides run in one process, interleaved, best of --repeat: the ratio is
(reconstruct + apply_logprobs) time over reconstruct time.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from omegaconf import OmegaConf  # noqa: E402

from benchmarks.bench_reconstruct import corpus  # noqa: E402
from kimi_pipe.core.logprobs import LogprobPolicy, apply_logprobs  # noqa: E402
from kimi_pipe.core.models import Model, load_model  # noqa: E402
from kimi_pipe.core.reconstruction import reconstruct  # noqa: E402


def with_logprobs(model: Model, sample: dict) -> dict:
    """The sample's response with the engine's tokens: its ids, one pair re-split."""
    ids = reconstruct(model, sample["messages"], None, sample["response"]).output_ids
    tok = model.tokenizer
    special = set(model.markers.values())
    for i in range(len(ids) - 1):
        a, b = ids[i], ids[i + 1]
        if a in special or b in special:
            continue
        joined = tok.token_bytes(a) + tok.token_bytes(b)
        cuts = (joined[:k] for k in range(1, len(joined)))
        pair = next(
            (
                (x, y)
                for cut in cuts
                if (x := tok.id_of_bytes(cut)) is not None
                and (y := tok.id_of_bytes(joined[len(cut) :])) is not None
                and (x, y) != (a, b)
            ),
            None,
        )
        if pair:
            ids = ids[:i] + list(pair) + ids[i + 2 :]
            break
    entries = [{"token": "", "bytes": list(tok.token_bytes(t)), "logprob": -1.0} for t in ids]
    for entry, t in zip(entries, ids, strict=True):
        entry["token"] = tok.token_bytes(t).decode("utf-8", "replace")
    choice = dict(sample["response"]["choices"][0], logprobs={"content": entries})
    return {**sample["response"], "choices": [choice], "usage": {"completion_tokens": len(ids)}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    model = load_model(OmegaConf.load(Path(__file__).parent.parent / "conf/model/kimi_k25.yaml"))
    samples = corpus(args.samples)
    responses = [with_logprobs(model, s) for s in samples]
    policy = LogprobPolicy()

    def plain() -> None:
        for s, r in zip(samples, responses, strict=True):
            reconstruct(model, s["messages"], None, r)

    def checked() -> list[bool]:
        out = []
        for s, r in zip(samples, responses, strict=True):
            rec = apply_logprobs(model, reconstruct(model, s["messages"], None, r), r, policy)
            out.append("noncanonical_split" in rec.issues and rec.ok)
        return out

    recovered = checked()
    plain()
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        plain()
        t1 = time.perf_counter()
        checked()
        times.append((t1 - t0, time.perf_counter() - t1))
    base, full = min(t[0] for t in times), min(t[1] for t in times)
    tokens = sum(len(r["choices"][0]["logprobs"]["content"]) for r in responses)
    print(f"samples={len(samples)} output tokens={tokens:,} (one core, best of {args.repeat})")
    print(f"splits recovered exactly      : {sum(recovered)}/{len(recovered)}")
    print(f"reconstruct alone             : {base:.3f} s")
    print(f"reconstruct + apply_logprobs  : {full:.3f} s")
    print(f"ratio (with check / without)  : {full / base:.3f}")


if __name__ == "__main__":
    main()
