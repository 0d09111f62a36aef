"""How often does a target on other numerics call a sampled token impossible?

    .venv/bin/python -m benchmarks.nucleus_margin --truths runs/calibration_truths500.json

Target resolution and the split check treat a token outside the request's top_p nucleus as
impossible (probability 0). The provider sampled with its own numerics (kernels, dtype,
quantization); the target that judges recomputes the distribution with others. A token the
provider drew near the nucleus edge may fall just outside it in the target's sums, and a
proven record would then be flagged (`target_disagrees`), or a true option dropped.

This script takes answers sampled by SmolLM2 in float32 at the cached settings
(`calibrate_resolution.py --truths`), recomputes every sampled token's "mass above it" (the
probability of the tokens ranked higher) in float32 and in bfloat16, and counts the tokens the
judge would call impossible for a range of slacks (`resolve.nucleus_slack`: a token is
impossible when the mass above it is at least top_p + slack). float32 is the sampler's own
numerics (should be 0 at any slack); bfloat16 stands for a provider on other numerics.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent

from kimi_pipe.config import compose  # noqa: E402
from kimi_pipe.core.models import load_model  # noqa: E402
from kimi_pipe.extraction.hf_backend import HFBackend, resolve_model_path  # noqa: E402
from kimi_pipe.stages.jobs.extract import extract_job  # noqa: E402

SLACKS = (0.0, 1e-5, 1e-4, 1e-3, 1e-2, 3e-2)


@torch.inference_mode()
def mass_above(model: Any, prompt: list[int], out: list[int], temperature: float) -> list[float]:
    """For each output token: the probability of the tokens ranked above it."""
    ids = torch.tensor([prompt + out])
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].double()
    probs = torch.softmax(logits / temperature, dim=-1)
    chosen = probs.gather(1, torch.tensor(out)[:, None])
    return (probs * (probs > chosen)).sum(dim=-1).tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--truths", type=Path, required=True, help="calibrate_resolution --truths")
    ap.add_argument("--answers", type=int, default=None, help="use the first N answers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cached = json.loads(args.truths.read_text())
    key, truths = cached["key"], cached["truths"][: args.answers]
    cfg = compose(["model=smollm2"])
    model = load_model(cfg.model)
    path = resolve_model_path(extract_job(cfg))
    from benchmarks.calibrate_resolution import calibration_prompts

    prompts = calibration_prompts(model, len(truths))  # the same questions, in the same order
    judges = {
        d: HFBackend(path, model_name="smollm2", dtype=d).model for d in ("float32", "bfloat16")
    }
    top_p, temperature = float(key["top_p"]), float(key["temperature"])
    figures: dict[str, Any] = {"answers": len(truths), "top_p": top_p, "tokens": 0, "judges": {}}
    per_judge: dict[str, list[list[float]]] = {d: [] for d in judges}
    for n, (prompt, out) in enumerate(zip(prompts, truths, strict=True)):
        for name, judge in judges.items():
            per_judge[name].append(mass_above(judge, prompt, out, temperature))
        figures["tokens"] += len(out)
        if (n + 1) % 50 == 0:
            print(f"[margin] {n + 1}/{len(truths)}", file=sys.stderr, flush=True)
    for name, answers in per_judge.items():
        rows = {}
        for slack in SLACKS:
            tokens = sum(m >= top_p + slack for masses in answers for m in masses)
            hit = sum(any(m >= top_p + slack for m in masses) for masses in answers)
            rows[str(slack)] = {
                "tokens_called_impossible": tokens,
                "answers_with_one_or_more": hit,
                "answer_share": hit / len(answers),
            }
        near = sum(top_p - 1e-2 <= m < top_p for masses in answers for m in masses)
        figures["judges"][name] = {"by_slack": rows, "tokens_within_0.01_below_edge": near}
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
