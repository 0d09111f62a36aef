"""An export pushed to the Hugging Face Hub as a dataset, laid out within the Hub's limits.

The Hub refuses a file over 50 GB (and advises under 20 GB), a folder of more than 10,000
entries and a repository of more than 100,000 files. A trainer format writes one file per
sample (1.4M files at 100x the seeds), so the Hub copy is **packed**:

    README.md, export_summary.json, ...        the export's small files, as they are
    data-*.arrow, dataset_info.json, ...       a `datasets` directory's files, as they are
    data/00000/part-000000.tar ... part-000999.tar
    data/00001/part-001000.tar ...             the per-sample files in index order (members
                                               keep their paths in the export)
    rows/tokens-00000.jsonl, rows/export_index-00000.jsonl
                                               the line files, cut at line ends

A tar is closed once it holds `shard_bytes` (so a file is at most `shard_bytes` plus one
sample), a line file's part likewise; `files_per_folder` tars a folder. `plan_layout` checks
the limits from counts and sizes alone (samples, tokens, the longest sample, bytes a token
from the format's file description) **before the export writes anything**, and refuses a
layout that cannot fit with the limit and the setting to change. `stage` packs a finished
export into that layout (checked again on the real files) and `push` uploads it with
`HfApi.upload_large_folder(repo_type="dataset")`. The token is read by huggingface_hub from
the environment (`HF_TOKEN`), never from a config; it is never printed.

To use a pushed export: download it (`huggingface_hub.snapshot_download(repo_id,
repo_type="dataset")`), untar every `data/*/*.tar` into one directory and concatenate the
`rows/<name>-*.jsonl` parts in order into `<name>.jsonl`: that is the export as written.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kimi_pipe.errors import ConfigError

GB = 10**9
ARROW_SHARD_BYTES = 500 * 10**6  # datasets' save_to_disk max_shard_size default
SMALL_FILE_BYTES = 10**7  # an estimate's upper bound for a card, summary or config
TAR_MEMBER_OVERHEAD = 1024  # tar header and padding per member, an upper bound
DATA_DIR = "data"
ROWS_DIR = "rows"


class HubLayoutError(ConfigError):
    """A Hub layout that cannot fit the Hub's limits (or bad push_to_hub settings)."""


@dataclass(frozen=True)
class HubLimits:
    """The Hub's published limits (huggingface.co/docs/hub/storage-limits)."""

    max_file_bytes: int = 50 * GB  # refused above
    advised_file_bytes: int = 20 * GB  # advised below (planned files above it: a warning)
    folder_entries: int = 10_000
    repo_files: int = 100_000


@dataclass(frozen=True)
class HubSettings:
    """`export.push_to_hub.*` (conf/config.yaml)."""

    repo_id: str | None = None
    private: bool = True
    shard_bytes: int = 10 * GB
    files_per_folder: int = 1000
    folder: str | None = None  # the packed copy; null: <output>.hub
    revision: str | None = None

    @classmethod
    def from_mapping(cls, value: Mapping[str, Any] | None) -> HubSettings:
        data = dict(value or {})
        if "token" in data:
            raise HubLayoutError(
                "export.push_to_hub.token: a token is never read from a config; export HF_TOKEN "
                "in the environment (huggingface_hub reads it there)"
            )
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise HubLayoutError(
                f"export.push_to_hub: unknown keys {unknown}; known: "
                f"{sorted(cls.__dataclass_fields__)}"
            )
        out = cls(**data)
        if out.repo_id is not None and not re.fullmatch(r"[\w.-]+/[\w.-]+", str(out.repo_id)):
            raise HubLayoutError(
                f"export.push_to_hub.repo_id={out.repo_id!r}: expected 'owner/name'"
            )
        if int(out.shard_bytes) < 1 or int(out.files_per_folder) < 1:
            raise HubLayoutError(
                "export.push_to_hub.shard_bytes and files_per_folder must be >= 1, got "
                f"{out.shard_bytes} and {out.files_per_folder}"
            )
        return out


@dataclass(frozen=True)
class ExportShape:
    """What the planner knows of an export before it is written: counts and sizes."""

    samples: int
    tokens: int
    longest: int  # tokens of the longest sample
    sample_bytes_per_token: int  # per-sample files (0: the format writes none)
    sample_file_overhead: int  # bytes a per-sample file holds beyond its tensors (at most)
    line_files: dict[str, int]  # jsonl files: name -> bytes (cut at line ends)
    longest_line: int  # bytes of the longest line of any line file
    dataset_bytes: int  # Arrow data of a `datasets` directory (speculators' rows)
    small_files: int  # the card, summary, plan, configs, dataset_info.json, state.json


