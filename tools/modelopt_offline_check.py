"""Load a `modelopt` export with ModelOpt's OWN offline reader for DFlash; never imports kimi_pipe.

Runs in a venv holding nvidia-modelopt (a current commit, `pip install --no-deps`; docs/export.md).
ModelOpt's DFlash trains offline from the same `.pt` dumps as its EAGLE-3:
`OfflineSupervisedDataset` reads each file (here with `answer_only_loss=True`, which takes the
stored `loss_mask`), and `DFlashBaseModelOutput.from_offline_dict` turns a sample's
`aux_hidden_states` into the DFlash draft's target hidden. Every file is read that way.

Writes `--out` (JSON: counts, shapes, dtypes) and `--tensors` (torch.save: {file name:
{"input_ids", "loss_mask", "target_hidden", "base_model_hidden_states"}}).

    VENV/bin/python -m tools.modelopt_offline_check --export DIR --out result.json \
        --tensors loaded.pt
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tensors", default=None)
    args = parser.parse_args(argv)

    import torch
    from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset
    from modelopt.torch.speculative.plugins.modeling_dflash import DFlashBaseModelOutput

    root = Path(args.export)
    files = sorted(root.glob("*.pt"), key=lambda p: int(p.stem))
    dataset = OfflineSupervisedDataset([str(f) for f in files], answer_only_loss=True)
    loaded: dict[str, dict[str, Any]] = {}
    shapes: list[dict[str, Any]] = []
    for i, f in enumerate(files):
        item = dataset[i]
        out = DFlashBaseModelOutput.from_offline_dict(item)
        loaded[f.name] = {
            "input_ids": item["input_ids"],
            "loss_mask": item["loss_mask"],
            "target_hidden": out.target_hidden,
            "base_model_hidden_states": item["base_model_hidden_states"],
        }
        shapes.append(
            {
                "file": f.name,
                "target_hidden": [list(out.target_hidden.shape), str(out.target_hidden.dtype)],
                "base_hidden_prenorm": bool(item["base_hidden_prenorm"]),
            }
        )
    result = {"files": len(files), "loaded": len(loaded), "samples": shapes}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.tensors:
        torch.save(loaded, args.tensors)
    print(f"modelopt dflash: {len(files)} files, {len(loaded)} loaded")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
