"""Stage: export hidden-state stores for a trainer, with a dataset card.

    python -m kimi_pipe.export format=specforge stores=[runs/B5/x/hidden_hf,runs/B6/x/hidden_hf] \
        seed=0 output=exports/b5-b6

(Until conf/config.yaml declares `format`, `stores` and `seed`, write them `++format=...`.)

`format=specforge` writes SpecForge's offline layout: one `torch.save` dict per sample,
`rows_{g}-{g+2000}/data_{i}.ckpt` with `input_ids` [L] int64, `loss_mask` [L] int64,
`hidden_state` [1, L, H] and `aux_hidden_state` [1, L, 3H] in the store's dtype.

Merge and shuffle are deterministic: samples of all stores are ordered by (store path, sample
id) and shuffled with `random.Random(seed)`, so the same stores and seed always give the same
files, whatever order the stores are listed in. `export_index.jsonl` maps each file back to its
store and sample id. A killed export resumes: files are written tmp + rename and existing ones
are kept (the plan is checked to be the same). Samples with NaN/inf states are skipped, counted.
The directory gets a README.md dataset card (counts, tokens, loss mask, layers, fidelity from the
source runs' audit.json, billing drift from their summary.json / records).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from kimi_pipe.config import CONF_DIR
from kimi_pipe.store.hidden_store import HiddenStore
from kimi_pipe.store.records import iter_records

ROWS_PER_DIR = 2000  # SpecForge's rows_{g}-{g+2000} grouping
PLAN_FILE = "export_plan.json"
INDEX_FILE = "export_index.jsonl"
SUMMARY_FILE = "export_summary.json"
CARD_FILE = "README.md"
FORMATS = ("specforge",)

# Manifest keys that must agree for stores to be mixed in one training set.
_COMPATIBLE_KEYS = (
    "model",
    "num_layers",
    "layer_ids",
    "layer_convention",
    "final_state",
    "hidden_size",
    "dtype",
    "loss_mask",
)


@dataclass(frozen=True)
class PlannedSample:
    index: int  # position after the shuffle: data_{index}.ckpt
    store: int  # position in the sorted store list
    id: str


def specforge_path(output: Path, index: int) -> Path:
    g = index // ROWS_PER_DIR * ROWS_PER_DIR
    return output / f"rows_{g}-{g + ROWS_PER_DIR}" / f"data_{index}.ckpt"


def open_stores(paths: Sequence[str | os.PathLike[str]]) -> list[HiddenStore]:
    """Open the stores sorted by resolved path; refuse stores that cannot be mixed."""
    if not paths:
        raise ValueError(
            "no stores to export: pass stores=[STORE_DIR,...] (made by python -m kimi_pipe.extract)"
        )
    resolved = sorted({Path(p).resolve() for p in paths})
    stores = [HiddenStore(p) for p in resolved]
    first = stores[0].manifest
    for s in stores[1:]:
        diff = [k for k in _COMPATIBLE_KEYS if s.manifest.get(k) != first.get(k)]
        if diff:
            detail = ", ".join(f"{k}: {first.get(k)!r} vs {s.manifest.get(k)!r}" for k in diff)
            raise ValueError(f"stores {stores[0].path} and {s.path} cannot be mixed ({detail})")
    return stores


def plan(stores: Sequence[HiddenStore], seed: int) -> list[PlannedSample]:
    """Deterministic merge + shuffle of every sample of every store."""
    items = [(si, sid) for si, s in enumerate(stores) for sid in sorted(s.ids)]
    random.Random(seed).shuffle(items)
    return [PlannedSample(i, si, sid) for i, (si, sid) in enumerate(items)]


def _plan_digest(stores: Sequence[HiddenStore], planned: Sequence[PlannedSample]) -> str:
    h = hashlib.sha256()
    for p in planned:
        h.update(f"{stores[p.store].path}\0{p.id}\n".encode())
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _check_or_write_plan(output: Path, info: dict[str, Any]) -> None:
    """A rerun into the same directory must be the same export (then it resumes)."""
    path = output / PLAN_FILE
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("digest") != info["digest"]:
            raise ValueError(
                f"{output} holds another export (other stores or seed); "
                "pick a new output directory or delete it"
            )
    _write_atomic(path, json.dumps(info, indent=2) + "\n")


def export_specforge(
    store_paths: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str], seed: int = 0
) -> dict[str, Any]:
    """Write the SpecForge layout and the dataset card; return the export summary."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    stores = open_stores(store_paths)
    planned = plan(stores, seed)
    digest = _plan_digest(stores, planned)
    _check_or_write_plan(
        out,
        {
            "format": "specforge",
            "seed": seed,
            "stores": [str(s.path) for s in stores],
            "samples": len(planned),
            "digest": digest,
        },
    )
    started = time.monotonic()
    counts = {"written": 0, "already_written": 0, "skipped_non_finite": 0}
    tokens = {"total": 0, "loss": 0, "max_len": 0}
    per_store = [{"store": str(s.path), "samples": 0, "tokens": 0} for s in stores]
    index_lines: list[str] = []
    last_report = started
    for n, p in enumerate(planned, 1):
        store = stores[p.store]
        path = specforge_path(out, p.index)
        # Token data is cheap to read; the states only when the file must be written.
        t = store.tokens(p.id)
        if path.exists():
            counts["already_written"] += 1
        else:
            sample = store[p.id]
            aux, final = sample["aux_hidden_state"], sample["hidden_state"]
            if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
                counts["skipped_non_finite"] += 1
                print(f"export: {store.path} {p.id}: NaN/inf state, skipped", file=sys.stderr)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            torch.save(
                {
                    # clone(): a file must hold only its own rows, never a larger storage.
                    "input_ids": sample["input_ids"].to(torch.int64).clone(),
                    "loss_mask": sample["loss_mask"].to(torch.int64).clone(),
                    "hidden_state": final.unsqueeze(0).clone(),
                    "aux_hidden_state": aux.unsqueeze(0).clone(),
                },
                tmp,
            )
            os.replace(tmp, path)
            counts["written"] += 1
        length = int(t["input_ids"].numel())
        tokens["total"] += length
        tokens["loss"] += int(t["loss_mask"].sum())
        tokens["max_len"] = max(tokens["max_len"], length)
        per_store[p.store]["samples"] += 1
        per_store[p.store]["tokens"] += length
        index_lines.append(
            json.dumps(
                {
                    "index": p.index,
                    "file": str(path.relative_to(out)),
                    "store": str(store.path),
                    "id": p.id,
                    "length": length,
                }
            )
            + "\n"
        )
        now = time.monotonic()
        if now - last_report >= 30 or n == len(planned):
            print(f"export: {n}/{len(planned)} samples -> {out}", file=sys.stderr, flush=True)
            last_report = now
    _write_atomic(out / INDEX_FILE, "".join(index_lines))
    exported = len(index_lines)
    summary: dict[str, Any] = {
        "format": "specforge",
        "output": str(out),
        "seed": seed,
        "samples": exported,
        "counts": counts,
        "tokens": tokens,
        "per_store": per_store,
        "manifest": _card_manifest(stores[0].manifest),
        "sources": [source_figures(s) for s in stores],
        "wall_s": round(time.monotonic() - started, 3),
    }
    _write_atomic(out / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    _write_atomic(out / CARD_FILE, dataset_card(summary))
    return summary


# --------------------------------------------------------------------------- dataset card


def _card_manifest(m: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "model",
        "num_layers",
        "layer_ids",
        "layer_convention",
        "layer_convention_doc",
        "final_state",
        "final_state_doc",
        "hidden_size",
        "aux_hidden_size",
        "dtype",
        "loss_mask",
        "backend",
    )
    return {k: m.get(k) for k in keys}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _records_drift(records: Path, ids: set[str]) -> dict[str, Any] | None:
    """Billing drift of the exported samples: reconstructed vs provider-reported tokens."""
    if not records.exists():
        return None
    reported = rebuilt = differing = counted = 0
    seen: dict[str, tuple[int, int]] = {}
    for rec in iter_records(records):
        if str(rec.get("id")) not in ids:
            continue
        rep = rec.get("completion_tokens_reported")
        rec_n = rec.get("completion_tokens_reconstructed")
        if isinstance(rep, int) and isinstance(rec_n, int):
            seen[str(rec["id"])] = (rep, rec_n)  # last record of an id wins, as in extract
    for rep, rec_n in seen.values():
        counted += 1
        reported += rep
        rebuilt += rec_n
        differing += int(rep != rec_n)
    if not counted:
        return None
    return {
        "samples_with_usage": counted,
        "completion_tokens_reported": reported,
        "completion_tokens_reconstructed": rebuilt,
        "reconstructed_minus_reported": rebuilt - reported,
        "samples_differing": differing,
    }


def source_figures(store: HiddenStore) -> dict[str, Any]:
    """Fidelity (audit.json) and billing drift (summary.json, records) of a store's sources."""
    runs = [Path(r) for r in store.manifest.get("source_runs", [])]
    extract_summary = _read_json(store.path / "extract_summary.json") or {}
    records = Path(extract_summary["records"]) if extract_summary.get("records") else None
    out: dict[str, Any] = {"store": str(store.path), "runs": []}
    for run in runs:
        rec_file = run / "records.jsonl"
        if records is not None and records.parent.resolve() == run.resolve():
            rec_file = records  # the extract input was another file of this run
        summary = _read_json(run / "summary.json") or {}
        out["runs"].append(
            {
                "run": str(run),
                "audit": _read_json(run / "audit.json"),
                "billing_drift_run": summary.get("billing_drift"),
                "tokens_run": summary.get("tokens"),
                "billing_drift_exported": _records_drift(rec_file, set(store.ids)),
            }
        )
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _audit_lines(audit: dict[str, Any]) -> list[str]:
    """The audit's own figures, top-level scalars and one level of dicts, as table rows."""
    rows: list[str] = []
    for key, value in audit.items():
        if isinstance(value, dict) and all(not isinstance(v, (dict, list)) for v in value.values()):
            for k2, v2 in value.items():
                rows.append(f"| {key}.{k2} | {_fmt(v2)} |")
        elif not isinstance(value, (dict, list)):
            rows.append(f"| {key} | {_fmt(value)} |")
    return rows


def dataset_card(summary: dict[str, Any]) -> str:
    m = summary["manifest"]
    t = summary["tokens"]
    n = summary["samples"]
    lines = [
        "# EAGLE-3 training data (SpecForge offline layout)",
        "",
        "Made by `python -m kimi_pipe.export format=specforge` (kimi_pipe). Load it with",
        "SpecForge's offline dataset (`--train-hidden-states-path` = this directory): every",
        "`rows_*/data_*.ckpt` is a `torch.load` dict with `input_ids` [L] int64, `loss_mask` [L]",
        f"int64, `hidden_state` [1, L, {m['hidden_size']}] and `aux_hidden_state` "
        f"[1, L, {m['aux_hidden_size']}] ({m['dtype']}).",
        "`export_index.jsonl` maps every file to its source store and sample id.",
        "",
        "## Counts",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| samples | {n} |",
        f"| tokens | {t['total']} |",
        f"| loss tokens (loss_mask = 1) | {t['loss']} |",
        f"| mean / max length | {t['total'] / n if n else 0:.1f} / {t['max_len']} |",
        f"| skipped (NaN/inf states) | {summary['counts']['skipped_non_finite']} |",
        f"| shuffle seed | {summary['seed']} |",
        "",
        "| source store | samples | tokens |",
        "| --- | --- | --- |",
        *[f"| `{s['store']}` | {s['samples']} | {s['tokens']} |" for s in summary["per_store"]],
        "",
        "## Hidden states",
        "",
        f"- target model: `{m['model']}` ({m['num_layers']} layers, hidden size "
        f"{m['hidden_size']}), captured with the `{m['backend']}` backend, stored as {m['dtype']}",
        f"- auxiliary layers: {m['layer_ids']} ({m['layer_convention']}: "
        f"{m['layer_convention_doc']}), concatenated in that order",
        f"- final state: {m['final_state']} ({m['final_state_doc']})",
        "",
        "## Loss mask",
        "",
        f"{m['loss_mask']}.",
        "",
        "## Fidelity and billing (per source run)",
        "",
    ]
    for source in summary["sources"]:
        for run in source["runs"]:
            lines += [f"### `{run['run']}`", ""]
            audit = run.get("audit")
            if audit:
                lines += ["Fidelity audit (`audit.json`: engine ids vs reconstructed ids):", ""]
                lines += ["| figure | value |", "| --- | --- |", *_audit_lines(audit), ""]
            else:
                lines += ["No fidelity audit (`audit.json`) in this run.", ""]
            drift = run.get("billing_drift_exported")
            if drift:
                lines += [
                    "Billing drift of the exported samples (reconstructed vs provider-reported "
                    "completion tokens):",
                    "",
                    "| figure | value |",
                    "| --- | --- |",
                    *[f"| {k} | {_fmt(v)} |" for k, v in drift.items()],
                    "",
                ]
            if run.get("billing_drift_run"):
                lines += [
                    f"Whole run (`summary.json`): billing_drift {_fmt(run['billing_drift_run'])}, "
                    f"tokens {_fmt(run.get('tokens_run'))}.",
                    "",
                ]
            if not drift and not run.get("billing_drift_run"):
                lines += ["No billing figures (no usage in the records, no summary.json).", ""]
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------- Hydra app


def run_export(cfg: DictConfig) -> dict[str, Any]:
    fmt = OmegaConf.select(cfg, "format", default="specforge")
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} is not supported; choose one of {list(FORMATS)}")
    stores = OmegaConf.select(cfg, "stores", default=None) or []
    if isinstance(stores, str):
        stores = [stores]
    output = OmegaConf.select(cfg, "output", default=None)
    if output is None:
        raise ValueError("no output directory: pass output=DIR")
    seed = int(OmegaConf.select(cfg, "seed", default=0) or 0)
    summary = export_specforge(list(stores), output, seed=seed)
    print(
        f"export: {summary['samples']} samples, {summary['tokens']['total']} tokens -> "
        f"{summary['output']} (card: {Path(summary['output']) / CARD_FILE})",
        file=sys.stderr,
    )
    return summary


def main() -> None:
    import hydra

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def export_stage(cfg: DictConfig) -> None:
        run_export(cfg)

    export_stage()


if __name__ == "__main__":
    main()