@dataclass
class HubPlan:
    """The planned Hub layout and its figures (all upper bounds)."""

    shape: ExportShape
    settings: HubSettings
    limits: HubLimits
    tars: int
    tar_folders: int
    line_parts: dict[str, int]
    arrow_files: int
    files: int
    max_file_bytes: int
    max_folder_entries: int
    total_bytes: int
    warnings: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "tars": self.tars,
            "tar_folders": self.tar_folders,
            "line_parts": dict(self.line_parts),
            "arrow_files": self.arrow_files,
            "max_file_bytes": self.max_file_bytes,
            "max_folder_entries": self.max_folder_entries,
            "total_bytes": self.total_bytes,
            "shard_bytes": self.settings.shard_bytes,
            "files_per_folder": self.settings.files_per_folder,
            "limits": asdict(self.limits),
            "warnings": list(self.warnings),
        }


# --------------------------------------------------------------------------- estimates

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "float8_e4m3fn": 1,
    "fp8_e4m3": 1,
}


def bytes_per_token(files: Mapping[str, Any]) -> int:
    """Bytes a token of the per-sample tensors in an exporter's file description
    (`Exporter.files`: {"tensors": {name: ["dims with L", dtype]}}); 0 when none."""
    total = 0
    for name, (dims, dtype) in (files.get("tensors") or {}).items():
        parts = [d.strip() for d in str(dims).split(",")]
        if "L" not in parts:
            raise HubLayoutError(f"tensor {name} [{dims}] has no token axis L to plan with")
        if dtype not in _DTYPE_BYTES:
            raise HubLayoutError(f"tensor {name}: no size known for dtype {dtype!r}")
        per = _DTYPE_BYTES[dtype]
        for d in parts:
            if d != "L":
                per *= int(d)
        total += per
    return total


def estimate_shape(
    files: Mapping[str, Any],
    row_files: Mapping[str, int],
    dataset_bytes: int,
    *,
    samples: int,
    tokens: int,
    longest: int,
    per_sample_files: bool,
    index_line_bytes: int = 256,
) -> ExportShape:
    """An export's shape from counts: `files` is the exporter's description, `row_files` its
    jsonl estimates (`Exporter.row_bytes`), `dataset_bytes` its Arrow rows."""
    per_token = bytes_per_token(files) if per_sample_files else 0
    lines = {**dict(row_files), "export_index.jsonl": index_line_bytes * samples}
    return ExportShape(
        samples=samples,
        tokens=tokens,
        longest=longest,
        sample_bytes_per_token=per_token,
        sample_file_overhead=64 * 1024 if per_sample_files else 0,
        line_files=lines,
        longest_line=12 * longest + index_line_bytes,
        dataset_bytes=dataset_bytes,
        small_files=8,
    )


# --------------------------------------------------------------------------- the planner


