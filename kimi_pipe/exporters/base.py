"""The exporter protocol: what one EAGLE-3 trainer format supplies to the export stage.

An exporter is one class in one file of this package, named by its config
`conf/export/<name>.yaml` (`exporter: kimi_pipe.exporters.<file>.<Class>`): adding a format
is that file plus that config. The engine (`kimi_pipe.exporters`, run by the export stage)
does everything shared: it opens and checks the stores, selects and shuffles the samples,
converts the final state to the exporter's `final_state`, skips non-finite samples, resumes,
writes the index, the summary and the card. The exporter supplies:

* `final_state`: the final-state convention its files hold (`post_norm`, `pre_norm`, or None
  for a format without hidden states);
* `check(ctx)`: refusals and facts known before anything is written;
* `sample_path` / `write_sample`: one file per sample (None / not called for row-only formats);
* `start(ctx)` / `add_row`: every exported sample's ids and mask, streamed in file order
  (for row tables; only when `needs_rows`), after every per-sample file is written;
* `finish(ctx, tokens)`: the files written once at the end, plus summary extras;
* `files(ctx)`: what its files hold (names, shapes, dtype, conventions), the export's own
  description;
* `card_layout(summary)` / `card_training(summary)`: its sections of the dataset card.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import yaml

from kimi_pipe.config import CONF_DIR
from kimi_pipe.errors import ConfigError
from kimi_pipe.extraction.draft_config import draft_config_paths, read_draft_config
from kimi_pipe.plugins import load_target
from kimi_pipe.store import atomic

EXPORT_CONF_DIR = CONF_DIR / "export"


class ExportFormatError(ConfigError, ValueError):
    """An unknown export format, or a format config that names no usable exporter."""


@dataclass
class ExportContext:
    """What an exporter may read while it writes: the stores' common manifest, the conventions
    the stage derived from it, where the files go and the target model's directory."""

    output: Path
    manifest: dict[str, Any]
    conventions: dict[str, Any]
    model_path: str | None
    stores: list[Any] = field(default_factory=list)

    def output_ids(self) -> list[int]:
        """The "output of layer" ids of the aux states the files hold, in the files' order
        (the store's, or the layers `Exporter.select_layers` chose)."""
        return list(self.conventions["output_layer_ids"])


