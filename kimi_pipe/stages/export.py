"""Stage: export hidden-state stores for an EAGLE-3 trainer, with a dataset card.

    python -m kimi_pipe.export format=specforge stores=[runs/B5/x/hidden_hf,runs/B6/x/hidden_hf] \
        seed=0 output=exports/b5-b6 [target_model_path=/models/Kimi-K2.5]

Formats (docs/export.md):

* `specforge`: SpecForge's offline layout, `rows_{g}-{g+2000}/data_{i}.ckpt` (`torch.save` of
  `input_ids` [L] int64, `loss_mask` [L] int64, `hidden_state` [1, L, H] POST-norm,
  `aux_hidden_state` [1, L, 3H]), plus `specforge_train.yaml` for `specforge train --config`.
* `speculators`: a `datasets` dataset (`input_ids`, `loss_mask`, `seq_len`; rows in the shuffled
  order) plus `hidden_states/hs_{i}.safetensors` with `hidden_states` [L, 4, H] (the three aux
  states, then the final state PRE-norm: speculators applies the verifier norm) and `token_ids`.
* `modelopt`: ModelOpt's offline dumps, `{i}.pt` with `input_ids`, `hidden_states` [L, H]
  POST-norm, `aux_hidden_states` [L, 3H], `loss_mask`, `hidden_states_prenorm` False.
* `tokens`: `tokens.jsonl`, pre-tokenized `{"input_ids", "loss_mask", "id"}` rows for online
  training (speculators' `prepare_data --data`, SpecForge's `data.prompts_path`).

Every exporter reads the store's manifest and converts (post-norm from a pre-norm store that
recorded its final norm; layer ids renamed to the trainer's convention) or refuses with a
message before writing anything: it never writes a convention it was not asked for.

Merge and shuffle are deterministic: samples of all stores are ordered by (store path, sample
id) and shuffled with `random.Random(seed)`, so the same stores and seed always give the same
files, whatever order the stores are listed in. `export_index.jsonl` maps each file back to its
store and sample id. A killed export resumes: files are written tmp + rename and existing ones
are kept (the plan is checked to be the same). Samples with NaN/inf states are skipped, counted.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from kimi_pipe.config import CONF_DIR
from kimi_pipe.extraction.layers import drafter_config_ids, manifest_output_ids
from kimi_pipe.stages.export_card import dataset_card
from kimi_pipe.store.conventions import (
    POST_NORM,
    PRE_NORM,
    final_state_as,
    final_state_conversion,
)
from kimi_pipe.store.hidden_store import HiddenStore
from kimi_pipe.store.records import iter_records

ROWS_PER_DIR = 2000  # SpecForge's rows_{g}-{g+2000} grouping
PLAN_FILE = "export_plan.json"
INDEX_FILE = "export_index.jsonl"
SUMMARY_FILE = "export_summary.json"
CARD_FILE = "README.md"
SPECFORGE_CONFIG = "specforge_train.yaml"
SPECULATORS_STATES = "hidden_states"
TOKENS_FILE = "tokens.jsonl"
SPECFORGE_DEFAULT_MAX_LENGTH = 2048  # data.max_length when a config does not set it

# What each trainer's files must hold as the final state (None: no hidden states).
FINAL_STATE_FOR: dict[str, str | None] = {
    "specforge": POST_NORM,  # teacher = bare lm_head(hidden_state)
    "modelopt": POST_NORM,  # lm_head(hidden_states) unless the dump says hidden_states_prenorm
    "speculators": PRE_NORM,  # the trainer applies verifier_norm itself
    "tokens": None,
}
FORMATS = tuple(FINAL_STATE_FOR)

# Manifest keys that must agree for stores to be mixed in one training set.
_COMPATIBLE_KEYS = (
    "model",
    "num_layers",
    "layer_ids",
    "layer_convention",
    "final_state",
    "final_norm",
    "hidden_size",
    "dtype",
    "loss_mask",
)


@dataclass(frozen=True)
class PlannedSample:
    index: int  # position after the shuffle: data_{index}.ckpt, hs_{index}, row index
    store: int  # position in the sorted store list
    id: str


def specforge_path(output: Path, index: int) -> Path:
    g = index // ROWS_PER_DIR * ROWS_PER_DIR
    return output / f"rows_{g}-{g + ROWS_PER_DIR}" / f"data_{index}.ckpt"


def speculators_path(output: Path, index: int) -> Path:
    return output / SPECULATORS_STATES / f"hs_{index}.safetensors"


def modelopt_path(output: Path, index: int) -> Path:
    return output / f"{index}.pt"


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
            detail = ", ".join(
                f"{k}: {_short(first.get(k))} vs {_short(s.manifest.get(k))}" for k in diff
            )
            raise ValueError(f"stores {stores[0].path} and {s.path} cannot be mixed ({detail})")
    return stores


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


def plan(
    stores: Sequence[HiddenStore], seed: int, keep: Callable[[int, str], bool] | None = None
) -> list[PlannedSample]:
    """Deterministic merge + shuffle of every sample of every store (that `keep` accepts)."""
    items = [
        (si, sid)
        for si, s in enumerate(stores)
        for sid in sorted(s.ids)
        if keep is None or keep(si, sid)
    ]
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
        if old.get("digest") != info["digest"] or old.get("format", "specforge") != info["format"]:
            raise ValueError(
                f"{output} holds another export (other stores, seed or format); "
                "pick a new output directory or delete it"
            )
    _write_atomic(path, json.dumps(info, indent=2) + "\n")


# --------------------------------------------------------------------------- conventions


def conventions(manifest: dict[str, Any], fmt: str) -> dict[str, Any]:
    """What the files of `fmt` will hold, derived from the manifest; raises before any write
    when the store cannot be exported that way (ConventionError / ValueError)."""
    want = FINAL_STATE_FOR[fmt]
    output_ids = manifest_output_ids(manifest)
    out: dict[str, Any] = {
        "layer_ids_stored": list(manifest["layer_ids"]),
        "layer_convention_stored": manifest.get("layer_convention"),
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


def _engine_ids(output_ids: list[int], engine: str) -> list[int] | str:
    try:
        return drafter_config_ids(output_ids, engine)
    except ValueError as exc:
        return f"not expressible: {exc}"


# --------------------------------------------------------------------------- writers


def _save_torch(path: Path, obj: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _write_specforge(out: Path, index: int, sample: dict[str, torch.Tensor]) -> None:
    _save_torch(
        specforge_path(out, index),
        {
            # clone(): a file must hold only its own rows, never a larger storage.
            "input_ids": sample["input_ids"].to(torch.int64).clone(),
            "loss_mask": sample["loss_mask"].to(torch.int64).clone(),
            "hidden_state": sample["hidden_state"].unsqueeze(0).clone(),
            "aux_hidden_state": sample["aux_hidden_state"].unsqueeze(0).clone(),
        },
    )


def _write_modelopt(out: Path, index: int, sample: dict[str, torch.Tensor]) -> None:
    _save_torch(
        modelopt_path(out, index),
        {
            "input_ids": sample["input_ids"].to(torch.int64).clone(),
            "hidden_states": sample["hidden_state"].clone(),
            "aux_hidden_states": sample["aux_hidden_state"].clone(),
            # Read only with answer_only_loss=True; otherwise ModelOpt trains on every token.
            "loss_mask": sample["loss_mask"].to(torch.int64).clone(),
            # ModelOpt re-applies the final norm when this is True; the state here is post-norm.
            "hidden_states_prenorm": False,
        },
    )


def _write_speculators(out: Path, index: int, sample: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    aux = sample["aux_hidden_state"]
    final = sample["hidden_state"]
    length, hidden = final.shape
    # [L, k*H] -> [L, k, H], then the final state as the last of the k + 1 states.
    states = torch.cat([aux.reshape(length, -1, hidden), final.unsqueeze(1)], dim=1)
    path = speculators_path(out, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(
        {
            "hidden_states": states.contiguous(),
            "token_ids": sample["input_ids"].to(torch.int64).contiguous(),
        },
        str(tmp),
    )
    os.replace(tmp, path)


Writer = Callable[[Path, int, dict[str, torch.Tensor]], None]
_WRITERS: dict[str, tuple[Callable[[Path, int], Path], Writer]] = {
    "specforge": (specforge_path, _write_specforge),
    "modelopt": (modelopt_path, _write_modelopt),
    "speculators": (speculators_path, _write_speculators),
}


def _write_speculators_rows(out: Path, rows: dict[str, list[Any]]) -> None:
    """The Arrow rows speculators' ArrowDataset reads with load_from_disk(data_path)."""
    from datasets import Dataset, load_from_disk

    ds = Dataset.from_dict(rows)
    # Its loader compares token_ids with the row's input_ids as tensors: store torch format,
    # as its own prepare_data does.
    ds.set_format(type="torch")
    staging = out / ".rows.tmp"
    if staging.exists():
        shutil.rmtree(staging)
    ds.save_to_disk(str(staging))
    for old in out.glob("data-*.arrow"):
        old.unlink()
    for item in staging.iterdir():
        os.replace(item, out / item.name)
    staging.rmdir()
    load_from_disk(str(out))  # fail here, not in the trainer, if the rows do not load


