"""The config's schemas, registered in Hydra's ConfigStore as the bases the yaml is merged
into (conf/config.yaml's defaults list): `schemas/config`, the whole config's (its own keys
typed, the groups open: each is typed by its own base), `schemas/<group>` for a group with
a settings dataclass, and `schemas/<group>/<option>` for a group whose options differ in
keys, chosen by the group's choice (`${export}`): export and dataset by their settings,
the groups without a settings dataclass by each option's yaml (MIRRORED).

A schema of settings is the dataclass as its module defines it (BudgetSettings, ...),
copied without `frozen` (Hydra merges the yaml and the overrides into it) and with each
field's one-line description (settings_help.py) in its metadata (`help`, which `--help`
shows). Composed through a stage's command, a key the node lacks or a value of the wrong
type then fails at compose (a did-you-mean from the command layer); a compose that never
imported the command layer reads the yaml alone, and the stage's typed read
(`node_settings`) still checks.
"""

from __future__ import annotations

import dataclasses
import keyword
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from kimi_pipe.config import CONF_DIR
from kimi_pipe.conformance.auto import AutoSettings
from kimi_pipe.conformance.probe import ProbeSettings
from kimi_pipe.core.serving import ServingProfile
from kimi_pipe.providers.budget import BudgetSettings
from kimi_pipe.reporting.audit import AuditSettings
from kimi_pipe.reporting.report import ReportSettings
from kimi_pipe.stages.settings_help import HELP, MIRRORED_HELP

# Fields a stage accepts in more than one shape (`a,b` or one slug where a list belongs: its
# `comma_lists` fix makes the list; one path or a list of them): typed Any here, checked by
# the stage's own read.
LOOSE: dict[str, tuple[str, ...]] = {
    "": ("stores", "datasets"),
    "export": ("accept", "layer_ids", "draft_config"),
    "report": ("ignore_quantizations",),
    "probe": ("providers",),
    "sweep": ("providers",),
}


@dataclass
class HubFields:
    """`export.push_to_hub`'s fields, as kimi_pipe/exporters/hub.py's HubSettings has them (a
    copy, kept equal by a test: importing anything of kimi_pipe.exporters loads torch, which a
    bare install's `kimi-pipe reconstruct` must not need)."""

    repo_id: str | None = None
    private: bool = True
    shard_bytes: int = 10 * 10**9
    files_per_folder: int = 1000
    folder: str | None = None
    revision: str | None = None


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


@dataclass
class ValidationFields:
    """`validation`: the checks made on every reconstructed sample (no stage class of its own:
    generate and reconstruct read the two values)."""

    billing_tolerance: int = 0
    record_ids: str = "engine"


@dataclass
class TopFields:
    """conf/config.yaml's own keys (the stages' inputs and outputs, as written there)."""

    input: str | None = None
    output: str | None = None
    records: str | None = None
    run_dir: str | None = None
    format: str | None = None
    stores: list[str] = field(default_factory=list)
    seed: int | None = 0  # null: 0, as before the schema
    target_model_path: str | None = None
    max_length: int | None = None
    purchase_digest: str | None = None
    output_dir: str | None = None
    datasets: list[str] | None = None


@dataclass
class ExportFields:
    """Every export option's keys: the format's name and class, then the engine's own
    (conf/config.yaml); a format's own keys go between (EXPORT_OPTIONS)."""

    name: str = "specforge"
    exporter: str = ""
    accept: list[str] | None = None
    workers: int = 1
    storage_options: dict[str, Any] = field(default_factory=dict)
    push_to_hub: Any = None  # typed by HubFields' schema (EXPORT_SCHEMAS)


@dataclass
class DrafterLayers:
    """The layers a drafter's format writes (dflash, dspark, modelopt)."""

    draft_config: str | None = None
    layer_ids: list[int] | None = None
    draft_engine: str = "sglang"


@dataclass
class MaxLength:
    max_length: int | None = None


@dataclass
class Compressed:
    compress: bool = False


@dataclass
class SpeculatorsFields:
    dtype: str | None = None


@dataclass
class JsonlDataset:
    """dataset=jsonl: a local JSONL file of prompts."""

    name: str = "jsonl"
    source: str = "jsonl"
    path: str = MISSING
    limit: int | None = None
    drop_trailing_assistant: bool = True