def plan_layout(
    shape: ExportShape, settings: HubSettings, limits: HubLimits | None = None
) -> HubPlan:
    """The Hub layout of an export of this shape, or HubLayoutError naming the limit broken
    and the setting to change. Works from counts and sizes only: nothing is read or written."""
    lim = limits or HubLimits()
    shard = int(settings.shard_bytes)
    per_folder = int(settings.files_per_folder)
    if shard > lim.max_file_bytes:
        raise HubLayoutError(
            f"export.push_to_hub.shard_bytes={shard:,} is over the Hub's {lim.max_file_bytes:,} "
            "bytes a file: lower it (10 GB is the default; the Hub advises under 20 GB)"
        )
    if per_folder > lim.folder_entries:
        raise HubLayoutError(
            f"export.push_to_hub.files_per_folder={per_folder:,} is over the Hub's "
            f"{lim.folder_entries:,} entries a folder: lower it"
        )
    sample_max = 0
    tars = 0
    total = 0
    if shape.sample_bytes_per_token and shape.samples:
        per_member = shape.sample_file_overhead + TAR_MEMBER_OVERHEAD
        sample_max = shape.longest * shape.sample_bytes_per_token + per_member
        sample_total = shape.tokens * shape.sample_bytes_per_token + shape.samples * per_member
        # A tar closes once it holds >= shard bytes: every tar but the last is that full.
        tars = max(1, math.ceil(sample_total / shard))
        total += sample_total
    line_parts = {}
    line_max = 0
    for name, size in shape.line_files.items():
        line_parts[name] = max(1, math.ceil(size / shard))
        line_max = max(line_max, min(size, shard + shape.longest_line))
        total += size
    arrow_files = math.ceil(shape.dataset_bytes / ARROW_SHARD_BYTES) if shape.dataset_bytes else 0
    total += shape.dataset_bytes + shape.small_files * SMALL_FILE_BYTES
    tar_max = shard + sample_max if tars else 0
    if tars and tars == 1:
        tar_max = min(tar_max, total)
    max_file = max(tar_max, line_max, min(shape.dataset_bytes, ARROW_SHARD_BYTES))
    tar_folders = math.ceil(tars / per_folder) if tars else 0
    root_entries = shape.small_files + arrow_files + (1 if tars else 0) + 1  # + data/, rows/
    files = tars + sum(line_parts.values()) + arrow_files + shape.small_files
    max_folder = max(root_entries, tar_folders, min(tars, per_folder), sum(line_parts.values()))
    plan = HubPlan(
        shape=shape,
        settings=settings,
        limits=lim,
        tars=tars,
        tar_folders=tar_folders,
        line_parts=line_parts,
        arrow_files=arrow_files,
        files=files,
        max_file_bytes=max_file,
        max_folder_entries=max_folder,
        total_bytes=total,
    )
    if sample_max > lim.max_file_bytes:
        raise HubLayoutError(
            f"the longest sample ({shape.longest:,} tokens) makes a {sample_max:,}-byte file, "
            f"over the Hub's {lim.max_file_bytes:,} bytes a file: no packing can push it; "
            "re-extract with a lower extract.max_len"
        )
    if max_file > lim.max_file_bytes:
        most = lim.max_file_bytes - max(sample_max, shape.longest_line)
        raise HubLayoutError(
            f"a packed file could reach {max_file:,} bytes, over the Hub's "
            f"{lim.max_file_bytes:,} bytes a file: lower export.push_to_hub.shard_bytes "
            f"(now {shard:,}) to at most {most:,}"
        )
    if files > lim.repo_files:
        fixed = files - tars - sum(line_parts.values())
        room = lim.repo_files - fixed
        need = math.ceil(total / room) if room > 0 else None
        hint = (
            f"raise export.push_to_hub.shard_bytes (now {shard:,}) to at least {need:,}"
            if need is not None and need + sample_max <= lim.max_file_bytes
            else "split the export over several repositories (fewer stores or samples each)"
        )
        raise HubLayoutError(
            f"the layout needs {files:,} files, over the Hub's {lim.repo_files:,} files a "
            f"repository: {hint}"
        )
    if max_folder > lim.folder_entries:
        raise HubLayoutError(
            f"a folder would hold {max_folder:,} entries, over the Hub's {lim.folder_entries:,}: "
            "raise export.push_to_hub.shard_bytes or lower files_per_folder "
            f"(now {per_folder:,} tars a folder, {tar_folders:,} folders)"
        )
    if max_file > lim.advised_file_bytes:
        plan.warnings.append(
            f"files up to {max_file:,} bytes, over the {lim.advised_file_bytes:,} the Hub "
            "advises: lower export.push_to_hub.shard_bytes"
        )
    return plan


# --------------------------------------------------------------------------- packing


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0  # the same export packs to the same bytes
    info.mode = 0o644
    return info


def _index_files(output: Path, index_file: str) -> Iterator[str]:
    with open(output / index_file) as f:
        for line in f:
            entry = json.loads(line)
            if "file" in entry:
                yield str(entry["file"])


