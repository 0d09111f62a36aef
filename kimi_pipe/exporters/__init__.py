"""The export engine: hidden-state stores -> one EAGLE-3 trainer's files and a dataset card.
It plans and shuffles the samples, converts conventions (or refuses before writing), resumes,
and writes the index, the summary and the card; each format is one file of this package
(`base.py` holds the protocol). The command: kimi_pipe/stages/export.py; docs/export.md."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_pipe.errors import ConfigError
from kimi_pipe.exporters import hub, parallel
from kimi_pipe.exporters.base import (
    ExportContext,
    Exporter,
    ExportFormatError,
    export_formats,
    load_exporter,
    write_atomic,
)
from kimi_pipe.exporters.card import dataset_card
from kimi_pipe.exporters.job import ExportJob
from kimi_pipe.exporters.modelopt import modelopt_path
from kimi_pipe.exporters.sources import (  # noqa: F401  (re-exported)
    ExportPolicy,
    accepted_samples,
    mode_counts,
    source_figures,
)
from kimi_pipe.exporters.specforge import (
    ROWS_PER_DIR,
    SPECFORGE_CONFIG,
    SPECFORGE_DEFAULT_MAX_LENGTH,
    checkpoint_weight_names,
    specforge_config,
    specforge_path,
    specforge_weight_keys,
)
from kimi_pipe.exporters.speculators import SPECULATORS_STATES, speculators_path
from kimi_pipe.exporters.stores import open_stores, store_name, store_refs
from kimi_pipe.exporters.tokens import TOKENS_FILE
from kimi_pipe.extraction.layers import drafter_config_ids, manifest_output_ids
from kimi_pipe.store import atomic
from kimi_pipe.store.conventions import final_state_conversion
from kimi_pipe.store.hidden_store import HiddenStore, state_dtypes

__all__ = [
    "CARD_FILE",
    "FORMATS",
    "INDEX_FILE",
    "ROWS_PER_DIR",
    "SPECFORGE_CONFIG",
    "SPECFORGE_DEFAULT_MAX_LENGTH",
    "SPECULATORS_STATES",
    "SUMMARY_FILE",
    "TOKENS_FILE",
    "ExportFormatError",
    "Exporter",
    "checkpoint_weight_names",
    "export",
    "export_specforge",
    "main",
    "modelopt_path",
    "run_export",
    "select_samples",
    "specforge_config",
    "specforge_path",
    "specforge_weight_keys",
    "speculators_path",
]

PLAN_FILE = "export_plan.json"
INDEX_FILE = "export_index.jsonl"
SUMMARY_FILE = "export_summary.json"
CARD_FILE = "README.md"
FORMATS = export_formats()  # the configs in conf/export/


@dataclass(frozen=True)
class PlannedSample:
    index: int  # position after the shuffle: data_{index}.ckpt, hs_{index}, row index
    store: int  # position in the sorted store list
    id: str


def select_samples(
    stores: Sequence[HiddenStore], keep: Callable[[int, str], bool] | None = None
) -> list[tuple[int, str]]:
    """The samples that reach the training files, as (store position, id), in (store, id)
    order: those the export policy `keep`s (`export.accept`, by their evidence rung)."""
    return [
        (si, sid)
        for si, s in enumerate(stores)
        for sid in sorted(s.ids)
        if keep is None or keep(si, sid)
    ]


def plan(
    stores: Sequence[HiddenStore], seed: int, keep: Callable[[int, str], bool] | None = None
) -> list[PlannedSample]:
    """Deterministic merge + shuffle of the selected samples of every store."""
    items = select_samples(stores, keep)
    random.Random(seed).shuffle(items)
    return [PlannedSample(i, si, sid) for i, (si, sid) in enumerate(items)]


def _plan_digest(stores: Sequence[HiddenStore], planned: Sequence[PlannedSample]) -> str:
    h = hashlib.sha256()
    for p in planned:
        h.update(f"{store_name(stores[p.store])}\0{p.id}\n".encode())
    return h.hexdigest()


def _check_or_write_plan(output: Path, info: dict[str, Any]) -> None:
    """A rerun into the same directory must be the same export (then it resumes)."""
    path = output / PLAN_FILE
    if path.exists():
        old = json.loads(path.read_text())
        same = (
            old.get("digest") == info["digest"]
            and old.get("format", "specforge") == info["format"]
            and old.get("files", info["files"]) == info["files"]
        )
        if not same:
            raise ConfigError(
                f"{output} holds another export (other stores, seed, format or file layout); "
                "pick a new output directory or delete it"
            )
    write_atomic(path, json.dumps(info, indent=2) + "\n")


# --------------------------------------------------------------------------- conventions


def conventions(manifest: dict[str, Any], want: str | None) -> dict[str, Any]:
    """What files with final state `want` (None: no states) will hold, derived from the
    manifest; raises before any write when the store cannot be exported that way."""
    output_ids = manifest_output_ids(manifest)
    out: dict[str, Any] = {
        "layer_ids_stored": list(manifest["layer_ids"]),
        "layer_convention_stored": manifest.get("layer_convention"),
        "output_layer_ids_stored": list(output_ids),
        "output_layer_ids": output_ids,
        "capture_layer_ids": [i + 1 for i in output_ids],
        "drafter_config_ids": {
            engine: _engine_ids(output_ids, engine) for engine in ("sglang", "vllm")
        },
        "final_state_stored": manifest.get("final_state"),
        "final_state_written": want,
        "final_state_conversion": final_state_conversion(manifest, want) if want else None,
    }
    return out


def select_layers(
    conv: dict[str, Any], selected: list[int] | None, source: str
) -> list[int] | None:
    """Narrow `conv` to the aux layers an exporter writes (in its order); return the columns
    of the store's aux states to take, None when the files hold them all as stored. Refuses,
    before any write, a layer the store does not hold."""
    if selected is None:
        return None
    stored = list(conv["output_layer_ids_stored"])
    if not selected or len(set(selected)) != len(selected):
        raise ConfigError(f"{source}: layer ids {selected} must be distinct and not empty")
    missing = [i for i in selected if i not in stored]
    if missing:
        raise ConfigError(
            f"{source} names layers {missing} (output of layer) that the store does not hold "
            f"(it holds {stored}): re-extract with extract.draft_config=<that config> (a list "
            "of configs captures the union of their layers)"
        )
    conv["output_layer_ids"] = list(selected)
    conv["capture_layer_ids"] = [i + 1 for i in selected]
    conv["drafter_config_ids"] = {e: _engine_ids(list(selected), e) for e in ("sglang", "vllm")}
    conv["layer_selection"] = {"source": source, "output_layer_ids": list(selected)}
    columns = [stored.index(i) for i in selected]
    return None if columns == list(range(len(stored))) else columns


def _engine_ids(output_ids: list[int], engine: str) -> list[int] | str:
    try:
        return drafter_config_ids(output_ids, engine)
    except ValueError as exc:
        return f"not expressible: {exc}"


# --------------------------------------------------------------------------- the export


def export(
    store_paths: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    fmt: str = "specforge",
    seed: int = 0,
    *,
    target_model_path: str | os.PathLike[str] | None = None,
    max_length: int | None = None,
    settings: Mapping[str, Any] | None = None,
    accept: Sequence[str] | None = None,
    workers: int = 1,
    storage_options: Mapping[str, Any] | None = None,
    push_to_hub: Mapping[str, Any] | None = None,
    hub_api: Any = None,
) -> dict[str, Any]:
    """Write `fmt`'s layout and the dataset card; return the export summary. `accept`: the
    evidence rungs whose samples reach the files (default engine_ids, text_proven,
    target_resolved; a record whose last id is unrecoverable never does).

    `settings` override the format's config (conf/export/<fmt>.yaml); `max_length` is
    SpecForge's `export.max_length`, kept as an argument for callers of the first exporter.
    """
    overrides = dict(settings or {})
    if max_length is not None:
        overrides["max_length"] = max_length
    exporter = load_exporter(fmt, overrides)
    workers = parallel.check_workers(workers)
    stores = open_stores(store_paths, storage_options)
    manifest = stores[0].manifest
    want = exporter.final_state
    conv = conventions(manifest, want)  # refuses before the output directory is touched
    model_path = str(target_model_path or manifest.get("model_path") or "") or None
    out = Path(output)
    ctx = ExportContext(out, manifest, conv, model_path, list(stores))
    aux_columns = select_layers(conv, exporter.select_layers(ctx), _selection_source(exporter))
    extras = exporter.check(ctx)  # refusals of the format, still before any write
    hub_settings = hub.HubSettings.from_mapping(push_to_hub)
    policy = accepted_samples(stores, accept)
    planned = plan(stores, seed, policy.keep)
    hub_plan = None
    if hub_settings.repo_id:  # the Hub's limits, checked from counts before any write
        hub_plan = hub.plan_layout(hub_shape(exporter, ctx, stores, planned), hub_settings)
        if hub_api is None and not os.environ.get("HF_TOKEN"):
            raise hub.HubLayoutError(
                "export.push_to_hub needs a Hugging Face write token in the environment: "
                "export HF_TOKEN (never put it in a config)"
            )
        extras["push_to_hub"] = {"repo_id": hub_settings.repo_id, "plan": hub_plan.figures()}
        for warning in hub_plan.warnings:
            print(f"export: push_to_hub: {warning}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    digest = _plan_digest(stores, planned)
    _check_or_write_plan(
        out,
        {
            "format": fmt,
            "seed": seed,
            "stores": [store_name(s) for s in stores],
            "samples": len(planned),
            "digest": digest,
            # What the files hold (dtype, compression): a resume must not mix two layouts.
            "files": exporter.files(ctx),
        },
    )
    started = time.monotonic()
    tokens = {"total": 0, "loss": 0, "max_len": 0}
    per_store = [{"store": store_name(s), "samples": 0, "tokens": 0} for s in stores]
    job = parallel.Job(
        stores=store_refs(store_paths),
        storage_options=dict(storage_options or {}),
        fmt=fmt,
        settings=overrides,
        output=str(out),
        want=want,
        rows=exporter.needs_rows,
        aux_columns=aux_columns,
        hidden_size=int(manifest["hidden_size"]),
    )
    tasks = parallel.tasks_of(stores, planned)
    del planned  # the tasks hold the plan now
    counts, fragments = parallel.run_tasks(job, stores, exporter, tasks, workers)
    del tasks
    exporter.start(ctx)
    samples = 0
    with atomic.atomic_path(out / INDEX_FILE) as tmp_index, open(tmp_index, "w") as index_file:
        for row in parallel.merged_rows(fragments):
            si, sid = int(row["s"]), str(row["id"])
            length, loss = parallel.row_summary(row)
            if exporter.needs_rows:
                exporter.add_row(int(row["i"]), sid, row["ids"], row["mask"])
            tokens["total"] += length
            tokens["loss"] += loss
            policy.count_tokens(si, sid, length, loss)
            tokens["max_len"] = max(tokens["max_len"], length)
            per_store[si]["samples"] += 1  # type: ignore[operator]
            per_store[si]["tokens"] += length  # type: ignore[operator]
            entry = {"index": row["i"], "store": store_name(stores[si]), "id": sid}
            entry["length"] = length
            entry.update(policy.row_labels(si, sid))  # evidence; drawn rows say so
            if "file" in row:
                entry["file"] = row["file"]
            index_file.write(json.dumps(entry) + "\n")
            samples += 1
    shutil.rmtree(out / parallel.PARTS_DIR, ignore_errors=True)
    extras.update(exporter.finish(ctx, counts, tokens))
    sources = [source_figures(s, policy.accept) for s in stores]
    summary: dict[str, Any] = {
        "format": fmt,
        "output": str(out),
        "seed": seed,
        "samples": samples,
        "counts": counts,
        "tokens": tokens,
        "per_store": per_store,
        # What the files written here hold; the store's own description apart from it.
        "files": exporter.files(ctx),
        "source_manifest": _card_manifest(manifest),
        "converted": converted(manifest, conv, exporter.files(ctx)),
        "conventions": conv,
        "target_model_path": model_path,
        "sources": sources,
        "modes": mode_counts(per_store, sources),
        "policy": policy.summary(),
        "wall_s": round(time.monotonic() - started, 3),
        **extras,
    }
    write_atomic(out / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    write_atomic(out / CARD_FILE, dataset_card(summary, exporter))
    if hub_plan is not None:
        folder = hub.stage(out, hub_plan, line_files=tuple(exporter.row_bytes(0, 0)))
        pushed = hub.push(folder, hub_settings, hub_api)
        print(f"export: pushed {folder} to the Hub dataset {pushed['repo_id']}", file=sys.stderr)
    return summary


def hub_shape(
    exporter: Exporter,
    ctx: ExportContext,
    stores: Sequence[HiddenStore],
    planned: Sequence[PlannedSample],
) -> hub.ExportShape:
    """The export's shape from the stores' indexes (lengths), before anything is written."""
    lengths = [stores[p.store].entry(p.id).length for p in planned]
    n, total = len(lengths), sum(lengths)
    return hub.estimate_shape(
        exporter.files(ctx),
        exporter.row_bytes(n, total),
        exporter.dataset_bytes(n, total),
        samples=n,
        tokens=total,
        longest=max(lengths, default=0),
        per_sample_files=exporter.sample_path(ctx.output, 0) is not None,
    )


def converted(
    manifest: Mapping[str, Any], conv: Mapping[str, Any], files: Mapping[str, Any]
) -> dict[str, Any]:
    """What the export changed on the way from the store to the files, one entry per change
    (empty: the files hold the store's tensors as stored)."""
    out: dict[str, Any] = {}
    if files.get("final_state") is None and files.get("layer_ids") is None:
        return out  # no hidden states (tokens)
    if conv.get("final_state_conversion") == "apply_norm":
        norm = manifest.get("final_norm") or {}
        out["final_state"] = {
            "from": manifest.get("final_state"),
            "to": files["final_state"],
            "how": f"{norm.get('type')} with the manifest's final_norm weight, eps "
            f"{norm.get('eps')} (module {norm.get('module')}), in float32, then cast to "
            f"{files.get('dtype')}",
        }
    stored_ids = list(manifest.get("layer_ids", []))
    selection = conv.get("layer_selection")
    if selection and selection["output_layer_ids"] != conv.get("output_layer_ids_stored"):
        out["layer_ids"] = {
            "from": {"convention": manifest.get("layer_convention"), "ids": stored_ids},
            "to": {"convention": files.get("layer_convention"), "ids": files.get("layer_ids")},
            "how": f"selected ({selection['source']}): the aux states of these layers, in this "
            "order, taken from the store's; the others are not written",
        }
    elif (files.get("layer_convention"), files.get("layer_ids")) != (
        manifest.get("layer_convention"),
        stored_ids,
    ):
        out["layer_ids"] = {
            "from": {"convention": manifest.get("layer_convention"), "ids": stored_ids},
            "to": {"convention": files.get("layer_convention"), "ids": files.get("layer_ids")},
            "how": "renamed only (the same tensors): input of layer i = output of layer i - 1",
        }
    stored = state_dtypes(dict(manifest))
    stored_scales = manifest.get("scale_layout")
    if set(stored.values()) != {files.get("dtype")} or stored_scales != files.get("scale_layout"):
        if files.get("scale_layout") is None:
            how = "dequantized at export: fp8 value x its row's scale, in float32, then cast"
        elif stored_scales is None:
            how = "quantized at export into the trainer's fp8 layout"
        else:
            how = "dequantized, then quantized again in the trainer's fp8 layout (its scales)"
        out["dtype"] = {
            "from": {"dtype": stored, "scale_layout": stored_scales},
            "to": {"dtype": files.get("dtype"), "scale_layout": files.get("scale_layout")},
            "how": how,
        }
    return out


def _selection_source(exporter: Exporter) -> str:
    if exporter.settings.get("draft_config"):
        return f"export.draft_config={exporter.settings['draft_config']}"
    return f"export.layer_ids={exporter.settings.get('layer_ids')}"


def export_specforge(
    store_paths: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str], seed: int = 0
) -> dict[str, Any]:
    """`format=specforge` (kept for callers of the first exporter)."""
    return export(store_paths, output, "specforge", seed)


