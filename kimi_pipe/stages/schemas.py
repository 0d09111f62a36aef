"""The config groups' schemas, registered in Hydra's ConfigStore as each group's base
(conf/config.yaml's defaults list `optional schemas@<group>: <group>` before the group).

A schema is the group's settings dataclass as its module defines it (BudgetSettings, ...),
copied without `frozen` (Hydra merges the yaml and the overrides into it) and with each
field's one-line description in its metadata (`help`). Composed through a stage's command,
a key the group lacks or a value of the wrong type then fails at compose (a did-you-mean
from the command layer); a compose that never imported the command layer reads the yaml
alone, and the stage's typed read (`node_settings`) still checks every value.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from kimi_pipe.conformance.probe import ProbeSettings
from kimi_pipe.providers.budget import BudgetSettings
from kimi_pipe.reporting.audit import AuditSettings
from kimi_pipe.reporting.report import ReportSettings

# Each field's description, by group; a field missing here is a test failure, not a blank.
HELP: dict[str, dict[str, str]] = {
    "budget": {
        "usd": "the hard USD cap of the run directory (earlier runs into it count); null: none",
        "max_samples": "at most this many samples answered; null: no cap",
        "max_output_tokens": "at most this many output tokens bought; null: no cap",
        "reserve_factor": "multiplier (>= 1) on each request's worst case when reserving",
        "overbill_guard": "requests in flight are held at this multiple of their worst case",
        "slow_start": "one request in flight at first, doubled while bills stay in the guard",
        "max_usd_per_sample": "a sample whose worst case costs more is skipped; null: no cap",
        "key_poll_s": "seconds between reads of the key's own usage from the provider",
    },
    "report": {
        "sweep_dir": "a run directory, or a directory above several (required)",
        "out_dir": "where report.md and the charts go; null: sweep_dir",
        "min_ok_rate": "a provider is left out below this share of ids agreeing with billing",
        "max_error_rate": "a provider is left out above this share of requests in error",
        "min_tool_valid_rate": "a provider is left out below this share of valid tool calls",
        "ignore_quantizations": "quantisations unfit for training data: [fp4,...] or fp4,...",
        "rank_step": "rates within this of the best rank as equal to it",
    },
    "audit": {
        "truth": "where the true ids come from: hf_greedy | replies | response",
        "run_dir": "a generate run directory (reads its records.jsonl)",
        "records": "or a token-records JSONL file",
        "replies": "truth=replies: a JSONL of engine replies ({id, reply})",
        "output_dir": "where audit.json and audit.md go; null: beside the records",
        "model_path": "hf_greedy: the target's weights; null: the model config's",
        "device": "hf_greedy: cpu | cuda",
        "dtype": "hf_greedy: the dtype the engine served (float32, bfloat16, ...)",
        "threads": "hf_greedy: torch threads; null: torch's default",
        "max_new_tokens": "hf_greedy: when a record does not say what max_tokens it asked for",
        "limit": "audit only the first N records; null: all",
        "examples": "mismatches listed in audit.md",
        "end_markers": "extra end-of-turn marker names besides the model's output `end`",
    },
    "sweep": {
        "providers": "OpenRouter provider slugs (required): [a,b] or a,b",
        "n": "prompts per provider: the same first n of the dataset for every one",
        "usd": "the budget of the whole sweep, split evenly; null: budget.usd",
        "sweep_dir": "where the jobs write; null: runs/sweep/<dataset name>",
        "report": "write report.md and charts into sweep_dir afterwards",
        "dry_run": "print the plan and the generate command, buy nothing",
        "probes": "conformance probes first, into <sweep_dir>/probes",
        "probe_usd": "the probes' own budget; null: the battery's usd_each per provider",
        "overrides": "extra generate overrides for the jobs and probes",
    },
    "probe": {
        "providers": "OpenRouter provider slugs (required): [a,b] or a,b",
        "usd": "USD cap of all providers together; null: the battery's usd_each each",
        "output_dir": "where conformance.json and conformance.md go",
        "battery": "a battery file; null: conf/probes/<model.name>.yaml",
        "overrides": "extra generate overrides for the battery's jobs",
    },
}

# Fields a stage accepts in more than one shape (`a,b` or one slug where a list belongs: its
# `comma_lists` fix makes the list): typed Any here, checked by the stage's typed read.
LOOSE: dict[str, tuple[str, ...]] = {
    "report": ("ignore_quantizations",),
    "probe": ("providers",),
    "sweep": ("providers",),
}


@dataclass
class SweepFields:
    """The `sweep` group's fields. kimi_pipe/stages/sweep.py's SweepSettings extends them
    (defined here, not there: importing a stage into the command layer would make a circle)."""

    providers: list[str] = field(default_factory=list)
    n: int = 50
    usd: float | None = None
    sweep_dir: str | None = None
    report: bool = True
    dry_run: bool = False
    probes: bool = True
    probe_usd: float | None = None
    overrides: list[str] = field(default_factory=list)


SETTINGS: dict[str, type] = {
    "budget": BudgetSettings,
    "report": ReportSettings,
    "audit": AuditSettings,
    "probe": ProbeSettings,
    "sweep": SweepFields,
}


def schema_of(group: str, settings: type) -> type:
    """`settings` as a mutable dataclass, each field with its type, default and `help`."""
    hints = typing.get_type_hints(settings)
    made = []
    for item in dataclasses.fields(settings):
        kind = Any if item.name in LOOSE.get(group, ()) else hints[item.name]
        default: Any = item.default
        if isinstance(default, tuple):  # a tuple default (Policy's): a list in a config
            factory: Any = _list_of(default)
            default = dataclasses.MISSING
        else:
            factory = item.default_factory
        spec = dataclasses.field(
            default=default, default_factory=factory, metadata={"help": HELP[group][item.name]}
        )
        made.append((item.name, kind, spec))
    schema = dataclasses.make_dataclass(f"{settings.__name__}Schema", made)
    schema.__module__ = __name__  # pickled configs find it here
    return schema


def _list_of(values: tuple[Any, ...]) -> Any:
    return lambda: list(values)


SCHEMAS: dict[str, type] = {group: schema_of(group, cls) for group, cls in SETTINGS.items()}
globals().update({schema.__name__: schema for schema in SCHEMAS.values()})


def register() -> None:
    """Each schema as the option `schemas/<group>` (idempotent: the store replaces it)."""
    store = ConfigStore.instance()
    for group, schema in SCHEMAS.items():
        store.store(group="schemas", name=group, node=schema)


register()
