"""Several datasets in one generate job under one USD cap (`datasets: [B5, B6]`).

The job's directory (`output_dir`) holds one run directory per dataset, `<output_dir>/<name>`,
each a whole generate run of its own (records, journal, summary: resumable alone). They are
bought one after the other in this process, and each is given as its `budget.usd` what the
job's cap leaves after the spend of every other run directory of the job, read from their
spend journals and records as a resume reads them: a request a killed process sent counts at
its worst case until the provider says what it cost. So the spend of all of them together
stays under the cap, across kills and restarts, and a dataset dropped from the list keeps
its spend counted. The job's `summary.json` lists each dataset's outcome and the job's
spend. Other caps (`budget.max_samples`, `budget.max_output_tokens`) hold per dataset.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kimi_pipe.config import CONF_DIR
from kimi_pipe.core.plain import plain
from kimi_pipe.errors import ConfigError
from kimi_pipe.store import atomic
from kimi_pipe.store.layout import ATTEMPT_ERRORS, JOURNAL, RECORDS, SUMMARY
from kimi_pipe.store.records_index import load_resume_index
from kimi_pipe.store.spend_journal import SpendJournal

log = logging.getLogger("kimi_pipe.generate")

# What stops the whole job, not only the dataset it happened in.
JOB_STOPS = frozenset({"payment_required", "auth", "interrupted", "host_error"})


def _load_node(path: Path) -> dict[str, Any]:
    """A conf/dataset/*.yaml file as plain values (these files hold no interpolations)."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a mapping of dataset settings")
    return data


def dataset_nodes(cfg: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """`datasets_of` the `datasets` setting of a composed config."""
    return datasets_of(cfg.get("datasets"))


def datasets_of(given: Any) -> list[dict[str, Any]] | None:
    """The `datasets` setting as dataset nodes (None: not set, one dataset). An item is a
    name of conf/dataset/<name>.yaml or a whole dataset node (a mapping with a `name`;
    without a `source` it is a local JSONL file, conf/dataset/jsonl.yaml)."""
    items = plain(given)
    if items is None:
        return None
    if isinstance(items, str):
        items = [s for s in (p.strip() for p in items.split(",")) if s]
    if not isinstance(items, list) or not items:
        raise ConfigError("datasets: give a list of dataset names, e.g. datasets=[B5,B6]")
    nodes: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, str):
            path = CONF_DIR / "dataset" / f"{item}.yaml"
            if not path.is_file():
                known = sorted(p.stem for p in (CONF_DIR / "dataset").glob("*.yaml"))
                raise ConfigError(f"datasets: no dataset {item!r} (conf/dataset/: {known})")
            node = _load_node(path)
        elif isinstance(item, Mapping):
            node = dict(item)
            if "name" not in node:  # its run directory's name: never a default's
                raise ConfigError(f"datasets: {dict(item)} needs a plain name (name: NAME)")
            if "source" not in node:
                node = {**_load_node(CONF_DIR / "dataset" / "jsonl.yaml"), **node}
        else:
            raise ConfigError(f"datasets: {item!r} is neither a dataset name nor a mapping")
        name = node.get("name")
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise ConfigError(f"datasets: a dataset needs a plain name (got {name!r})")
        nodes.append(node)
    names = [str(n["name"]) for n in nodes]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"datasets: {dup} named twice (each gets its own run directory)")
    return nodes


def run_dir_spend(run_dir: Path) -> float:
    """What a generate run directory has spent, as its own resume counts it: the larger of
    its spend journal (open requests at their worst case) and its records plus failed
    attempts. Read only: nothing in the directory is written."""
    spent = 0.0
    journal = run_dir / JOURNAL
    if journal.exists():
        spent = SpendJournal.booked(journal)
    if (run_dir / RECORDS).exists() or (run_dir / ATTEMPT_ERRORS).exists():
        spent = max(spent, load_resume_index(run_dir / RECORDS, run_dir / ATTEMPT_ERRORS).cost)
    return spent


def job_spend(job_dir: Path, but: str | None = None) -> dict[str, float]:
    """Per run directory of the job (every subdirectory holding a spend journal or records,
    listed now or not), what it spent; `but` left out."""
    if not job_dir.is_dir():
        return {}
    return {
        d.name: run_dir_spend(d)
        for d in sorted(job_dir.iterdir())
        if d.name != but
        and d.is_dir()
        and not d.is_symlink()
        and any((d / f).exists() for f in (JOURNAL, RECORDS, ATTEMPT_ERRORS))
    }


def plan_left(cap: float | None, others: dict[str, float]) -> float | None:
    """What a dataset may spend: the job's cap less every other run directory's spend
    (None: no USD cap)."""
    if cap is None:
        return None
    return cap - math.fsum(others.values())


def write_job_summary(
    job_dir: Path, cap: float | None, outcomes: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The job's summary.json: each dataset's outcome, the job's spend against its cap."""
    spend = job_spend(job_dir)
    summary = {
        "job_dir": str(job_dir),
        "budget_usd": cap,
        "spend_usd": math.fsum(spend.values()),
        "spend_usd_by_run_dir": spend,
        "datasets": outcomes,
    }
    atomic.write_json(job_dir / SUMMARY, summary, suffix=".partial", indent=2)
    return summary
