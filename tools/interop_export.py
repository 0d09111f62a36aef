"""Make the exports `make interop` checks with the trainers' own loaders (tools/interop.sh).

    python -m tools.interop_export --run RUN --out RUN/interop

RUN is a demo run (records.jsonl, hidden_hf = pre-norm store with its final norm,
hidden_post = the same records extracted with extract.final_state=post_norm). Writes into OUT:

* specforge/, speculators/, modelopt/, tokens/: the four formats from the pre-norm store;
* specforge-gz/, speculators-fp8/: SpecForge's gzip'ed files, speculators' fp8 files;
* fp8store-*: every format from RUN/hidden_fp8 (the same records, fp8, teacher kept),
  when it exists;
* relabeled-*: the same states with a manifest stating "input of layer" ids [2, 15, 27]
  (the same tensors): the exporters must rename the ids per trainer;
* wrong-offbyone-*: a manifest that claims the states are the outputs of layers [2, 15, 27]
  (they are the outputs of [1, 14, 26]) and wrong-prenorm-specforge: a manifest that calls the
  pre-norm state post-norm. Nothing in the files can tell; the numeric checks must catch both;
* refusals.json: exports that must be refused (pre-norm without the norm for SpecForge,
  post-norm for speculators), with the messages;
* store_figures.json: disk of both stores, and post-norm computed at export vs captured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from kimi_pipe.exporters import FORMATS, export
from kimi_pipe.store.conventions import ConventionError, final_state_as
from kimi_pipe.store.hidden_store import FP8, MANIFEST, HiddenStore


def relabel(store: Path, dest: Path, **changes: Any) -> Path:
    """A copy of `store` (shards hard-linked) whose manifest says something else."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(store, dest, copy_function=os.link)
    manifest = json.loads((store / MANIFEST).read_text())
    for key, value in changes.items():
        if value is None:
            manifest.pop(key, None)
        else:
            manifest[key] = value
    (dest / MANIFEST).unlink()  # a hard link: do not write through it into the original
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return dest


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def store_figures(pre: HiddenStore, post: HiddenStore) -> dict[str, Any]:
    """Post-norm computed at export from the stored (bf16) pre-norm state vs captured post-norm."""
    max_abs = 0.0
    max_ulps = 0.0
    differ = total = 0
    for sid in pre.ids:
        computed = final_state_as(pre.manifest, pre[sid]["hidden_state"], "post_norm").float()
        captured = post[sid]["hidden_state"].float()
        diff = (computed - captured).abs()
        ulp = torch.finfo(torch.bfloat16).eps * captured.abs().clamp_min(1e-30)
        max_abs = max(max_abs, float(diff.max()))
        max_ulps = max(max_ulps, float((diff / ulp).max()))
        differ += int((diff > 0).sum())
        total += diff.numel()
    tokens = pre.total_tokens()
    return {
        "tokens": tokens,
        "store_bytes_pre_norm_with_norm": du(pre.path / "shards"),
        "store_bytes_post_norm": du(post.path / "shards"),
        "manifest_bytes_pre_norm_with_norm": (pre.path / MANIFEST).stat().st_size,
        "bytes_per_token_either": du(pre.path / "shards") / tokens,
        "bytes_per_token_if_both_kept": du(pre.path / "shards") / tokens * 5 / 4,
        "post_norm_export_vs_captured_max_abs": max_abs,
        "post_norm_export_vs_captured_max_bf16_ulps": max_ulps,
        "post_norm_export_vs_captured_values_differing": f"{differ}/{total}",
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    good = args.run / "hidden_hf"
    stores = out / "stores"
    manifest = HiddenStore(good).manifest
    if manifest["final_state"] != "pre_norm" or "final_norm" not in manifest:
        raise SystemExit(f"{good} must be a pre-norm store with its final norm (current extract)")
    ids = manifest["layer_ids"]
    for fmt in FORMATS:
        export([good], out / fmt, fmt, seed=0)
    # The files' compact layouts: SpecForge's .ckpt.gz, speculators' fp8 files (hs-connectors).
    export([good], out / "specforge-gz", "specforge", seed=0, settings={"compress": True})
    export([good], out / "speculators-fp8", "speculators", seed=0, settings={"dtype": FP8})
    # An fp8 store (final state rounded to keep the teacher): every format, dequantized at
    # export. Not its speculators fp8 files: quantized twice (per row, then per token over
    # states of different magnitudes), 95.4 % of their aux values were within one e4m3
    # rounding of the forward (docs/export.md); speculators' fp8 files come from a bf16 store.
    compact = args.run / "hidden_fp8"
    if compact.exists():
        for fmt in FORMATS:
            export([compact], out / f"fp8store-{fmt}", fmt, seed=0)
    relabeled = relabel(
        good,
        stores / "relabeled",
        layer_ids=[i + 1 for i in ids],
        layer_convention="input_of_layer",
    )
    for fmt in ("specforge", "speculators"):
        export([relabeled], out / f"relabeled-{fmt}", fmt, seed=0)
    off = relabel(good, stores / "offbyone", layer_ids=[i + 1 for i in ids])
    for fmt in ("specforge", "speculators"):
        export([off], out / f"wrong-offbyone-{fmt}", fmt, seed=0)
    lying = relabel(good, stores / "prenorm-called-post", final_state="post_norm", final_norm=None)
    export([lying], out / "wrong-prenorm-specforge", "specforge", seed=0)

    refusals: dict[str, str] = {}
    bare = relabel(good, stores / "prenorm-without-norm", final_norm=None)
    cases = [(bare, "specforge"), (bare, "modelopt"), (args.run / "hidden_post", "speculators")]
    for store, fmt in cases:
        name = f"{store.name}->{fmt}"
        try:
            export([store], out / "refused" / name, fmt)
            refusals[name] = "NOT REFUSED"
        except ConventionError as exc:
            refusals[name] = f"refused: {exc}"
    (out / "refusals.json").write_text(json.dumps(refusals, indent=2) + "\n")
    figures = store_figures(HiddenStore(good), HiddenStore(args.run / "hidden_post"))
    (out / "store_figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps({"refusals": refusals, "store_figures": figures}, indent=2))
    return 1 if any(v == "NOT REFUSED" for v in refusals.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
