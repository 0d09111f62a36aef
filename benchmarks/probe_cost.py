"""Cost of one conformance-probe battery per provider, in tokens and USD.

    python -m benchmarks.probe_cost [--battery conf/probes/kimi_k25.yaml] \
        [--input-usd-per-mtok 0.60] [--output-usd-per-mtok 3.00] [--typical-output 400]

Prompt tokens are exact (the model's tokenizer on the rendered chat template, what a
provider bills). Output tokens are not known before buying: the worst case is the battery's
`max_tokens` per probe (what the budget reserves); `--typical-output` is an assumption for a
short reasoning answer, printed as such.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import OmegaConf

from kimi_pipe.config import CONF_DIR
from kimi_pipe.conformance.probe import load_battery
from kimi_pipe.core.models import load_model
from kimi_pipe.core.prompt_render import prompt_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--battery", default=str(CONF_DIR / "probes" / "kimi_k25.yaml"))
    ap.add_argument("--model", default="kimi_k25")
    ap.add_argument("--input-usd-per-mtok", type=float, default=0.60)
    ap.add_argument("--output-usd-per-mtok", type=float, default=3.00)
    ap.add_argument("--typical-output", type=int, default=400)
    args = ap.parse_args()
    battery = load_battery(Path(args.battery))
    model = load_model(OmegaConf.load(CONF_DIR / "model" / f"{args.model}.yaml"))
    total_prompt = 0
    for probe in battery.probes:
        n = len(prompt_ids(model, probe["messages"], probe.get("tools")))
        total_prompt += n
        print(f"{probe['id']:24s} prompt {n:5d} tokens")
    n_probes = len(battery.probes)
    worst_out = n_probes * battery.max_tokens
    typical_out = n_probes * args.typical_output
    pin, pout = args.input_usd_per_mtok / 1e6, args.output_usd_per_mtok / 1e6
    print(f"battery: {n_probes} probes, {total_prompt} prompt tokens per provider")
    print(
        f"worst case ({battery.max_tokens} output tokens each): {worst_out} output tokens, "
        f"${total_prompt * pin + worst_out * pout:.4f} per provider"
    )
    print(
        f"assumed typical ({args.typical_output} output tokens each): {typical_out} output "
        f"tokens, ${total_prompt * pin + typical_out * pout:.4f} per provider"
    )
    print(f"prices used: ${args.input_usd_per_mtok}/M input, ${args.output_usd_per_mtok}/M output")


if __name__ == "__main__":
    main()
