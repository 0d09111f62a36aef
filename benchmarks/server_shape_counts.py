"""Exact / repaired / flagged counts per server variant of the committed corpus.

    python -m benchmarks.server_shape_counts     # prints README's table (markdown)

For every record of tests/fixtures/server_shapes/*.jsonl: reconstruct under the default
`unknown` profile and under the stack's declared profile, and count exact (ok, no note),
repaired (ok with a note), flagged (ok false) and `ok` but wrong (must be 0).
"""

from __future__ import annotations

import json
from collections import Counter

from kimi_pipe.config import compose
from kimi_pipe.core.models import load_model
from kimi_pipe.core.reconstruction import reconstruct
from kimi_pipe.core.serving import ServingProfile
from tests.support.server_shapes import SHAPES, declared_profile


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
            for mode, profile in (("unknown", unknown), ("declared", declared_profile(r))):
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
