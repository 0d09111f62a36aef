"""Load an export with SpecForge's OWN offline reader for one strategy; never imports kimi_pipe.

Runs in a venv holding SpecForge (a current commit, installed with `pip install --no-deps`;
docs/export.md, "DFlash family and DSpark"). The path is the one `specforge train` takes in
offline mode (`specforge/launch.py`): the strategy's registration from
`builtin_algorithm_registry()`, its offline provider's `build_reader(...).read()` (the
`OfflineManifestReader` over `rows_*/data_*.ckpt[.gz]`), its normaliser as the per-sample
transform and its collator, through `FeatureDataLoader` over a `LocalFeatureStore`, one sample
a batch, every sample. With `--draft-config` it also asks the strategy's model provider which
layers it would capture for that config (`resolve_capture_layers`).

Writes `--out` (JSON: counts, tensor names, shapes and dtypes per batch, the capture layers)
and `--tensors` (torch.save: {file relative to the export: {tensor name: tensor as the loader
handed it}}), for the caller to compare with the store.

    VENV/bin/python -m tools.specforge_offline_check --export DIR --strategy dflash \
        --draft-config CONFIG.json --out result.json --tensors loaded.pt
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--draft-config", default=None)
    parser.add_argument("--max-len", type=int, default=1 << 20)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tensors", default=None)
    args = parser.parse_args(argv)

    import specforge
    import torch
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    algorithm = builtin_algorithm_registry().resolve(args.strategy)
    provider = algorithm.providers.offline_for("text")
    ttt_length = 7
    refs = provider.build_reader(
        args.export, run_id="kimi", ttt_length=ttt_length, max_len=args.max_len
    ).read()
    files = {ref.sample_id: ref.feature_store_uri.removeprefix("file://") for ref in refs}
    loader = FeatureDataLoader(
        LocalFeatureStore("kimi"),
        refs=refs,
        batch_size=1,
        collate_fn=provider.build_collator(),
        per_sample_transform=provider.build_normalizer(
            args.max_len, ttt_length=ttt_length, use_usp_preprocess=False
        ),
        drop_last=False,
        strategy=args.strategy,
        num_workers=0,
    )
    root = Path(args.export).resolve()
    loaded: dict[str, dict[str, Any]] = {}
    batches: list[dict[str, Any]] = []
    for batch in loader:
        (sample_id,) = batch.sample_ids
        rel = str(Path(files[sample_id]).resolve().relative_to(root))
        loaded[rel] = {k: v.detach().cpu() for k, v in batch.tensors.items()}
        batches.append(
            {
                "file": rel,
                "tensors": {
                    k: [list(v.shape), str(v.dtype).removeprefix("torch.")]
                    for k, v in batch.tensors.items()
                },
            }
        )
    result: dict[str, Any] = {
        "specforge_version": getattr(specforge, "__version__", None),
        "specforge_source": os.path.dirname(specforge.__file__),
        "strategy": args.strategy,
        "normalizer_id": provider.normalizer_id,
        "reader_refs": len(refs),
        "loaded_batches": len(batches),
        "batches": batches,
    }
    if args.draft_config:
        draft = json.loads(Path(args.draft_config).read_text())
        capture = algorithm.providers.model.resolve_capture_layers(None, draft, None)
        result["capture_layers_from_draft_config"] = [int(i) for i in capture]
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.tensors:
        torch.save(loaded, args.tensors)
    print(
        f"specforge {args.strategy}: {len(refs)} files listed, {len(batches)} loaded "
        f"({provider.normalizer_id})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
