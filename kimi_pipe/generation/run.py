"""The generate job: buy model answers through LiteLLM under a hard USD cap and store them
with exact token ids, resumable (a killed run is finished by running it again). Its command
line, settings and what a run directory holds: kimi_pipe/stages/generate.py, docs/generate.md.

The job's rooms: generation/buying.py (one run, `Generator`, made of parts: dispatch.py the
buying loop, spending.py what it pays, outcomes.py what a prompt becomes, stats.py what it
counts), purchase.py (what a run directory bought), summary.py (summary.json), launch.py (the
run directory and the checks before Hydra launches). Its settings: generation/job.py's
`GenerateJob`, made from the composed config once, at the stage's door
(kimi_pipe/stages/jobs/generate.py)."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from kimi_pipe.conformance import auto as serving_auto
from kimi_pipe.core.models import load_model
from kimi_pipe.errors import (
    EXIT_ALL_FAILED,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    KimiPipeError,
    host_error,
    one_line,
)
from kimi_pipe.generation.buying import Generator
from kimi_pipe.generation.datasets import (
    JOB_STOPS,
    job_spend,
    plan_left,
    write_job_summary,
)
from kimi_pipe.generation.errors import GenerateError
from kimi_pipe.generation.job import GenerateJob
from kimi_pipe.generation.outcomes import to_log_files as _to_log_files
from kimi_pipe.providers.credentials import api_key
from kimi_pipe.providers.local_server import provider_endpoint
from kimi_pipe.store.layout import ATTEMPT_ERRORS, RECORDS, RUN_FILES
from kimi_pipe.store.prompt_datasets import check_prompt_source
from kimi_pipe.store.run_dir import check_run_dir
from kimi_pipe.store.run_lock import RunLock

__all__ = [
    "BuyProbes",
    "GenerateError",
    "GenerateJob",
    "Generator",
    "finish_status",
    "generate",
    "run_datasets",
    "run_generate",
]

# Buys serving=auto's probe battery: conformance/auto.py's `BuyBattery`.
BuyProbes = serving_auto.BuyBattery

log = logging.getLogger("kimi_pipe.generate")


def _pointed_at(job: GenerateJob, endpoint: dict[str, Any]) -> GenerateJob:
    """The job with its provider talking to the started local server."""
    provider = {
        **job.provider,
        "model": endpoint["model"],
        "api_base": endpoint["api_base"],
        "server": None,
    }
    return job.with_provider(provider)


def said(exc: BaseException, where: Any) -> int | None:
    """A user's mistake or the host's fault said as one line on the terminal (and in the
    run's log files): exit status 2; None where `exc` is a bug, whose traceback is kept.
    `where`: the run directory, named when a write names no file."""
    if not isinstance(exc, KimiPipeError | OSError):
        return None
    host = host_error(exc, where)  # a write names no file
    message = (
        one_line(exc)
        or (one_line(host) if host is not None else None)
        or (" ".join(str(exc).split()) if isinstance(exc, FileNotFoundError) else None)
    )
    if message is None:
        return None
    _to_log_files(logging.ERROR, message)  # the terminal gets it once, below
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USER_ERROR


def interrupted(where: Any) -> int:
    """Say that a run was interrupted: every finished answer is already on disk; the
    requests in flight are lost."""
    print(f"interrupted; run the same command again to resume ({where})", file=sys.stderr)
    return EXIT_INTERRUPTED


def generate(
    job: GenerateJob, run_dir: Path | None = None, *, buy_probes: BuyProbes | None = None
) -> tuple[int, dict[str, Any] | None]:
    """Run the stage; returns (exit status, summary). Config/input problems -> status 2,
    said as one line here. `buy_probes`: as for `run_generate`."""
    try:
        if job.datasets is not None:  # several datasets under one budget (generation/datasets.py)
            run_dir, summary, status = run_datasets(job, run_dir, buy_probes=buy_probes)
            return status, summary
        run_dir, summary = run_generate(job, run_dir, buy_probes=buy_probes)
    except (KimiPipeError, OSError) as exc:
        # A user's mistake or the host's fault (a full disk, a read-only directory): one
        # line naming the path; every complete record and the journal are on disk.
        said_status = said(exc, run_dir or job.run_dir)
        if said_status is None:
            raise  # a bug: keep its traceback
        return said_status, None
    except KeyboardInterrupt:
        return interrupted(run_dir if run_dir is not None else job.run_dir), None
    return finish_status(run_dir, summary), summary


def _run_dir(job: GenerateJob, run_dir: Path | None) -> Path:
    where = run_dir or job.run_dir
    if where is None:  # a job made without one is only ever run into a directory given
        raise GenerateError("generate: no run directory given (output_dir)")
    return check_run_dir(where, RUN_FILES)


def run_generate(
    job: GenerateJob, run_dir: Path | None = None, *, buy_probes: BuyProbes | None = None
) -> tuple[Path, dict[str, Any]]:
    """The stage's work: (run directory, summary). A user-facing failure is raised, not
    printed (`generate` says it; a sweep or the probes say it once for all their jobs).
    `buy_probes` buys serving=auto's probe battery (generation/probes.py's `buy_battery`,
    passed in: buying probes is itself a generate run)."""

    # Before anything is written (the settings were checked as the job was made, secrets
    # refused at the door): a key that is set, a prompt file that is there (before
    # serving=auto's probes buy anything), a run directory that may be one.
    api_key(job.settings.api_key_env)
    check_prompt_source(job.dataset)
    run_dir = _run_dir(job, run_dir)
    # One process per run directory, held until the summary is written.
    with RunLock(run_dir), provider_endpoint(job.provider, job.model, run_dir) as endpoint:
        # provider=local: its server is started around the run, reached like any other.
        if endpoint.get("server") is not None:
            job = _pointed_at(job, endpoint)
        if serving_auto.is_plain_auto(job.serving):
            # A model config its tokenizer contradicts fails here, once, before the
            # probes buy anything (their own generate runs would each say it again).
            load_model(job.model)
        for _ in range(serving_auto.MAX_ROUTE_CHANGES + 1):
            # serving=auto: probes (booked in this run's journal) before any answer.
            route, pin = serving_auto.prepare(job.auto_target(), run_dir, buy_probes, job)
            gen = Generator(job.pinned(pin), run_dir, route=route)
            summary = asyncio.run(gen.run())
            if summary["stop_reason"] != "route_changed":
                break
    return run_dir, summary


def run_datasets(
    job: GenerateJob,
    run_dir: Path | None = None,
    *,
    buy_probes: BuyProbes | None = None,
) -> tuple[Path, dict[str, Any], int]:
    """Buy each dataset of `datasets` into its own run directory under the job's directory,
    one after the other, the job's `budget.usd` shared by them all (generation/datasets.py):
    (job directory, the job's summary, exit status: the first dataset's that is not 0)."""
    nodes = job.datasets or ()
    api_key(job.settings.api_key_env)
    for node in nodes:  # every prompt source there before anything is bought
        check_prompt_source(node)
    job_dir = _run_dir(job, run_dir)
    cap = job.budget.usd
    outcomes: dict[str, dict[str, Any]] = {}
    status = 0
    with RunLock(job_dir):  # one process per job (each dataset's run directory has its own)
        for node in nodes:
            name = str(node["name"])
            sub = job_dir / name
            left = plan_left(cap, job_spend(job_dir, but=name))
            if left is not None and left <= 0:
                log.info("%s: nothing left of budget.usd=%s; not started", name, cap)
                outcomes[name] = {"run_dir": str(sub), "stop_reason": "budget_usd", "usd": left}
                continue
            where, summary = run_generate(
                job.for_dataset(node, sub, left), sub, buy_probes=buy_probes
            )
            status = status or finish_status(where, summary)
            outcomes[name] = {
                "run_dir": str(where),
                "stop_reason": summary["stop_reason"],
                "usd": left,
                "spend_usd": summary["spend_usd"],
                "counts": summary["counts"],
            }
            if summary["stop_reason"] in JOB_STOPS:
                break  # the provider refused the key, or the host failed: not the dataset's
        job_summary = write_job_summary(job_dir, cap, outcomes)
    log.info(
        "generate job %s: %d datasets, $%.4f spent of budget.usd=%s",
        job_dir,
        len(outcomes),
        job_summary["spend_usd"],
        cap,
    )
    return job_dir, job_summary, status


def finish_status(run_dir: Path, summary: dict[str, Any]) -> int:
    """Say how a finished run ended, once; its exit status (0, stopped, or every request
    failed)."""
    counts, this_run = summary["counts"], summary["this_run"]
    stopped = summary["stop_reason"] in ("payment_required", "auth", "too_many_failures")
    given_up = this_run["given_up_retry_next_run"]
    failed_now = sum(this_run["failed"].values())  # those given up included
    retried = f", {given_up} given up after their retries (tried again on the next run)"
    if not stopped and this_run["answered"] == 0 and failed_now:
        # Nothing bought at all: a total outage or a wrong setting, never a quiet success
        # (and not "0 answered, 0 failed" first: the requests given up are failures too).
        causes = ", ".join(f"{k}: {v}" for k, v in Counter(this_run["failed"]).most_common(3))
        line = (
            f"generate: every request of this run failed ({causes}): "
            f"{failed_now - given_up} failed for good{retried if given_up else ''}, "
            f"${summary['spend_usd']:.4f} spent; see {run_dir / ATTEMPT_ERRORS} and "
            f"{run_dir / RECORDS}"
        )
        if summary["stop_message"]:
            print(f"generate: {summary['stop_message']}", file=sys.stderr)
        _to_log_files(logging.ERROR, line)
        print(line, file=sys.stderr)
        return EXIT_ALL_FAILED
    line = (
        f"generate {summary['stop_reason']}: {counts['answered']} answered "
        f"({counts['ok']} ok, {counts['flagged']} flagged), {counts['failed']} failed"
        f"{retried if given_up else ''}, ${summary['spend_usd']:.4f} spent "
        f"-> {run_dir / RECORDS}"
    )
    log.info("%s", line)
    if summary["stop_message"]:
        print(f"generate: {summary['stop_message']}", file=sys.stderr)
    return EXIT_STOPPED if stopped else 0
