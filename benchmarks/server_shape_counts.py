"""Exact / repaired / flagged counts per server variant of the committed corpus.

    python -m benchmarks.server_shape_counts     # prints README's table (markdown)

For every record of tests/fixtures/server_shapes/*.jsonl: reconstruct under the default
`unknown` profile and under the stack's declared profile, and count exact (ok, no note),
repaired (ok with a note), flagged (ok false) and `ok` but wrong (must be 0).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parent.parent

from kimi_pipe.config import compose  # noqa: E402
from kimi_pipe.core.models import load_model  # noqa: E402
from kimi_pipe.core.reconstruction import reconstruct  # noqa: E402
from kimi_pipe.core.serving import ServingProfile  # noqa: E402

SHAPES = ROOT / "tests" / "fixtures" / "server_shapes"
PROFILE_OF_VERSION = {
    "0.15.1": "vllm_0_15",
    "0.33.0": "vllm_0_33",
    "0.34.0": "vllm_0_34",
    "0.5.14": "sglang_0_5_14",
    "0.5.23": "sglang_0_5_23",
}


def shipped(name: str) -> ServingProfile:
    return ServingProfile.from_config(OmegaConf.to_container(compose([f"serving={name}"]).serving))


def declared(record: dict) -> ServingProfile:
    overrides = {}
    if not record["settings"].get("spaces_between_special_tokens"):
        overrides["marker_spacing"] = "none"
    if record["settings"].get("ids") == "call_":
        overrides["tool_call_ids"] = "foreign"
    if record["settings"].get("stream") and record["version"] == "0.5.14":
        overrides["tool_call_ids"] = "conversation"
    if record["settings"].get("stream") and record["version"] == "0.15.1":
        # Streaming: the space before a marker leaves with the marker's delta; the tool
        # parser streams the model's own id.
        overrides["tool_call_ids"] = "model"
        if record["settings"].get("spaces_between_special_tokens"):
            overrides["marker_spacing"] = "leading"
    return replace(shipped(PROFILE_OF_VERSION[record["version"]]), **overrides)


def main() -> int:
    model = load_model(compose([]).model)
    unknown = ServingProfile()
    print("| variant | records | `unknown`: exact / repaired / flagged "
          "| declared: exact / repaired / flagged | `ok` but wrong |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for path in sorted(SHAPES.glob("*.jsonl")):
        counts: dict[str, Counter[str]] = {"unknown": Counter(), "declared": Counter()}
        silent = 0
        records = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x]
        for r in records:
            for mode, profile in (("unknown", unknown), ("declared", declared(r))):
                rec = reconstruct(model, r["messages"], r.get("tools"), r["response"],
                                  serving=profile)  # fmt: skip
                if not rec.ok:
                    counts[mode]["flagged"] += 1
                else:
                    counts[mode]["repaired" if rec.issues else "exact"] += 1
                    silent += rec.output_ids != r["ground_truth_output_ids"]
        cell = {m: " / ".join(str(c[k]) for k in ("exact", "repaired", "flagged"))
                for m, c in counts.items()}  # fmt: skip
        print(f"| `{path.stem}` | {len(records)} | {cell['unknown']} | {cell['declared']} "
              f"| {silent} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