def _write_tokens(out: Path, rows: list[dict[str, Any]]) -> None:
    _write_atomic(out / TOKENS_FILE, "".join(json.dumps(r) + "\n" for r in rows))


# --------------------------------------------------------------------------- SpecForge config


def checkpoint_weight_names(model_path: str | os.PathLike[str]) -> list[str]:
    """Tensor names of a Hugging Face checkpoint: its weight index, else its safetensors files."""
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map; is it a Hugging Face weight index?")
        return sorted(weight_map)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{root} has neither model.safetensors.index.json nor *.safetensors: pass "
            "target_model_path=DIR, the target model's Hugging Face directory"
        )
    from safetensors import safe_open

    names: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.extend(handle.keys())
    return sorted(names)


def _pick_key(names: Sequence[str], suffix: str, what: str, model_path: str) -> str | None:
    found = [n for n in names if n == suffix or n.endswith("." + suffix)]
    if len(found) > 1:
        # A multimodal checkpoint: the language model's key is the one SpecForge needs.
        language = [n for n in found if "language_model" in n]
        found = language if len(language) == 1 else found
    if len(found) > 1:
        raise ValueError(
            f"{model_path}: several {what} weights {found}; set it by hand in {SPECFORGE_CONFIG}"
        )
    return found[0] if found else None