class Exporter:
    """Base class with the defaults of a format that writes no per-sample files."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    final_state: ClassVar[str | None] = None
    # True: the engine streams every row to `add_row` (ids and mask carried from the workers).
    needs_rows: ClassVar[bool] = False

    def __init__(self, settings: Mapping[str, Any] | None = None) -> None:
        self.settings: dict[str, Any] = dict(settings or {})

    # --- before writing -----------------------------------------------------------------
    def select_layers(self, ctx: ExportContext) -> list[int] | None:
        """The aux layers to write ("output of layer" ids, in order), chosen by the format's
        settings: `draft_config` (the drafter's config file, as its trainer reads it) or
        `layer_ids`; None: every layer of the store. The engine refuses, before writing, a
        layer the store does not hold."""
        paths = draft_config_paths(self.settings.get("draft_config"))
        ids = self.settings.get("layer_ids")
        if paths and ids is not None:
            raise ConfigError("set export.draft_config or export.layer_ids, not both")
        if len(paths) > 1:
            raise ConfigError("export.draft_config names one drafter's config per export")
        if paths:
            engine = str(self.settings.get("draft_engine") or "sglang")
            draft = read_draft_config(paths[0], engine=engine)
            self.draft = draft
            return list(draft.output_ids)
        return [int(i) for i in ids] if ids is not None else None

    def check(self, ctx: ExportContext) -> dict[str, Any]:
        """Refuse (raise) before anything is written; return summary extras known now."""
        return {}

    # --- per sample ---------------------------------------------------------------------
    def sample_path(self, output: Path, index: int) -> Path | None:
        """The file sample `index` goes to; None: this format writes no per-sample files."""
        return None

    def write_sample(self, output: Path, index: int, sample: dict[str, torch.Tensor]) -> None:
        """Write one sample (final state already in `final_state`) to `sample_path`."""
        raise NotImplementedError

    def refuse_sample(self, sample: dict[str, torch.Tensor]) -> str | None:
        """A reason (a short code, counted as `skipped_<code>`) to leave one sample out because
        the trainer's reader would reject it; None: write it."""
        return None

    def start(self, ctx: ExportContext) -> None:
        """Called once after the per-sample files, before the first `add_row` (in the
        exporting process; the per-sample files may have been written by other processes)."""

    def add_row(self, index: int, sample_id: str, input_ids: list[int], mask: list[int]) -> None:
        """Called for every exported sample in file order (after a skipped one: not called).
        Write it out (or buffer a bounded batch): holding every row would grow with the run."""

    def row_bytes(self, samples: int, tokens: int) -> dict[str, int]:
        """The JSON-lines files this format writes, with an upper bound of their bytes for
        `samples` rows of `tokens` in all (the Hub planner cuts them at line ends)."""
        return {}

    def dataset_bytes(self, samples: int, tokens: int) -> int:
        """An upper bound of the Arrow bytes of the `datasets` rows this format writes."""
        return 0

    # --- at the end ---------------------------------------------------------------------
    def finish(self, ctx: ExportContext, counts: dict[str, int], tokens: dict[str, int]) -> dict:
        """Write the files made once (row tables, trainer configs); return summary extras."""
        return {}

    def files(self, ctx: ExportContext) -> dict[str, Any]:
        """What the written files hold: layout, tensors, dtype, final state, scale layout."""
        return {"final_state": self.final_state}

    def states_description(
        self,
        ctx: ExportContext,
        dtype: str,
        layer_convention: str = "output_of_layer",
        scale_layout: str | None = None,
    ) -> dict[str, Any]:
        """The end of `files` for a format that writes hidden states: their dtype and scale
        layout, the final-state convention, and the layer ids in the trainer's convention
        (`output_of_layer`: the store's output ids; `input_of_layer`: its capture ids)."""
        output = ctx.output_ids()
        ids = output if layer_convention == "output_of_layer" else [i + 1 for i in output]
        return {
            "dtype": dtype,
            "scale_layout": scale_layout,
            "final_state": self.final_state,
            "layer_convention": layer_convention,
            "layer_ids": ids,
        }

    # --- the dataset card ---------------------------------------------------------------
    def card_layout(self, summary: dict[str, Any]) -> list[str]:
        return []

    def card_training(self, summary: dict[str, Any]) -> list[str]:
        return []


# --------------------------------------------------------------------------- the registry


def export_formats() -> tuple[str, ...]:
    """Every format with a config in conf/export/ (one file per format)."""
    return tuple(sorted(p.stem for p in EXPORT_CONF_DIR.glob("*.yaml")))


def format_settings(name: str) -> dict[str, Any]:
    """conf/export/<name>.yaml as a plain dict; ExportFormatError for an unknown format."""
    path = EXPORT_CONF_DIR / f"{name}.yaml"
    if not name or "/" in name or not path.is_file():
        raise ExportFormatError(
            f"format={name!r} is not supported; choose one of {list(export_formats())} "
            f"(one config each in {EXPORT_CONF_DIR})"
        )
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ExportFormatError(f"{path}: expected a mapping")
    return data


def load_exporter(name: str, settings: Mapping[str, Any] | None = None) -> Exporter:
    """The exporter of format `name`, with its config's settings (overridden by `settings`)."""
    merged = {**format_settings(name), **dict(settings or {})}
    target = merged.get("exporter")
    if not isinstance(target, str) or "." not in target:
        raise ExportFormatError(f"conf/export/{name}.yaml: 'exporter' must name a class")
    try:  # the one plug-in resolver (kimi_pipe/plugins.py); exporters live in this package
        cls = load_target(target, kind=f"conf/export/{name}.yaml: exporter",
                           within="kimi_pipe.exporters")  # fmt: skip
    except ConfigError as exc:
        raise ExportFormatError(str(exc)) from None
    if not (isinstance(cls, type) and issubclass(cls, Exporter)):
        raise ExportFormatError(f"conf/export/{name}.yaml: {target!r} is not an Exporter")
    return cls(merged)


# --------------------------------------------------------------------------- file helpers


def write_atomic(path: Path, text: str) -> None:
    atomic.write_text(path, text)


def save_torch(path: Path, obj: dict[str, Any], *, compress: bool = False) -> None:
    """torch.save, tmp + rename; gzip'ed when asked (SpecForge reads `.ckpt.gz` that way)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_path(path) as tmp:
        if compress:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            # mtime=0: the same tensors give the same bytes (a resumed export is reproducible).
            with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
                gz.write(buffer.getvalue())
        else:
            torch.save(obj, tmp)


def json_line(obj: Any) -> str:
    return json.dumps(obj) + "\n"
