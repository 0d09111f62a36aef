"""Stage: EAGLE-3 hidden states for the token records of a run.

    python -m kimi_pipe extract extract.run_dir=runs/B5/openrouter          # reads records.jsonl
    python -m kimi_pipe extract extract.records=out/reconstructed.jsonl extract.max_len=4096
    python -m kimi_pipe extract extract=sglang extract.run_dir=...           # another backend

(`records=` / `run_dir=` at the top level work too once conf/config.yaml declares them.)

Ids are taken from the records (`prompt_ids + output_ids`), never re-tokenised. The states
go to a sharded store (`kimi_pipe.store.hidden_store`), default `<run dir>/hidden_<backend>/`.
Running the same command again resumes after the last committed shard.

Backend interface (module `kimi_pipe.extraction.<backend>_backend`, chosen by `extract.backend`)::

    def open_backend(job: ExtractJob) -> Backend      # built at the door: stages/jobs/extract.py

    class Backend(Protocol):
        store_fields: dict   # make_manifest() keyword args: model, num_layers, layer_ids,
                             # hidden_size, dtype (of the stored states), layer_convention,
                             # final_state, extra
        def forward(self, batch: list[list[int]]) -> list[tuple[Tensor, Tensor]]:
            # one (aux [L, 3H], final [L, H]) per sequence, L = len(sequence)
        def close(self) -> None
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.core.issue_codes import Code
from kimi_pipe.errors import MissingFile
from kimi_pipe.reporting.formatting import skipped_line
from kimi_pipe.stages.command import compose_command
from kimi_pipe.stages.help import HELP

# The extraction machinery (and torch under it) is imported where the stage runs, not here:
# `--help`, a mistyped override, a key on the command line or a missing records file is
# answered without loading it.
if TYPE_CHECKING:
    from kimi_pipe.extraction.job import ExtractJob
    from kimi_pipe.extraction.token_samples import Backend

log = logging.getLogger("kimi_pipe.extract")

SUMMARY_FILE = "extract_summary.json"


# --------------------------------------------------------------------------- run


def run_extract(
    cfg: DictConfig, backend: Backend | None = None, run_dir: Path | None = None
) -> dict[str, Any]:
    """The composed config's extraction (converted once, here, and its job built from the
    plain values); see `run_job`. `run_dir`: a pipeline's run, in place of `extract.run_dir`."""
    from kimi_pipe.stages.jobs.extract import extract_job  # torch: where the stage runs

    values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    return run_job(extract_job(cast(dict[str, Any], values), run_dir), backend)


def run_job(job: ExtractJob, backend: Backend | None = None) -> dict[str, Any]:
    """Extract every usable record not yet in the store; return the summary.

    The capture loop (length-sorted batches under `extract.batch_tokens`, OOM halving, NaN
    marking, progress, work shards + merge) is `extraction.sharding.run_sharded`, shared by all
    backends; this function only picks and closes the backend.
    """
    records = job.records_path()
    if not records.is_file():  # before a model is loaded: the user's first mistake first
        raise MissingFile(
            f"token records {records} not found: run `python -m kimi_pipe generate` "
            "(records.jsonl in its run dir) or `python -m kimi_pipe reconstruct` first"
        )
    from kimi_pipe.extraction.executors import run_executor  # torch: where the stage runs
    from kimi_pipe.extraction.sharding import run_sharded  # torch: where the stage runs
    from kimi_pipe.extraction.token_samples import load_backend  # torch: where the stage runs

    if job.executor is not None:  # the unit protocol: docs/distributed.md
        summary = run_executor(job, backend)
        print(f"[extract] unit store {summary['store']}: {summary['status']}", file=sys.stderr)
        return summary
    own_backend = backend is None
    backend = backend or load_backend(job)
    try:
        summary = run_sharded(job, backend)
    finally:
        if own_backend:
            backend.close()
    print(
        f"[extract] store {summary['store']}: {summary['capture']['written']} written now, "
        f"{summary['capture']['skipped_done']} already there; cut to extract.max_len "
        f"{summary['counts'].get(Code.TRUNCATED, 0)}, skipped {skipped_line(summary['counts'])}",
        file=sys.stderr,
        flush=True,
    )
    return summary


def outputs(cfg: DictConfig, run_dir: Path) -> list[Path]:
    from kimi_pipe.stages.jobs.extract import extract_job  # torch: where the stage runs

    values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    return _outputs(extract_job(cast(dict[str, Any], values), default_run_dir=run_dir), run_dir)


def _outputs(job: ExtractJob, run_dir: Path) -> list[Path]:
    """The store's first file: a unit store's first record, else the store's manifest."""
    from kimi_pipe.extraction.executors.worker import UnitSettings  # torch: where the stage runs
    from kimi_pipe.store.hidden_store import MANIFEST  # torch: where the stage runs

    if job.executor is not None:
        root = UnitSettings.from_job(job).local_root
        return [root / "plan.c0.json"] if root is not None else []  # a unit store's first record
    return [(job.output_dir or run_dir / f"hidden_{job.backend}") / MANIFEST]


def is_complete(cfg: DictConfig, run_dir: Path) -> bool:
    """The runner's check: the store's files exist; a unit store has every unit committed."""
    from kimi_pipe.extraction.executors.worker import UnitSettings  # torch: where the stage runs
    from kimi_pipe.stages.jobs.extract import extract_job  # torch: where the stage runs

    values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    job = extract_job(cast(dict[str, Any], values), default_run_dir=run_dir)
    if not all(p.exists() for p in _outputs(job, run_dir)):
        return False
    if job.executor is None:
        return True
    try:
        status = UnitSettings.from_job(job).open().status()
    except MissingFile:  # no plan yet: nothing was started
        return False
    return bool(status["committed"] == status["units"])


def run_stage(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """The stage entry: hidden states of the run's records (`extract.run_dir` = run_dir)."""
    return run_extract(cfg, run_dir=run_dir)


def main(argv: list[str] | None = None) -> int:

    def extract_stage(cfg: DictConfig) -> None:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        run_extract(cfg)

    return compose_command(extract_stage, argv, name="extract", help=HELP["extract"])


if __name__ == "__main__":
    sys.exit(main())