def specforge_weight_keys(model_path: str | os.PathLike[str]) -> dict[str, str]:
    """SpecForge's model.embedding_key / model.lm_head_key, read from the checkpoint.

    Kimi K2.5 is a multimodal wrapper: its keys are `language_model.model.embed_tokens.weight`
    and `language_model.lm_head.weight`. A model with tied embeddings has no lm_head weight:
    the embedding is the head.
    """
    names = checkpoint_weight_names(model_path)
    embed = _pick_key(names, "embed_tokens.weight", "embedding", str(model_path))
    head = _pick_key(names, "lm_head.weight", "lm_head", str(model_path))
    if embed is None:
        raise ValueError(f"{model_path}: no '*embed_tokens.weight' in the checkpoint")
    return {"embedding_key": embed, "lm_head_key": head or embed}


def specforge_config(
    *,
    output: Path,
    target_model_path: str | None,
    output_ids: list[int],
    max_length: int,
    dtype: str,
    weight_keys: dict[str, str] | None,
) -> str:
    """The `specforge train --config` YAML for this export (SpecForge 0.2.x schema)."""
    import yaml

    model: dict[str, Any] = {
        "target_model_path": target_model_path or "SET_ME_target_model_directory",
        "aux_hidden_state_layer_ids": list(output_ids),
        "torch_dtype": dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16",
    }
    if weight_keys:
        model.update(weight_keys)
    config = {
        "model": model,
        "data": {"hidden_states_path": str(output.resolve()), "max_length": int(max_length)},
        "training": {"strategy": "eagle3"},
        "output_dir": str(output.resolve() / "specforge_out"),
    }
    header = (
        "# Made by python -m kimi_pipe.export format=specforge. Train with:\n"
        f"#   specforge train --config {output.resolve() / SPECFORGE_CONFIG}\n"
        "# aux_hidden_state_layer_ids: 'output of layer' ids (SpecForge's convention).\n"
        "# max_length >= the longest sample: SpecForge cuts longer samples without a word.\n"
    )
    if not weight_keys:
        header += (
            "# embedding_key / lm_head_key: not checked (no target_model_path); SpecForge's\n"
            "# defaults apply. Kimi K2.5 needs language_model.model.embed_tokens.weight and\n"
            "# language_model.lm_head.weight: rerun the export with target_model_path=DIR.\n"
        )
    if not target_model_path:
        header += "# target_model_path: unknown to the store; set it before training.\n"
    return header + yaml.safe_dump(config, sort_keys=False)


