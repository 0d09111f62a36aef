"""Every drafter family from one demo store, loaded by the trainers' own readers.

Given a demo run (its records.jsonl; `make demo` or `python -m kimi_pipe demo ...`):

1. extracts a store whose layers come from two drafter configs at once
   (`extract.draft_config=[EAGLE-3, DFlash]`, benchmarks/drafter_configs/), in bf16 and in fp8;
2. exports it as `dflash`, `dspark` (layers of the DFlash config), `modelopt` with the DFlash
   config (ModelOpt's DFlash reads `aux_hidden_states`) and `specforge` with the EAGLE-3 config;
3. loads them with SpecForge's own offline reader per strategy (tools/specforge_offline_check.py)
   and ModelOpt's `OfflineSupervisedDataset` + `DFlashBaseModelOutput.from_offline_dict`
   (tools/modelopt_offline_check.py), in the trainers' venv;
4. compares every loaded sample with the store: ids, mask, and each layer's states bit for bit
   (DSpark's last state: the store's pre-norm final state through the recorded norm);
5. writes the figures (samples, tokens, bytes per token of every store and export) as JSON.

    PYTHONPATH=. .venv/bin/python -m benchmarks.drafters_demo --run RUN \
        --trainer-python VENV/bin/python --out docs/measured/drafters_demo.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kimi_pipe.exporters import INDEX_FILE, export
from kimi_pipe.extraction.draft_config import read_draft_config
from kimi_pipe.store.conventions import final_state_as
from kimi_pipe.store.hidden_store import HiddenStore

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "benchmarks" / "drafter_configs"
EAGLE3 = CONFIGS / "smollm2-eagle3.json"
DFLASH = CONFIGS / "smollm2-dflash.json"


def extract(
    run: Path,
    out: Path,
    store_dtype: str,
    *,
    model: str = "smollm2",
    model_path: Path | None = None,
    configs: tuple[Path, Path] = (EAGLE3, DFLASH),
) -> None:
    if (out / "manifest.json").exists():
        return
    cmd = [
        sys.executable, "-m", "kimi_pipe", "extract", f"model={model}",
        f"extract.run_dir={run}", "extract.only_ok=false", f"extract.output_dir={out}",
        f"extract.draft_config=[{configs[0]},{configs[1]}]", f"extract.store_dtype={store_dtype}",
        f"hydra.run.dir={run}",
    ]  # fmt: skip
    if model_path is not None:  # written records of a stand-in target: no split check
        cmd += [f"extract.model_path={model_path}", "resolve.split_check=false"]
    subprocess.run(cmd, cwd=REPO, check=True)


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def tree_bytes(root: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in root.rglob(pattern) if p.is_file())


def index(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / INDEX_FILE).read_text().splitlines()]


def columns(store: HiddenStore, layers: list[int]) -> list[int]:
    stored = [int(i) for i in store.manifest["layer_ids"]]
    return [stored.index(i) for i in layers]


def layer(t: torch.Tensor, k: int, h: int) -> torch.Tensor:
    return t[..., k * h : (k + 1) * h]


def compare(
    store: HiddenStore, rows: list[dict[str, Any]], loaded: dict[str, dict[str, torch.Tensor]],
    layers: list[int], *, names: dict[str, str],
) -> dict[str, Any]:  # fmt: skip
    """Every row's loaded tensors against the store: counts of samples equal in each part."""
    h = int(store.manifest["hidden_size"])
    cols = columns(store, layers)
    equal = {"samples": 0, "ids": 0, "mask": 0, "layers": 0, "last": 0}
    per_layer = [0] * len(layers)
    for row in rows:
        got = loaded[row["file"]]
        have = store[row["id"]]
        equal["samples"] += 1
        ids = got[names["ids"]].reshape(-1)
        equal["ids"] += int(torch.equal(ids, have["input_ids"].long()))
        mask = got[names["mask"]].reshape(-1)
        equal["mask"] += int(torch.equal(mask.long(), have["loss_mask"].long()))
        states = got[names["states"]].reshape(ids.shape[0], -1)
        ok = [
            torch.equal(layer(states, k, h), layer(have["aux_hidden_state"], c, h))
            for k, c in enumerate(cols)
        ]
        for k, v in enumerate(ok):
            per_layer[k] += int(v)
        equal["layers"] += int(all(ok) and states.shape[1] == len(cols) * h)
        if "last" in names:
            want = final_state_as(store.manifest, have["hidden_state"], "post_norm")
            last = got[names["last"]].reshape(ids.shape[0], -1)
            equal["last"] += int(torch.equal(last, want))
    equal["per_layer"] = dict(zip([str(i) for i in layers], per_layer, strict=True))  # type: ignore[assignment]
    return equal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, type=Path)
    parser.add_argument("--trainer-python", required=True)
    parser.add_argument("--out", required=True, type=Path)
    # Another target than the demo's SmolLM2 (benchmarks/drafters_miniature.py: the miniature
    # Kimi K2.5 with SpecForge's Kimi drafter configs).
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--eagle3", type=Path, default=EAGLE3)
    parser.add_argument("--dflash", type=Path, default=DFLASH)
    args = parser.parse_args(argv)
    eagle3_config, dflash_config = args.eagle3.resolve(), args.dflash.resolve()
    run: Path = args.run.resolve()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    started = time.monotonic()
    stores = {"bfloat16": run / "hidden_drafters", "fp8_e4m3": run / "hidden_drafters_fp8"}
    for dtype, path in stores.items():
        extract(
            run, path, dtype, model=args.model, model_path=args.model_path,
            configs=(eagle3_config, dflash_config),
        )  # fmt: skip
    dflash_layers = read_draft_config(dflash_config).output_ids
    eagle_layers = read_draft_config(eagle3_config).output_ids
    figures: dict[str, Any] = {
        "draft_configs": {
            "eagle3": {"file": _shown(eagle3_config), "output_ids": eagle_layers},
            "dflash": {"file": _shown(dflash_config), "output_ids": dflash_layers},
        },
        "stores": {},
        "exports": {},
    }
    for dtype, path in stores.items():
        s = HiddenStore(path)
        tokens = sum(s.entry(i).length for i in s.ids)
        size = tree_bytes(path / "shards", "*.safetensors")
        figures["stores"][dtype] = {
            "samples": len(s),
            "tokens": tokens,
            "layer_ids": s.manifest["layer_ids"],
            "hidden_size": s.manifest["hidden_size"],
            "shard_bytes": size,
            "bytes_per_token": round(size / tokens, 1),
        }
    exports_root = run / "drafter_exports"
    plan = [
        ("dflash", "dflash", dflash_config),
        ("dspark", "dspark", dflash_config),
        ("modelopt", "modelopt_dflash", dflash_config),
        ("specforge", "specforge_eagle3", eagle3_config),
    ]
    for dtype, spath in stores.items():
        store = HiddenStore(spath)
        for fmt, name, config in plan:
            out = exports_root / f"{name}_{dtype}"
            summary = export([spath], out, fmt, settings={"draft_config": str(config)})
            pattern = "*.pt" if fmt == "modelopt" else "data_*.ckpt"
            size = tree_bytes(out, pattern)
            entry: dict[str, Any] = {
                "format": fmt,
                "samples": summary["samples"],
                "tokens": summary["tokens"]["total"],
                "counts": summary["counts"],
                "layer_ids": summary["files"]["layer_ids"],
                "tensors": summary["files"]["tensors"],
                "file_bytes": size,
                "bytes_per_token": round(size / summary["tokens"]["total"], 1),
            }
            rows = index(out)
            result, tensors = out.parent / f"{name}_{dtype}.json", out.parent / f"{name}_{dtype}.pt"
            if fmt in ("dflash", "dspark"):
                strategies = ["dflash", "domino"] if fmt == "dflash" else ["dspark"]
                entry["readers"] = {}
                for strategy in strategies:
                    subprocess.run(
                        [args.trainer_python, "-m", "tools.specforge_offline_check",
                         "--export", str(out), "--strategy", strategy, "--draft-config",
                         str(config), "--out", str(result), "--tensors", str(tensors)],
                        cwd=REPO, check=True,
                    )  # fmt: skip
                    r = json.loads(result.read_text())
                    names = {"ids": "input_ids", "mask": "loss_mask", "states": "hidden_states"}
                    if fmt == "dspark":
                        names["last"] = "target_last_hidden_states"
                    entry["readers"][f"specforge {strategy}"] = {
                        "normalizer": r["normalizer_id"],
                        "files_listed": r["reader_refs"],
                        "loaded": r["loaded_batches"],
                        "capture_layers_from_draft_config": r["capture_layers_from_draft_config"],
                        "equal": compare(
                            store, rows, torch.load(tensors, weights_only=True), dflash_layers,
                            names=names,
                        ),
                    }  # fmt: skip
            elif fmt == "modelopt":
                subprocess.run(
                    [args.trainer_python, "-m", "tools.modelopt_offline_check",
                     "--export", str(out), "--out", str(result), "--tensors", str(tensors)],
                    cwd=REPO, check=True,
                )  # fmt: skip
                r = json.loads(result.read_text())
                names = {"ids": "input_ids", "mask": "loss_mask", "states": "target_hidden"}
                entry["readers"] = {
                    "modelopt OfflineSupervisedDataset + DFlashBaseModelOutput": {
                        "files": r["files"],
                        "loaded": r["loaded"],
                        "equal": compare(
                            store, rows, torch.load(tensors, weights_only=True), dflash_layers,
                            names=names,
                        ),
                    }
                }  # fmt: skip
            figures["exports"][f"{name}_{dtype}"] = entry
    figures["wall_s"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps({k: v.get("bytes_per_token") for k, v in figures["exports"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