@dataclass
class HubDataset:
    """A Hugging Face Hub dataset (source: hf; B3..B8)."""

    name: str = MISSING
    source: str = "hf"
    hf_id: str = MISSING
    hf_config: str | None = None
    split: str = "train"
    revision: str | None = None
    streaming: bool = False
    shuffle_buffer: int = 10000
    cache_dir: str | None = None
    num_samples: int | None = None
    seed: int | None = None
    drop_trailing_assistant: bool = True
    mapping: Any = None  # its keys depend on its kind (single_turn, conversation)


SETTINGS: dict[str, type] = {
    "budget": BudgetSettings,
    "report": ReportSettings,
    "audit": AuditSettings,
    "probe": ProbeSettings,
    "sweep": SweepFields,
    "validation": ValidationFields,
    "serving_auto": AutoSettings,
    "serving": ServingProfile,
}

# A group whose options have keys of their own: each option's settings, by the option's
# name (export) or by its `source` (dataset), so that a key another option has is still "no
# such setting" here. An option not named (a config of the user's own) stays open.
EXPORT_OPTIONS: dict[str, tuple[type, ...]] = {
    "specforge": (MaxLength, Compressed),
    "dflash": (DrafterLayers, Compressed),
    "dspark": (DrafterLayers, Compressed),
    "modelopt": (DrafterLayers,),
    "speculators": (SpeculatorsFields,),
    "tokens": (),
}
DATASET_SOURCES: dict[str, type] = {"jsonl": JsonlDataset, "hf": HubDataset}