def _resolve_max_length(requested: int | None, longest: int) -> int:
    if requested is None:
        return max(longest, 1)
    if requested < longest:
        raise ValueError(
            f"max_length={requested} is shorter than the longest exported sample ({longest} "
            "tokens): SpecForge would cut it silently. Pass max_length >= "
            f"{longest}, or re-extract with extract.max_len={requested}."
        )
    return requested


# --------------------------------------------------------------------------- the export


def export(
    store_paths: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    fmt: str = "specforge",
    seed: int = 0,
    *,
    target_model_path: str | os.PathLike[str] | None = None,
    max_length: int | None = None,
    accept: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Write `fmt`'s layout and the dataset card; return the export summary. `accept`: the
    evidence rungs whose samples reach the files (default engine_ids, text_proven,
    target_resolved; a record whose last id is unrecoverable never does)."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} is not supported; choose one of {list(FORMATS)}")
    stores = open_stores(store_paths)
    manifest = stores[0].manifest
    conv = conventions(manifest, fmt)  # refuses before the output directory is touched
    model_path = str(target_model_path or manifest.get("model_path") or "") or None
    weight_keys = None
    if fmt == "specforge" and model_path:
        weight_keys = specforge_weight_keys(model_path)
    want = FINAL_STATE_FOR[fmt]
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    policy = accepted_samples(stores, accept)
    planned = plan(stores, seed, policy.keep)
    digest = _plan_digest(stores, planned)
    _check_or_write_plan(
        out,
        {
            "format": fmt,
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
    rows: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    token_rows: list[dict[str, Any]] = []
    path_of, write = _WRITERS.get(fmt, (None, None))
    last_report = started
    for n, p in enumerate(planned, 1):
        store = stores[p.store]
        t = store.tokens(p.id)
        path = path_of(out, p.index) if path_of is not None else None
        if path is not None and write is not None:
            if path.exists():
                counts["already_written"] += 1
            else:
                sample = store[p.id]
                if not (
                    torch.isfinite(sample["aux_hidden_state"]).all()
                    and torch.isfinite(sample["hidden_state"]).all()
                ):
                    counts["skipped_non_finite"] += 1
                    print(f"export: {store.path} {p.id}: NaN/inf state, skipped", file=sys.stderr)
                    continue
                if want is not None:
                    sample["hidden_state"] = final_state_as(manifest, sample["hidden_state"], want)
                write(out, p.index, sample)
                counts["written"] += 1
        else:
            counts["written"] += 1
        length = int(t["input_ids"].numel())
        ids, mask = t["input_ids"].tolist(), t["loss_mask"].tolist()
        if fmt == "speculators":
            # Row i must be hs_i: a skipped sample leaves no row, and later rows keep their
            # file index, so rows are written by index (gaps are refused below).
            rows["input_ids"].append(ids)
            rows["loss_mask"].append(mask)
            rows["seq_len"].append(length)
        if fmt == "tokens":
            token_rows.append({"input_ids": ids, "loss_mask": mask, "id": p.id})
        tokens["total"] += length
        tokens["loss"] += int(sum(mask))
        tokens["max_len"] = max(tokens["max_len"], length)
        per_store[p.store]["samples"] += 1
        per_store[p.store]["tokens"] += length
        entry = {"index": p.index, "store": str(store.path), "id": p.id, "length": length}
        if path is not None:
            entry["file"] = str(path.relative_to(out))
        index_lines.append(json.dumps(entry) + "\n")
        now = time.monotonic()
        if now - last_report >= 30 or n == len(planned):
            print(f"export: {n}/{len(planned)} samples -> {out}", file=sys.stderr, flush=True)
            last_report = now
    if fmt == "speculators":
        if counts["skipped_non_finite"]:
            # speculators maps row i to hs_i: a hole would pair rows with the wrong states.
            raise ValueError(
                f"{counts['skipped_non_finite']} samples have NaN/inf states; speculators pairs "
                "row i with hs_i, so remove them from the store (or re-extract) and export again"
            )
        _write_speculators_rows(out, rows)
    if fmt == "tokens":
        _write_tokens(out, token_rows)
    _write_atomic(out / INDEX_FILE, "".join(index_lines))
    extras: dict[str, Any] = {}
    if fmt == "specforge":
        length_cap = _resolve_max_length(max_length, tokens["max_len"])
        _write_atomic(
            out / SPECFORGE_CONFIG,
            specforge_config(
                output=out,
                target_model_path=model_path,
                output_ids=conv["output_layer_ids"],
                max_length=length_cap,
                dtype=str(manifest.get("dtype")),
                weight_keys=weight_keys,
            ),
        )
        extras = {
            "specforge_config": SPECFORGE_CONFIG,
            "max_length": length_cap,
            "weight_keys": weight_keys,
            "weight_keys_source": (
                f"checkpoint index of {model_path}"
                if weight_keys
                else "not checked (no target_model_path): SpecForge's defaults"
            ),
        }
    summary: dict[str, Any] = {
        "format": fmt,
        "output": str(out),
        "seed": seed,
        "samples": len(index_lines),
        "counts": counts,
        "tokens": tokens,
        "per_store": per_store,
        "manifest": _card_manifest(manifest),
        "conventions": conv,
        "target_model_path": model_path,
        "sources": [source_figures(s) for s in stores],
        "policy": policy.summary(),
        "wall_s": round(time.monotonic() - started, 3),
        **extras,
    }
    _write_atomic(out / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    _write_atomic(out / CARD_FILE, dataset_card(summary))
    return summary


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


def _record_file(store: HiddenStore, run: Path) -> Path:
    """The token records a store was extracted from, within source run `run`."""
    extract_summary = _read_json(store.path / "extract_summary.json") or {}
    records = Path(extract_summary["records"]) if extract_summary.get("records") else None
    if records is not None and records.parent.resolve() == run.resolve():
        return records  # the extract input was another file of this run
    return run / "records.jsonl"


@dataclass
class ExportPolicy:
    """Which stored samples reach training files: by the evidence rung of their record."""

    accept: tuple[str, ...]
    rung_of: dict[tuple[int, str], str]
    exported: Counter[str] = field(default_factory=Counter)
    excluded: Counter[str] = field(default_factory=Counter)

    def keep(self, store: int, sample_id: str) -> bool:
        rung = self.rung_of.get((store, sample_id), "no_record")
        ok = rung in self.accept or rung == "no_record"  # a store without records: as stored
        (self.exported if ok else self.excluded)[rung] += 1
        return ok

    def summary(self) -> dict[str, Any]:
        return {
            "accept": list(self.accept),
            "exported_by_evidence": dict(sorted(self.exported.items())),
            "excluded_by_evidence": dict(sorted(self.excluded.items())),
        }


def accepted_samples(stores: Sequence[HiddenStore], accept: Sequence[str] | None) -> ExportPolicy:
    """The export policy over the stores' source records (last record of an id wins)."""
    from kimi_pipe.core.evidence import NEVER_USABLE, evidence_of, parse_accept

    rung_of: dict[tuple[int, str], str] = {}
    for si, store in enumerate(stores):
        ids = set(store.ids)
        for run in (Path(r) for r in store.manifest.get("source_runs", [])):
            rec_file = _record_file(store, run)
            if not rec_file.exists():
                continue
            for rec in iter_records(rec_file):
                sid = str(rec.get("id"))
                if sid in ids:
                    never = NEVER_USABLE & set(rec.get("issues") or ())
                    rung_of[(si, sid)] = "never_usable" if never else evidence_of(rec)
    return ExportPolicy(parse_accept(accept), rung_of)


def source_figures(store: HiddenStore) -> dict[str, Any]:
    """Fidelity (audit.json) and billing drift (summary.json, records) of a store's sources."""
    runs = [Path(r) for r in store.manifest.get("source_runs", [])]
    out: dict[str, Any] = {"store": str(store.path), "runs": []}
    for run in runs:
        rec_file = _record_file(store, run)
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
    max_length = OmegaConf.select(cfg, "max_length", default=None)
    summary = export(
        list(stores),
        output,
        str(fmt),
        seed,
        target_model_path=OmegaConf.select(cfg, "target_model_path", default=None),
        max_length=int(max_length) if max_length is not None else None,
        accept=OmegaConf.select(cfg, "export.accept", default=None),
    )
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
