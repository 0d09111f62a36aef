"""The generate job: buy model answers through LiteLLM under a hard USD cap and store them
with exact token ids, resumable (a killed run is finished by running it again). Its command
line, settings and what a run directory holds: kimi_pipe/stages/generate.py, docs/generate.md.

The job's rooms: generation/buying.py (the buying loop), outcomes.py (what a prompt becomes),
purchase.py (what a run directory bought), summary.py (summary.json), launch.py (the run
directory and the checks before Hydra launches)."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from kimi_pipe.conformance import auto as serving_auto
from kimi_pipe.core.models import load_model
from kimi_pipe.core.serving import serving_profile
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
    dataset_cfg,
    dataset_nodes,
    job_spend,
    plan_left,
    write_job_summary,
)
from kimi_pipe.generation.errors import GenerateError
from kimi_pipe.generation.launch import (
    RUN_FILES,
    check_settings,
    run_dir_of,
)
from kimi_pipe.providers.budget import budget_settings
from kimi_pipe.providers.credentials import refuse_secrets
from kimi_pipe.providers.local_server import provider_endpoint
from kimi_pipe.store.layout import ATTEMPT_ERRORS, RECORDS
from kimi_pipe.store.prompt_datasets import check_prompt_source
from kimi_pipe.store.run_dir import check_run_dir
from kimi_pipe.store.run_lock import RunLock

__all__ = [
    "BuyProbes",
    "GenerateError",
    "Generator",
    "finish_status",
    "generate",
    "run_datasets",
    "run_generate",
]

# Buys serving=auto's probe battery: conformance/auto.py's `BuyBattery`.
BuyProbes = serving_auto.BuyBattery

log = logging.getLogger("kimi_pipe.generate")


def _pointed_at(cfg: DictConfig, endpoint: dict[str, Any]) -> DictConfig:
    """A copy of cfg whose provider talks to the started local server."""
    out = cfg.copy()
    with open_dict(out):
        OmegaConf.update(out, "provider.model", endpoint["model"], force_add=True)
        OmegaConf.update(out, "provider.api_base", endpoint["api_base"], force_add=True)
        OmegaConf.update(out, "provider.server", None, force_add=True)
    return out


def _to_log_files(level: int, message: str) -> None:
    """`message` into the run's log files only (Hydra's `generate.log`), not the terminal,
    where it is printed once in its own words."""
    record = log.makeRecord(log.name, level, __file__, 0, "%s", (message,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
            handler.handle(record)


def generate(
    cfg: DictConfig, run_dir: Path | None = None, *, buy_probes: BuyProbes | None = None
) -> tuple[int, dict[str, Any] | None]:
    """Run the stage; returns (exit status, summary). Config/input problems -> status 2,
    said as one line here. `buy_probes`: as for `run_generate`."""
    try:
        nodes = dataset_nodes(cfg)
        if nodes is not None:  # several datasets under one budget (generation/datasets.py)
            run_dir, summary, status = run_datasets(cfg, nodes, run_dir, buy_probes=buy_probes)
            return status, summary
        run_dir, summary = run_generate(cfg, run_dir, buy_probes=buy_probes)
    except (KimiPipeError, OSError) as exc:
        # A user's mistake or the host's fault (a full disk, a read-only directory): one
        # line naming the path; every complete record and the journal are on disk.
        host = host_error(exc, run_dir or cfg.get("output_dir"))  # a write names no file
        message = (
            one_line(exc)
            or (one_line(host) if host is not None else None)
            or (" ".join(str(exc).split()) if isinstance(exc, FileNotFoundError) else None)
        )
        if message is None:
            raise  # a bug: keep its traceback
        _to_log_files(logging.ERROR, message)  # the terminal gets it once, below
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR, None
    except KeyboardInterrupt:
        # Every finished answer is already on disk; the requests in flight are lost.
        where = run_dir if run_dir is not None else cfg.get("output_dir")
        print(f"interrupted; run the same command again to resume ({where})", file=sys.stderr)
        return EXIT_INTERRUPTED, None
    return finish_status(run_dir, summary), summary


def run_generate(
    cfg: DictConfig, run_dir: Path | None = None, *, buy_probes: BuyProbes | None = None
) -> tuple[Path, dict[str, Any]]:
    """The stage's work: (run directory, summary). A user-facing failure is raised, not
    printed (`generate` says it; a sweep or the probes say it once for all their jobs).
    `buy_probes` buys serving=auto's probe battery (generation/probes.py's `buy_battery`,
    passed in: buying probes is itself a generate run)."""

    # Before anything is written: no secret in any value, budget and provider settings that
    # can buy, a run directory that may be one, a prompt file that is there (before
    # serving=auto's probes buy anything).
    refuse_secrets(cfg)
    check_settings(cfg)
    check_prompt_source(cfg.dataset)
    run_dir = check_run_dir(run_dir or run_dir_of(cfg), RUN_FILES)
    # One process per run directory, held until the summary is written.
    with RunLock(run_dir), provider_endpoint(cfg, run_dir) as endpoint:
        # provider=local: its server is started around the run, reached like any other.
        if endpoint.get("server") is not None:
            cfg = _pointed_at(cfg, endpoint)
        if serving_auto.is_plain_auto(serving_profile(cfg)):
            # A model config its tokenizer contradicts fails here, once, before the
            # probes buy anything (their own generate runs would each say it again).
            load_model(cfg.model)
        for _ in range(serving_auto.MAX_ROUTE_CHANGES + 1):
            # serving=auto: probes (booked in this run's journal) before any answer.
            job_cfg, route = serving_auto.prepare(cfg, run_dir, buy=buy_probes)
            gen = Generator(job_cfg, run_dir, route=route)
            summary = asyncio.run(gen.run())
            if summary["stop_reason"] != "route_changed":
                break
    return run_dir, summary


def run_datasets(
    cfg: DictConfig,
    nodes: list[DictConfig],
    run_dir: Path | None = None,
    *,
    buy_probes: BuyProbes | None = None,
) -> tuple[Path, dict[str, Any], int]:
    """Buy each dataset of `datasets` into its own run directory under the job's directory,
    one after the other, the job's `budget.usd` shared by them all (generation/datasets.py):
    (job directory, the job's summary, exit status: the first dataset's that is not 0)."""
    refuse_secrets(cfg)
    check_settings(cfg)
    for node in nodes:  # every prompt source there before anything is bought
        check_prompt_source(node)
    job_dir = check_run_dir(run_dir or run_dir_of(cfg), RUN_FILES)
    cap = budget_settings(cfg).usd
    outcomes: dict[str, dict[str, Any]] = {}
    status = 0
    with RunLock(job_dir):  # one process per job (each dataset's run directory has its own)
        for node in nodes:
            name = str(node.name)
            sub = job_dir / name
            left = plan_left(cap, job_spend(job_dir, but=name))
            if left is not None and left <= 0:
                log.info("%s: nothing left of budget.usd=%s; not started", name, cap)
                outcomes[name] = {"run_dir": str(sub), "stop_reason": "budget_usd", "usd": left}
                continue
            where, summary = run_generate(
                dataset_cfg(cfg, node, sub, left), sub, buy_probes=buy_probes
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