def _load_yaml(text: str) -> Any:
    """libyaml's safe loader where PyYAML has it (the same values for conf/, about ten times
    faster: every command reads its options here at import), else PyYAML's own."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def schema_of(group: str, settings: type) -> type:
    """`settings` as a mutable dataclass, each field with its type, default and `help`."""
    return _made(group, f"{settings.__name__}Schema", [settings])


def _made(
    group: str, name: str, parts: Sequence[type], first: Sequence[str] = (), **nested: type
) -> type:
    """The fields of `parts` (those named `first` first) as one schema (see `schema_of`);
    `nested`: a field typed by another schema."""
    items = {f.name: (f, typing.get_type_hints(p)) for p in parts for f in dataclasses.fields(p)}
    made = []
    for key in [*first, *(k for k in items if k not in first)]:
        item, hints = items[key]
        if key in nested:
            made.append((key, nested[key], field(default_factory=nested[key])))
            continue
        kind = Any if key in LOOSE.get(group, ()) else hints[key]
        default: Any = item.default
        if isinstance(default, tuple):  # a tuple default (Policy's): a list in a config
            factory: Any = _list_of(default)
            default = dataclasses.MISSING
        else:
            factory = item.default_factory
        spec = field(default=default, default_factory=factory, metadata={"help": HELP[group][key]})
        made.append((key, kind, spec))
    schema = dataclasses.make_dataclass(name, made)
    schema.__module__ = __name__  # pickled configs find it here
    globals()[name] = schema
    return schema


def _list_of(values: tuple[Any, ...]) -> Any:
    return lambda: list(values)


def _root() -> type:
    """The whole config's schema, its keys in the order composing gives them: the groups of
    conf/config.yaml's defaults list, open (a group's schema is its own base, and a job may
    swap a group's node whole: stages/jobs/groups.with_overrides), then its own keys at
    `_self_`, typed by TopFields or SCHEMAS (a group among them stays open)."""
    written = _load_yaml((CONF_DIR / "config.yaml").read_text(encoding="utf-8"))
    own, hints = (
        {f.name: f for f in dataclasses.fields(TopFields)},
        typing.get_type_hints(TopFields),
    )
    made: list[Any] = []
    for entry in written["defaults"]:
        keys = [k for k in written if k not in ("defaults", "hydra")] if entry == "_self_" else []
        for key in (k for k in keys if k not in {m[0] for m in made}):
            if key in SCHEMAS:
                made.append((key, SCHEMAS[key], field(default_factory=SCHEMAS[key])))
            elif key in own:
                kind, item = Any if key in LOOSE[""] else hints[key], own[key]
                made.append((key, kind, field(default=item.default,
                                              default_factory=item.default_factory,
                                              metadata={"help": HELP[""][key]})))  # fmt: skip
            else:
                made.append((key, Any, field(default=None)))
        if isinstance(entry, dict):  # a group of the config's (not an override of Hydra's)
            made += [
                (k.split()[-1], Any, field(default=None))
                for k in entry
                if "@" not in k and not k.startswith("override ")
            ]
    schema = dataclasses.make_dataclass("ConfigSchema", made)
    schema.__module__ = __name__
    return schema


SCHEMAS: dict[str, type] = {group: schema_of(group, cls) for group, cls in SETTINGS.items()}
HUB = schema_of("export.push_to_hub", HubFields)
EXPORT_SCHEMAS: dict[str, type] = {
    option: _made(
        "export",
        f"{option.title()}ExportSchema",
        [*own, ExportFields],
        first=("name", "exporter"),  # then the format's own keys, as its yaml has them
        push_to_hub=HUB,
    )
    for option, own in EXPORT_OPTIONS.items()
}
DATASET_SCHEMAS: dict[str, type] = {
    source: schema_of("dataset", cls) for source, cls in DATASET_SOURCES.items()
}
ConfigSchema = _root()

# Groups whose settings have no dataclass yet: each option's schema is its yaml's own keys,
# a number or a bool typed by the kind written there (a string, a null, a list or an empty
# mapping stays open: `extract.node_rank: auto` also takes 0, which a str field would make
# "0"; a mapping is a schema of its own), so a value of another kind fails at compose as in
# a described group (so a yaml writes a setting that takes fractions, seconds or prices,
# with its decimal point: `timeout_s: 900.0`). An option that extends another (its own defaults
# list) stays open, and so do the keys named here: the provider's sampling params are sent
# as given and digested into the run directory's name (a float field would make 1 into 1.0).
MIRRORED: dict[str, tuple[str, ...]] = {
    "extract": (),
    "resolve": (),
    "model": (),
    "provider": ("params",),
}
KINDS: tuple[tuple[type, Any], ...] = (
    (bool, bool | None),
    (int, int | None),
    (float, float | None),
)


def mirrored(
    name: str, written: dict[str, Any], group: str, open_keys: tuple[str, ...] = (), at: str = ""
) -> type:
    """The schema of one option's yaml (see MIRRORED), each field described by MIRRORED_HELP
    (`at`: the dotted place of a nested mapping below the group)."""
    made: list[Any] = []
    for key, value in written.items():
        about = {"help": MIRRORED_HELP[group][at + key]} if _named(key) else {}
        if key not in open_keys and isinstance(value, dict) and value and all(map(_named, value)):
            nested = mirrored(f"{name}_{key}", value, group, at=f"{at}{key}.")
            made.append((key, nested, field(default_factory=nested, metadata=about)))
            continue
        kind = next((k for t, k in KINDS if isinstance(value, t) and key not in open_keys), Any)
        made.append((key, kind, field(default=None, metadata=about)))
    schema = dataclasses.make_dataclass(name, made)
    schema.__module__ = __name__
    globals()[name] = schema
    return schema


def _named(key: object) -> bool:
    """A key a field may have (a mapping of markers, `<|im_end|>: ...`, stays open)."""
    return isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key)


def register() -> None:
    """The config's schema as `schemas/config`, a group's as `schemas/<group>`, an export
    option's as `schemas/export/<name>`, a dataset option's (by its source) as
    `schemas/dataset/<name>` (idempotent: the store replaces them)."""
    store = ConfigStore.instance()
    for name, schema in {"config": ConfigSchema, **SCHEMAS}.items():
        store.store(group="schemas", name=name, node=schema)
    for option, schema in EXPORT_SCHEMAS.items():
        store.store(group="schemas/export", name=option, node=schema)
    for path in sorted((CONF_DIR / "dataset").glob("*.yaml")):
        source = _load_yaml(path.read_text(encoding="utf-8")).get("source")
        if source in DATASET_SCHEMAS:
            store.store(group="schemas/dataset", name=path.stem, node=DATASET_SCHEMAS[source])
    for group, open_keys in MIRRORED.items():
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            written = _load_yaml(path.read_text(encoding="utf-8")) or {}
            if "defaults" not in written:
                schema = mirrored(f"_{group}_{path.stem}", written, group, open_keys)
                store.store(group=f"schemas/{group}", name=path.stem, node=schema)


register()