def stage(
    output: Path,
    plan: HubPlan,
    *,
    index_file: str = "export_index.jsonl",
    line_files: tuple[str, ...] = (),
) -> Path:
    """Pack the finished export at `output` into the planned layout (a new directory);
    check the real files against the limits; return the directory."""
    settings = plan.settings
    folder = Path(settings.folder) if settings.folder else output.with_name(output.name + ".hub")
    if folder.resolve() == output.resolve() or output.resolve() in folder.resolve().parents:
        raise HubLayoutError(f"export.push_to_hub.folder={folder} must be outside {output}")
    if folder.exists():
        # The packed copy is made again from the export (the same bytes); huggingface_hub's
        # own `.cache` (what an interrupted upload_large_folder already sent) is kept.
        for child in folder.iterdir():
            if child.name != ".cache":
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    packed: set[str] = set()
    shard = int(settings.shard_bytes)
    number, size = 0, 0
    tar: tarfile.TarFile | None = None
    for rel in _index_files(output, index_file):
        if tar is None:
            path = folder / DATA_DIR / f"{number // settings.files_per_folder:05d}"
            path.mkdir(parents=True, exist_ok=True)
            tar = tarfile.open(  # noqa: SIM115  (closed once full, or after the loop)
                path / f"part-{number:06d}.tar", "w", format=tarfile.GNU_FORMAT
            )
        src = output / rel
        with open(src, "rb") as f:
            tar.addfile(_tar_info(rel, src.stat().st_size), f)
        packed.add(rel)
        size += src.stat().st_size + TAR_MEMBER_OVERHEAD
        if size >= shard:
            tar.close()
            tar, number, size = None, number + 1, 0
    if tar is not None:
        tar.close()
    for name in (*line_files, index_file):
        _split_lines(output / name, folder / ROWS_DIR, shard)
        packed.add(name)
    for src in sorted(output.rglob("*")):
        rel = str(src.relative_to(output))
        if src.is_dir() or rel in packed or any(part.startswith(".") for part in Path(rel).parts):
            continue
        dst = folder / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)  # no second copy where the disk allows it
        except OSError:
            shutil.copy2(src, dst)
    check_folder(folder, plan.limits)
    return folder


def _split_lines(src: Path, rows: Path, shard: int) -> None:
    rows.mkdir(parents=True, exist_ok=True)
    stem = src.name.rsplit(".", 1)[0]
    part, size = 0, 0
    out = open(rows / f"{stem}-{part:05d}.jsonl", "wb")  # noqa: SIM115  (rotated below)
    try:
        with open(src, "rb") as f:
            for line in f:
                if size >= shard:
                    out.close()
                    part, size = part + 1, 0
                    out = open(rows / f"{stem}-{part:05d}.jsonl", "wb")  # noqa: SIM115
                out.write(line)
                size += len(line)
    finally:
        out.close()


def check_folder(folder: Path, limits: HubLimits) -> dict[str, int]:
    """The real packed copy against the limits (HubLayoutError naming the offender)."""
    files, biggest = 0, 0
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # huggingface_hub's own .cache
        if len(dirs) + len(names) > limits.folder_entries:
            raise HubLayoutError(
                f"{root} holds {len(dirs) + len(names):,} entries, over the Hub's "
                f"{limits.folder_entries:,}: lower export.push_to_hub.files_per_folder"
            )
        for name in names:
            size = os.path.getsize(os.path.join(root, name))
            files += 1
            biggest = max(biggest, size)
            if size > limits.max_file_bytes:
                raise HubLayoutError(
                    f"{os.path.join(root, name)} is {size:,} bytes, over the Hub's "
                    f"{limits.max_file_bytes:,}: lower export.push_to_hub.shard_bytes"
                )
    if files > limits.repo_files:
        raise HubLayoutError(
            f"{folder} holds {files:,} files, over the Hub's {limits.repo_files:,}: raise "
            "export.push_to_hub.shard_bytes"
        )
    return {"files": files, "max_file_bytes": biggest}


def push(folder: Path, settings: HubSettings, api: Any = None) -> dict[str, Any]:
    """Upload the packed copy as a dataset repository (`HfApi.upload_large_folder`: resumable,
    it creates the repository if absent). The token comes from HF_TOKEN, read by
    huggingface_hub; an `api` may be passed (tests: a recording fake)."""
    if not settings.repo_id:
        raise HubLayoutError("export.push_to_hub.repo_id is not set")
    if api is None:
        if not os.environ.get("HF_TOKEN"):
            raise HubLayoutError(
                "push_to_hub needs a Hugging Face token in the environment: export HF_TOKEN "
                "(a write token; never put it in a config)"
            )
        from huggingface_hub import HfApi  # optional dep: huggingface_hub (hf extra)

        api = HfApi()
    api.upload_large_folder(
        repo_id=settings.repo_id,
        folder_path=str(folder),
        repo_type="dataset",
        revision=settings.revision,
        private=settings.private,
    )
    return {"repo_id": settings.repo_id, "repo_type": "dataset", "folder": str(folder)}
