"""Stage `generate`: buy model answers through LiteLLM and store them with exact token ids.

    python -m kimi_pipe generate dataset=B5 provider=openrouter budget.usd=20
    python -m kimi_pipe generate dataset=jsonl dataset.path=P.jsonl model=kimi_k25 \
        model.tokenizer.path=DIR provider=openrouter provider.api_base=URL budget.usd=X \
        output_dir=DIR

Pipeline per prompt: render prompt ids (worst-case budget reservation) -> request through
`litellm.acompletion` (bounded concurrency, retries) -> reconstruct ids inline -> append one
record to `records.jsonl` (flushed). Running the same command again resumes: answered ids
are skipped and money already spent counts against `budget.usd`.

Run directory: `records.jsonl` (one record per answered or permanently failed id),
`attempt_errors.jsonl` (every failed attempt with what it cost; samples given up after
their retries are tried again on the next run), `spend_journal.jsonl` (write-ahead: every
request before it is sent, and what it cost; see store/spend_journal.py), `.lock` (one
process per directory), `summary.json`, `.hydra/`.
Exit status: 0 done or a budget cap reached, 2 bad config/input or the directory is in use,
3 stopped by the provider (402 out of credits, 401 bad key), 4 every request failed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.errors import KimiPipeError
from kimi_pipe.generation import probes
from kimi_pipe.generation.datasets import datasets_of
from kimi_pipe.generation.errors import GenerateError
from kimi_pipe.generation.run import finish_status, said
from kimi_pipe.stages.command import compose_command
from kimi_pipe.stages.help import HELP
from kimi_pipe.stages.jobs.generate import check_before_launch, generate_job
from kimi_pipe.store.layout import RECORDS, SUMMARY
from kimi_pipe.store.prompt_datasets import load_prompts
from kimi_pipe.store.records_index import load_resume_index


def outputs(cfg: DictConfig, run_dir: Path) -> list[Path]:
    return [run_dir / RECORDS, run_dir / SUMMARY]


def is_complete(cfg: DictConfig, run_dir: Path) -> bool:
    """Every prompt of the dataset has a record (a run stopped by its budget is not)."""
    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    nodes = datasets_of(values.get("datasets"))  # not the job: a finished run needs no key
    if nodes is not None:  # several datasets: each in its own run directory under run_dir
        return all(_answered(node, run_dir / str(node["name"])) for node in nodes)
    dataset = values.get("dataset") or {}
    return all(p.exists() for p in outputs(cfg, run_dir)) and _answered(dataset, run_dir)


def _answered(dataset: dict[str, Any], run_dir: Path) -> bool:
    """Every prompt of `dataset` has a record in `run_dir` (read from the index of ids)."""
    if not (run_dir / RECORDS).exists():
        return False
    done = load_resume_index(run_dir / RECORDS).ids
    return all(p.id in done for p in load_prompts(dataset))


def complete_note(cfg: DictConfig, run_dir: Path) -> str:
    return f"all answered already in {run_dir} (no server started, nothing bought)"


def run_stage(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """The stage entry: buy every prompt's answer into the run directory; its summary.

    A mistake is raised as it is; a run stopped by the provider, or whose every request
    failed, raises GenerateError."""
    # Converted once, here: below the door plain values (a mandatory one never given: ???).
    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    job = generate_job(values, run_dir)
    if job.datasets is not None:  # several datasets under one budget: the job's summary
        where, summary, status = probes.run_datasets(job, run_dir)
    else:
        where, summary = probes.run_generate(job, run_dir)
        status = finish_status(where, summary)
    if status:
        raise GenerateError(
            f"generate exited with status {status}; see the messages above and "
            f"{where / 'summary.json'}"
        )
    return summary


def generate(cfg: DictConfig, run_dir: Path | None = None) -> tuple[int, dict[str, Any] | None]:
    """The stage on a composed config: (exit status, summary). Its job is made here, at the
    door; a mistake in it is said as one line (status 2), as a run's own are."""
    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    try:
        job = generate_job(values, run_dir)
    except (KimiPipeError, OSError) as exc:
        status = said(exc, run_dir or values.get("output_dir"))
        if status is None:
            raise  # a bug: keep its traceback
        return status, None
    return probes.generate(job, run_dir)


def run_generate(cfg: DictConfig, run_dir: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """The stage's work on a composed config: (run directory, summary); a failure is raised
    (a sweep says it for its job)."""
    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    return probes.run_generate(generate_job(values, run_dir), run_dir)


def main(argv: list[str] | None = None) -> int:
    return compose_command(
        lambda cfg: generate(cfg)[0],
        argv,
        name="generate",
        help=HELP["generate"],
        before_launch=check_before_launch,  # before Hydra writes .hydra/ and the log
    )


if __name__ == "__main__":
    sys.exit(main())
