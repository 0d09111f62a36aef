"""Rows streamed into a `datasets` dataset: memory follows a batch of rows, not the run.

`Dataset.from_dict` needs every row in Python lists first (at 100x the seeds, billions of
token ids). `save_rows` writes the rows through `datasets`' own `ArrowWriter` to a scratch
Arrow file, `batch_rows` at a time, memory-maps it and lets `save_to_disk` copy it into the
usual `load_from_disk` layout; the same rows give the same data files and dataset_info.json
as `from_dict` did (tests/test_export_parallel.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

DEFAULT_BATCH_ROWS = 256  # rows buffered in Python before an Arrow batch is written


def save_rows(
    rows: Iterable[Mapping[str, Any]],
    target: Path,
    columns: Mapping[str, list[Any]],
    *,
    torch_format: bool = False,
    batch_rows: int | None = None,
) -> int:
    """Write `rows` as a dataset directory at `target` (made new; replaced by the caller).
    `columns`: the empty columns of a dataset without rows (their names, in order).
    Returns the number of rows."""
    from datasets import Dataset  # optional dep: datasets (extract extra)
    from datasets.arrow_writer import ArrowWriter  # optional dep

    scratch = target.parent / f".{target.name}.arrow.tmp"
    if scratch.exists():
        scratch.unlink()
    n = 0
    writer = ArrowWriter(path=str(scratch), writer_batch_size=batch_rows or DEFAULT_BATCH_ROWS)
    try:
        for row in rows:
            writer.write(dict(row))
            n += 1
        if n:
            writer.finalize()
    finally:
        writer.close()
    if target.exists():
        shutil.rmtree(target)
    try:
        if n:
            ds = Dataset.from_file(str(scratch))  # memory-mapped
        else:
            ds = Dataset.from_dict({k: list(v) for k, v in columns.items()})
        if torch_format:
            ds.set_format(type="torch")
        ds.save_to_disk(str(target))
        del ds
    finally:
        scratch.unlink(missing_ok=True)
    return n
