"""Yield of generate's default flow (serving=auto) against `serving=unknown`, per imitated stack.

    .venv/bin/python -m benchmarks.serving_auto_yield [--n 50] \
        [--stacks exact_plain,exact_whole,sglang_0514,vllm_spaced]

For each stack of tests/support/fake_stacks.py (behind its fake_openrouter.py, real HTTP, real Kimi
tokenizer from KIMI_TOKENIZER_DIR or ../shared), N prompts are bought twice into fresh run
dirs: once with no profile named (serving=auto: probes, pinning, fitted profile) and once
with `serving=unknown`, both pinned to the stack and asking for logprobs without requiring
them (as the probes and a sweep do). Prints per stack: the fitted profile, records ok /
answered under each, silent records (ok but ids differ from the ids the imitated model
emitted), and what the probes cost against the answers. `exact_plain` is a stack that
changes nothing and sends no logprobs (no sampled splits: without logprobs those cannot be
seen by anyone).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    from kimi_pipe.config import compose
    from kimi_pipe.core.models import load_model
    from kimi_pipe.stages.generate import generate
    from tests.support.conftest_generate import FAKE_KEY, base_overrides, read_jsonl, write_prompts
    from tests.support.fake_openrouter import Behaviour, KimiCounter
    from tests.support.fake_stacks import Stack, routed_fake, stacks

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--stacks", default="exact_plain,exact_whole,sglang_0514,vllm_spaced")
    args = ap.parse_args()
    os.environ["OPENROUTER_API_KEY"] = FAKE_KEY
    tok = Path(os.environ.get("KIMI_TOKENIZER_DIR") or REPO.parent / "shared/tokenizers/kimi-k2.5")
    kimi = load_model(compose([f"model.tokenizer.path={tok}"]).model)
    counter = KimiCounter(kimi)
    all_stacks = stacks(kimi)
    all_stacks["exact_plain"] = Stack(kimi, "exact_plain", splits=0)
    behaviours = {
        name: Behaviour(provider_name=name, counter=counter, stack=stack)
        for name, stack in all_stacks.items()
    }
    srv = routed_fake(Behaviour(counter=counter), behaviours)
    tmp = Path(tempfile.mkdtemp(prefix="serving_auto_yield_"))
    os.environ["XDG_CACHE_HOME"] = str(tmp / "cache")
    prompts = tmp / "prompts.jsonl"
    write_prompts(
        prompts, args.n, tools_every=3, text=lambda i: f"Question {i}: call calc for {i}."
    )
    print(
        "| stack | fitted profile | auto: ok / answered | unknown: ok / answered "
        "| silent (auto, unknown) | probes USD / answers USD |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    try:
        for name in args.stacks.split(","):
            row = {}
            for mode in ("auto", "unknown"):
                out = tmp / name / mode
                overrides = [
                    o
                    for o in base_overrides(prompts, srv.url(), out, tok)
                    if o != "serving=unknown"
                ]
                overrides += [
                    # Pinned in both modes (the fake routes by the order); logprobs asked for
                    # without requiring them, as the probes and a sweep do.
                    f"provider.routing.only=[{name}]",
                    f"provider.routing.order=[{name}]",
                    "++provider.params.logprobs=true",
                    "provider.routing.require_parameters=false",
                    f"serving={mode}",
                ]
                before = srv.total_cost()
                status, summary = generate(compose(overrides), out)
                records = read_jsonl(out / "records.jsonl")
                truth = all_stacks[name].emitted
                ok = sum(bool(r["ok"]) for r in records)
                silent = sum(
                    bool(r["ok"]) and r["output_ids"] != truth[r["messages"][-1]["content"]]
                    for r in records
                )
                row[mode] = (
                    status,
                    ok,
                    len(records),
                    silent,
                    srv.total_cost() - before,
                    summary["spend_usd_records"] if summary else 0.0,
                )
                if mode == "auto":
                    fitted = json.loads((out / "serving_auto.json").read_text())
                    row["profile"] = fitted["providers"][name]["profile"]
            a, u = row["auto"], row["unknown"]
            print(
                f"| {name} | {row['profile']} | {a[1]} / {a[2]} | {u[1]} / {u[2]} | {a[3]}, {u[3]} "
                f"| {a[4] - a[5]:.5f} / {a[5]:.5f} |"
            )
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
