"""What an export knows of its sources: the accept policy over the records the stores were
extracted from (by evidence rung; a drawn record says so), and each source run's fidelity
(audit.json), billing drift and yield in tokens and dollars, for the summary and the card."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kimi_pipe.core.evidence import (
    NEVER_USABLE,
    POSTERIOR_SAMPLED,
    PREFIX_PROVEN,
    evidence_of,
    has_prefix,
    parse_accept,
)
from kimi_pipe.exporters.prefix import cut_to_prefix, run_yield
from kimi_pipe.exporters.stores import store_name
from kimi_pipe.store.hidden_store import HiddenStore
from kimi_pipe.store.layout import AUDIT_JSON, RECORDS, SUMMARY
from kimi_pipe.store.records import iter_records


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def run_mode(run: Path) -> dict[str, Any]:
    """The model config a generate run bought its answers under, from the run's saved config:
    the generate command's (`.hydra/generate/config.yaml`, or `.hydra/config.yaml`), else a
    pipeline's (`<run>/<pipeline>_config.yaml`). `model.name` and `model.mode` (e.g. a thinking
    or an instant mode); `mode` None when no saved config says (or the model has no modes)."""
    candidates = [run / ".hydra" / "generate" / "config.yaml", run / ".hydra" / "config.yaml"]
    candidates += sorted(run.glob("*_config.yaml"))
    for path in candidates:
        try:
            cfg = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            continue
        model = cfg.get("model") if isinstance(cfg, dict) else None
        if isinstance(model, dict):
            mode = model.get("mode")
            return {"model": model.get("name"), "mode": None if mode is None else str(mode)}
    return {"model": None, "mode": None}


def mode_counts(per_store: Sequence[dict[str, Any]], sources: Sequence[dict[str, Any]]) -> dict:
    """Exported samples and tokens per model mode (a dataset may mix modes: one store per
    generate run, each run one mode). A store whose runs disagree counts under "mixed"."""
    out: dict[str, dict[str, int]] = {}
    for store, source in zip(per_store, sources, strict=True):
        modes = {str(r.get("mode")) for r in source["runs"] if r.get("mode") is not None}
        key = modes.pop() if len(modes) == 1 else ("mixed" if modes else "unknown")
        slot = out.setdefault(key, {"samples": 0, "tokens": 0, "stores": 0})
        slot["samples"] += int(store["samples"])
        slot["tokens"] += int(store["tokens"])
        slot["stores"] += 1
    return out


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
    return run / RECORDS


@dataclass
class ExportPolicy:
    """Which stored samples reach training files: by the evidence rung of their record."""

    accept: tuple[str, ...]
    rung_of: dict[tuple[int, str], str]
    exported: Counter[str] = field(default_factory=Counter)
    excluded: Counter[str] = field(default_factory=Counter)
    tokens: Counter[str] = field(default_factory=Counter)  # exported tokens per rung
    loss_tokens: Counter[str] = field(default_factory=Counter)  # ... with loss_mask 1

    def count_tokens(self, store: int, sample_id: str, total: int, loss: int) -> None:
        rung = self.rung_of.get((store, sample_id), "no_record")
        self.tokens[rung] += total
        self.loss_tokens[rung] += loss

    def row_labels(self, store: int, sample_id: str) -> dict[str, Any]:
        """What an index row says of its sample: its rung, and `drawn` for ids drawn from
        the target's posterior (posterior_sampled: not the ids bought, core/posterior.py)."""
        rung = self.rung_of.get((store, sample_id), "no_record")
        return {"evidence": rung, **({"drawn": True} if rung == POSTERIOR_SAMPLED else {})}

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
            "exported_tokens_by_evidence": dict(sorted(self.tokens.items())),
            "exported_loss_tokens_by_evidence": dict(sorted(self.loss_tokens.items())),
        }


def accepted_samples(stores: Sequence[HiddenStore], accept: Sequence[str] | None) -> ExportPolicy:
    """The export policy over the stores' source records (last record of an id wins)."""

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
                    rung = "never_usable" if never else evidence_of(rec)
                    if rung == PREFIX_PROVEN and not cut_to_prefix(store, sid, rec):
                        rung = "prefix_not_cut"  # stored whole: never past the prefix
                    elif (
                        rung == POSTERIOR_SAMPLED
                        and has_prefix(rec)
                        and cut_to_prefix(store, sid, rec)
                    ):
                        rung = PREFIX_PROVEN  # stored as its proven prefix only: exact
                    rung_of[(si, sid)] = rung
    return ExportPolicy(parse_accept(accept), rung_of)


def source_figures(store: HiddenStore, accept: Sequence[str] | None = None) -> dict[str, Any]:
    """Fidelity (audit.json), billing drift (summary.json, records) and yield in tokens and
    dollars under `accept` (core/token_yield.py) of a store's sources."""
    runs = [Path(r) for r in store.manifest.get("source_runs", [])]
    out: dict[str, Any] = {"store": store_name(store), "runs": []}
    for run in runs:
        rec_file = _record_file(store, run)
        summary = _read_json(run / SUMMARY) or {}
        out["runs"].append(
            {
                "run": str(run),
                **run_mode(run),
                "audit": _read_json(run / AUDIT_JSON),
                "billing_drift_run": summary.get("billing_drift"),
                "tokens_run": summary.get("tokens"),
                "billing_drift_exported": _records_drift(rec_file, set(store.ids)),
                "yield": run_yield(rec_file, summary, accept),
            }
        )
    return out