# --------------------------------------------------------------------------- card inputs


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
        "store_dtype",
        "scale_layout",
        "final_rounding",
        "loss_mask",
        "backend",
    )
    out = {k: m.get(k) for k in keys}
    norm = m.get("final_norm")
    out["final_norm"] = (
        {"type": norm.get("type"), "eps": norm.get("eps"), "module": norm.get("module")}
        if isinstance(norm, dict)
        else None
    )
    return out


# --------------------------------------------------------------------------- the stage's run


def run_export(job: ExportJob) -> dict[str, Any]:
    """The export stage's run of a job built at its door (kimi_pipe/stages/jobs/export.py)."""
    if job.fmt not in FORMATS:
        raise ExportFormatError(
            f"format={job.fmt!r} is not supported; choose one of {list(FORMATS)}"
        )
    if job.output is None:
        raise ExportFormatError("no output directory: pass output=DIR")
    summary = export(
        list(job.stores),
        job.output,
        job.fmt,
        job.seed,
        target_model_path=job.target_model_path,
        settings=job.settings,
        accept=job.accept,
        workers=job.workers,
        storage_options=job.storage_options,
        push_to_hub=job.push_to_hub,
    )
    print(
        f"export: {summary['samples']} samples, {summary['tokens']['total']} tokens -> "
        f"{summary['output']} (card: {Path(summary['output']) / CARD_FILE})",
        file=sys.stderr,
    )
    return summary
