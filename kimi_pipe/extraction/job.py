"""`ExtractJob`: what one extraction runs, built once at the stage's door
(kimi_pipe/stages/jobs/extract.py). Below the door only this object travels: to the backend
(`open_backend(job)`), the capture loop, the unit workers and, pickled, to Ray actors and
submitit jobs. It is plain data: no config library, nothing open.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kimi_pipe.errors import ConfigError
from kimi_pipe.extraction.resolve_settings import ResolveSettings
from kimi_pipe.store.layout import RECORDS as RECORDS_FILE

EXECUTORS = ("local", "ray", "submitit")


@dataclass(frozen=True)
class ExtractJob:
    """The extract stage's settings (`extract.*` as plain values in `settings`: the backend's
    own keys, the executors' sections), the input and the model facts it needs."""

    backend: str  # a name in kimi_pipe/plugins.py's BACKENDS, or `package.module:attr`
    settings: Mapping[str, Any] = field(default_factory=dict)
    records: Path | None = None  # the token records (None: no input was given)
    output_dir: Path | None = None  # the store (None: `<records dir>/hidden_<backend>`)
    model: Mapping[str, Any] | None = None  # the `model` group (eagle3 ids, tokenizer, ...)
    resolve: ResolveSettings = field(default_factory=ResolveSettings)
    executor: str | None = None  # None: the work shards of extraction/sharding.py

    def __post_init__(self) -> None:
        if self.executor is not None and self.executor not in EXECUTORS:
            raise ConfigError(
                f"extract.executor must be one of {EXECUTORS} or null, not {self.executor!r}"
            )

    def get(self, key: str, default: Any = None) -> Any:
        """`extract.<key>` (its default when the key is absent, as a mapping's get)."""
        return self.settings.get(key, default)

    def with_settings(self, **changes: Any) -> ExtractJob:
        """The same job with some `extract.*` settings replaced (a node's rank, say)."""
        return replace(self, settings={**self.settings, **changes})

    # ----------------------------------------------------------------- input and output

    def records_path(self) -> Path:
        """The token records; a one-line ConfigError when no input was given."""
        if self.records is None:
            raise ConfigError(
                "no input: pass extract.run_dir=RUN_DIR (a generate run) or "
                "extract.records=FILE (token records JSONL)"
            )
        return self.records

    def store_path(self) -> Path:
        """`extract.output_dir`, else `hidden_<backend>` beside the records."""
        if self.output_dir is not None:
            return self.output_dir
        return self.records_path().parent / f"hidden_{self.backend}"

    # ----------------------------------------------------------------- the capture loop

    @property
    def shard(self) -> int:
        return int(self.get("shard", 0) or 0)

    @property
    def num_shards(self) -> int:
        return int(self.get("num_shards", 1) or 1)

    @property
    def only_ok(self) -> bool:
        return bool(self.get("only_ok", True))

    @property
    def accept(self) -> list[str] | None:
        accept = self.get("accept")
        return None if accept is None else [str(a) for a in accept]

    @property
    def max_len(self) -> int | None:
        value = self.get("max_len")
        return None if value is None else int(value)

    @property
    def over_max_len(self) -> str:
        return str(self.get("over_max_len"))

    @property
    def nnodes(self) -> int:
        return int(self.get("nnodes") or 1)

    # ----------------------------------------------------------------- model facts

    @property
    def model_name(self) -> str | None:
        name = (self.model or {}).get("name")
        return None if name is None else str(name)

    @property
    def hf_weights(self) -> str | None:
        path = (self.model or {}).get("hf_weights")
        return None if path is None else str(path)

    def loss_mask_convention(self) -> str:
        """How the stored loss_mask was made: taken from the records, built per
        model.loss_mask."""
        spec = (self.model or {}).get("loss_mask")
        if spec is None:
            return "from token records"
        name = (self.model or {}).get("name", "?")
        parts = ", ".join(f"{k!s}={v}" for k, v in dict(spec).items())
        return f"from token records ({name} model.loss_mask: {parts}; 1 = trained on)"


def records_of(records: Any, run_dir: Any) -> Path | None:
    """The records file: `records` when given, else `<run_dir>/records.jsonl`."""
    if records is not None:
        return Path(str(records))
    if run_dir is not None:
        return Path(str(run_dir)) / RECORDS_FILE
    return None
