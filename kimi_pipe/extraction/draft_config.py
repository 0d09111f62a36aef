"""Capture layers named by a drafter's own config file: the file its trainer reads.

A drafter's `config.json` names the target layers it is trained on. SpecForge reads them from
`--draft-model-config` (scripts/prepare_hidden_states.py: "Capture layers come from the
resolved draft config"); so does this project with `extract.draft_config=PATH` (or a list of
paths: the store captures the union, and each export selects its drafter's layers).

Two spellings, one per drafter family:

* EAGLE-3 (`eagle_config.eagle_aux_hidden_state_layer_ids`): the ids a serving engine is
  given; what they mean depends on the engine (`layers.engine_capture_ids`: SGLang adds 1
  only when the first id is 1, vLLM takes them as input-of-layer ids). `extract.draft_engine`
  names the engine (default `sglang`). SpecForge's `configs/kimi-k25-eagle3.json` names
  `[2, 30, 58]`: input of layers 2, 30, 58 = "output of layer" `[1, 29, 57]`, the default.
* DFlash, DFlash2, Domino, DSpark (`dflash_config.target_layer_ids`): "output of layer" ids
  as given (SpecForge's `extract_context_feature` takes `hidden_states[i + 1]`, and SGLang's
  `set_dflash_layers_to_capture` adds 1 to every id). SpecForge's
  `configs/kimi-k2.7-code-dflash.json` names `[1, 12, 24, 35, 47, 58]`.

A config with neither is refused (SpecForge raises too: "draft config does not define target
capture layer ids"); so is one whose `num_target_layers` is not the target's layer count.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kimi_pipe.errors import ConfigError, MissingFile
from kimi_pipe.extraction.layers import capture_to_output_ids, engine_capture_ids

EAGLE3 = "eagle3"
DFLASH = "dflash"  # the DFlash family: DFlash, DFlash2, Domino, DSpark


@dataclass(frozen=True)
class DraftLayers:
    """What one drafter config asks the store to capture."""

    source: str  # the file (or "inline")
    sha256: str | None  # of the file's bytes, for the manifest's provenance
    family: str  # eagle3 | dflash
    key: str  # the config key the ids were read from
    config_ids: list[int]  # as the file names them
    output_ids: list[int]  # "output of layer" ids (the store's convention)
    rule: str  # how config_ids became output_ids
    num_target_layers: int | None
    architectures: list[str]

    def manifest_entry(self) -> dict[str, Any]:
        return asdict(self)


def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where} must be a non-empty list of layer ids, not {value!r}")
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value):
        raise ConfigError(f"{where} must hold non-negative whole numbers, not {value!r}")
    return [int(i) for i in value]


def draft_layers(
    config: Mapping[str, Any],
    *,
    engine: str = "sglang",
    source: str = "inline",
    sha256: str | None = None,
) -> DraftLayers:
    """The layers a drafter config names, in the store's "output of layer" convention."""
    archs = [str(a) for a in (config.get("architectures") or [])]
    n_target = config.get("num_target_layers")
    n_target = int(n_target) if isinstance(n_target, int) else None
    dflash = config.get("dflash_config")
    if isinstance(dflash, Mapping) and dflash.get("target_layer_ids") is not None:
        ids = _int_list(dflash["target_layer_ids"], f"{source}: dflash_config.target_layer_ids")
        return DraftLayers(
            source,
            sha256,
            DFLASH,
            "dflash_config.target_layer_ids",
            ids,
            list(ids),
            "output of layer as given (SpecForge hidden_states[i + 1]; SGLang captures the "
            "input of layer i + 1)",
            n_target,
            archs,
        )
    eagle = config.get("eagle_config")
    if isinstance(eagle, Mapping) and eagle.get("eagle_aux_hidden_state_layer_ids") is not None:
        ids = _int_list(
            eagle["eagle_aux_hidden_state_layer_ids"],
            f"{source}: eagle_config.eagle_aux_hidden_state_layer_ids",
        )
        capture = engine_capture_ids(ids, engine)
        output = capture_to_output_ids(capture)
        if min(output) < 0:
            raise ConfigError(
                f"{source}: eagle_aux_hidden_state_layer_ids {ids} make {engine} capture the "
                "input of layer 0 (the embeddings), which no store holds"
            )
        return DraftLayers(
            source,
            sha256,
            EAGLE3,
            "eagle_config.eagle_aux_hidden_state_layer_ids",
            ids,
            output,
            f"{engine} capture ids {capture} (input of layer) = output of layer {output}",
            n_target,
            archs,
        )
    raise ConfigError(
        f"{source}: names no capture layers: expected dflash_config.target_layer_ids (DFlash, "
        "DFlash2, Domino, DSpark) or eagle_config.eagle_aux_hidden_state_layer_ids (EAGLE-3)"
    )


def read_draft_config(path: str | os.PathLike[str], *, engine: str = "sglang") -> DraftLayers:
    """`draft_layers` of a config file (a drafter's config.json, or its directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise MissingFile(f"draft config {p} not found (a drafter's config.json)")
    raw = p.read_bytes()
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"draft config {p} is not JSON: {exc}") from None
    if not isinstance(config, Mapping):
        raise ConfigError(f"draft config {p}: expected a JSON object")
    return draft_layers(
        config, engine=engine, source=str(p), sha256=hashlib.sha256(raw).hexdigest()
    )


def draft_config_paths(value: Any) -> list[str]:
    """`extract.draft_config` / `export.draft_config`: null, one path or a list of paths."""
    if value is None or value == "" or value == []:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [str(value)]
    if isinstance(value, Sequence):
        return [str(v) for v in value]
    raise ConfigError(f"draft_config must be a path or a list of paths, not {value!r}")


def union_output_ids(drafts: Sequence[DraftLayers]) -> list[int]:
    """Every layer the drafters name, ascending: what one store captures for all of them."""
    return sorted({i for d in drafts for i in d.output_ids})


def check_target_layers(drafts: Sequence[DraftLayers], num_layers: int) -> None:
    """Refuse a drafter config whose `num_target_layers` is not the target's layer count."""
    for d in drafts:
        if d.num_target_layers not in (None, num_layers):
            raise ConfigError(
                f"{d.source}: num_target_layers {d.num_target_layers} but the target has "
                f"{num_layers} layers: this drafter was made for another model"
            )


def capture_request(
    layer_ids: Any, draft_config: Any, engine: Any = None
) -> tuple[list[int] | None, list[DraftLayers]]:
    """The layer ids an extraction is asked for: `extract.layer_ids`, or the union of the
    layers `extract.draft_config` names, or None (the default rule). Not both."""
    paths = draft_config_paths(draft_config)
    if not paths:
        return (list(layer_ids) if layer_ids is not None else None), []
    if layer_ids is not None:
        raise ConfigError(
            "set extract.layer_ids or extract.draft_config, not both: the draft config is "
            "the one statement of the layers its trainer reads"
        )
    drafts = [read_draft_config(p, engine=str(engine or "sglang")) for p in paths]
    return union_output_ids(drafts), drafts


def record_drafts(
    store_fields: dict[str, Any], drafts: Sequence[DraftLayers], num_layers: int
) -> None:
    """Check the drafters against the target and name them in the store's manifest
    (`draft_configs`: file, sha256, family, ids as written and as stored)."""
    if not drafts:
        return
    check_target_layers(drafts, num_layers)
    extra = store_fields.setdefault("extra", {})
    extra["draft_configs"] = [d.manifest_entry() for d in drafts]
