"""Stage `generate`: buy model answers through LiteLLM and store them with exact token ids.

    python -m kimi_pipe.generate dataset=B5 provider=openrouter budget.usd=20
    python -m kimi_pipe.generate dataset=jsonl dataset.path=P.jsonl model=kimi_k25 \
        model.tokenizer.path=DIR provider=openrouter provider.api_base=URL budget.usd=X \
        output_dir=DIR

Pipeline per prompt: render prompt ids (worst-case budget reservation) -> request through
`litellm.acompletion` (bounded concurrency, retries) -> reconstruct ids inline -> append one
record to `records.jsonl` (flushed). Running the same command again resumes: answered ids
are skipped and money already spent counts against `budget.usd`.

Run directory: `records.jsonl` (one record per answered or permanently failed id),
`attempt_errors.jsonl` (every failed attempt with what it cost; samples given up after
their retries are tried again on the next run), `summary.json`, `.hydra/`.
Exit status: 0 done or a budget cap reached, 2 bad config/input, 3 stopped by the provider
(402 out of credits, 401 bad key).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.config import CONF_DIR
from kimi_pipe.pipeline.progress import Progress, Snapshot
from kimi_pipe.providers.budget import Budget, BudgetGate, Pricing, Reservation
from kimi_pipe.providers.litellm_calls import (
    NO_BUDGET,
    STOPPED,
    CallResult,
    ErrorInfo,
    MissingApiKey,
    ProviderConfigError,
    ProviderSettings,
    api_key,
    call_with_retries,
    fetch_pricing,
    get_litellm,
    scrub,
)
from kimi_pipe.store.records import RecordWriter, iter_records, load_resume_index

log = logging.getLogger("kimi_pipe.generate")

RECORDS = "records.jsonl"
ATTEMPT_ERRORS = "attempt_errors.jsonl"
SUMMARY = "summary.json"
EXIT_CONFIG, EXIT_STOPPED, EXIT_INTERRUPTED = 2, 3, 130


class GenerateError(RuntimeError):
    """A start-up problem with a message for the user (exit status 2)."""


# ---------------------------------------------------------------------------------------
# The token core (models + render + reconstruction), wired in one place.


@dataclass
class TokenCore:
    prompt_len: Callable[[list[dict], list[dict] | None], int]
    reconstruct: Callable[[list[dict], list[dict] | None, dict], dict[str, Any]]

    @classmethod
    def load(cls, cfg: DictConfig) -> TokenCore:
        from kimi_pipe.core.models import load_model
        from kimi_pipe.core.prompt_render import prompt_ids
        from kimi_pipe.core.reconstruction import reconstruct
        from kimi_pipe.core.serving import serving_profile

        model = load_model(cfg.model)
        serving = serving_profile(cfg)
        tolerance = int(OmegaConf.select(cfg, "validation.billing_tolerance", default=0) or 0)

        def prompt_len(messages: list[dict], tools: list[dict] | None) -> int:
            return len(prompt_ids(model, messages, tools))

        def rebuild(messages: list[dict], tools: list[dict] | None, resp: dict) -> dict[str, Any]:
            rec = reconstruct(
                model, messages, tools, resp, billing_tolerance=tolerance, serving=serving
            )
            return rec.to_record()

        return cls(prompt_len, rebuild)


# ---------------------------------------------------------------------------------------
# Run state


@dataclass
class RunStats:
    started: float = field(default_factory=time.monotonic)
    answered: int = 0
    failed: Counter[str] = field(default_factory=Counter)  # this session, by error class
    given_up: int = 0  # retryable failures that ran out of attempts (tried again next run)
    attempts: int = 0
    retries: int = 0
    output_tokens: int = 0
    in_flight: int = 0
    skipped_done: int = 0
    stop_reason: str | None = None
    stop_message: str | None = None
    consecutive_failures: int = 0  # samples in a row that failed without retry


def _error_record(prompt: Any, request: dict, err: ErrorInfo, attempts: int) -> dict[str, Any]:
    return {
        "id": prompt.id, "ok": False, "issues": [], "prompt_ids": [], "output_ids": [],
        "loss_mask": [], "completion_tokens_reported": None,
        "completion_tokens_reconstructed": 0, "messages": prompt.messages, "tools": prompt.tools,
        "request": request, "response": None, "usage": None, "cost": 0.0, "provider": None,
        "latency_s": None, "attempts": attempts, "error": err.to_record(),
    }


class Generator:
    def __init__(self, cfg: DictConfig, run_dir: Path, progress: Progress | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.settings = ProviderSettings.from_config(cfg.provider)
        self.key = api_key(self.settings)  # first: a missing key stops before any work
        self.request = self.settings.request_record()
        self.max_tokens = int(self.settings.params.get("max_tokens") or 0)
        bcfg = cfg.budget
        self.reserve_factor = float(bcfg.get("reserve_factor") or 1.0)
        capped = [k for k in ("usd", "max_output_tokens") if bcfg.get(k) is not None]
        if capped and self.max_tokens <= 0:
            raise GenerateError(f"budget.{capped[0]} needs provider.params.max_tokens (the worst "
                                "case of every request); set provider.params.max_tokens=N")
        self.stats = RunStats()
        self.progress = progress or Progress()
        self.rng = random.Random(int(OmegaConf.select(cfg, "dataset.seed", default=0) or 0))
        self.stop_event = asyncio.Event()
        self.total = 0

    # --- budget -------------------------------------------------------------------------
    def _price_fallback(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.pricing.input_per_token
                + completion_tokens * self.pricing.output_per_token)

    def _worst_case(self, prompt_tokens: int) -> float:
        return self.pricing.worst_case(prompt_tokens, self.max_tokens, self.reserve_factor)

    # --- main loop ----------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        from kimi_pipe.store.prompt_datasets import load_prompts

        self.run_dir.mkdir(parents=True, exist_ok=True)
        records_path = self.run_dir / RECORDS
        errors_path = self.run_dir / ATTEMPT_ERRORS
        index = load_resume_index(records_path, errors_path)
        if index.records or index.cost:
            log.info("resuming %s: %d ids done, $%.4f already spent%s", self.run_dir,
                     len(index.ids), index.cost, " (torn last line ignored)" if index.torn_tail
                     else "")
        t0 = time.monotonic()
        try:
            core = TokenCore.load(self.cfg)
            t1 = time.monotonic()
            prompts = load_prompts(self.cfg.dataset)
            self.total = len(prompts)
        except (ValueError, RuntimeError) as exc:  # bad model/dataset settings, dataset not
            raise GenerateError(str(exc)) from None  # reachable: the message says what to do
        t2 = time.monotonic()
        get_litellm()  # seconds of imports: pay them before the clock of the first request
        log.info("start-up: model %.1fs, prompts %.1fs, litellm %.1fs", t1 - t0, t2 - t1,
                 time.monotonic() - t2)
        in_price, out_price, self.price_source = await fetch_pricing(self.settings, self.key)
        self.pricing = Pricing(in_price, out_price)
        b = self.cfg.budget
        budget = Budget(b.get("usd"), b.get("max_samples"), b.get("max_output_tokens"),
                        spent_usd=index.cost, done_samples=index.answered,
                        used_output_tokens=index.output_tokens)
        self.budget = budget
        gate = BudgetGate(budget)
        log.info("generate: %d prompts, %d already done; provider %s (%s), concurrency %d, "
                 "budget $%s (spent $%.4f), prices $%.3f/$%.3f per Mtok (%s)", self.total,
                 len(index.ids), self.settings.name, self.settings.api_base,
                 self.settings.concurrency, b.get("usd"), index.cost, in_price * 1e6,
                 out_price * 1e6, self.price_source)

        self.startup_s = time.monotonic() - self.stats.started
        self.stats.started = time.monotonic()  # throughput counts from the first dispatch
        sem = asyncio.Semaphore(self.settings.concurrency)
        tasks: set[asyncio.Task] = set()
        with RecordWriter(records_path) as writer, RecordWriter(errors_path) as err_writer:
            try:
                for prompt in prompts:
                    if prompt.id in index.ids:
                        self.stats.skipped_done += 1
                        continue
                    await sem.acquire()
                    if self.stop_event.is_set():
                        sem.release()
                        break
                    try:
                        n_prompt = core.prompt_len(prompt.messages, prompt.tools)
                    except Exception as exc:  # noqa: BLE001 - a bad row, not a bad run
                        sem.release()
                        err = ErrorInfo("bad_prompt", None, str(exc)[:500], "fail")
                        writer.append(_error_record(prompt, self.request, err, 0))
                        self.stats.failed["bad_prompt"] += 1
                        continue
                    worst = self._worst_case(n_prompt)
                    res = await gate.reserve(worst, self.max_tokens)
                    if res is None:
                        sem.release()
                        if not self.stop_event.is_set():  # else the provider stopped us
                            self._stop_for_budget(worst)
                        break
                    task = asyncio.create_task(
                        self._one(prompt, worst, res, gate, core, writer, err_writer, sem))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    self._show()
                if tasks:
                    await asyncio.gather(*list(tasks))
            except (asyncio.CancelledError, KeyboardInterrupt):
                self.stats.stop_reason = self.stats.stop_reason or "interrupted"
                gate.close()
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*list(tasks), return_exceptions=True)
                raise
            finally:
                self.progress.close()
        self.stats.stop_reason = self.stats.stop_reason or "done"
        if prompts.skipped:
            log.warning("dataset rows that could not become prompts (skipped): %s",
                        dict(prompts.skipped))
        summary = self.summary(records_path, errors_path, prompts.skipped)
        tmp = self.run_dir / (SUMMARY + ".partial")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(self.run_dir / SUMMARY)
        return summary

    def _stop_for_budget(self, worst: float) -> None:
        reason = self.budget.blocker(worst, self.max_tokens, True) or "budget_usd"
        self.stats.stop_reason = self.stats.stop_reason or reason
        if reason == "budget_usd" and self.budget.spent_usd == 0 and self.budget.cap_usd:
            self.stats.stop_message = (
                f"budget.usd=${self.budget.cap_usd} is below one request's worst case "
                f"${worst:.4f}; raise budget.usd or lower provider.params.max_tokens")
        log.info("dispatch stopped: %s", self.stats.stop_message or reason)

    async def _one(self, prompt: Any, worst: float, first: Reservation, gate: BudgetGate,
                   core: TokenCore, writer: RecordWriter, err_writer: RecordWriter,
                   sem: asyncio.Semaphore) -> None:
        self.stats.in_flight += 1
        pending: list[Reservation] = [first]

        async def reserve() -> Reservation | None:
            if pending:
                return pending.pop()
            return await gate.reserve(worst, self.max_tokens)

        def settle(res: Reservation, cost: float, tokens: int, done: bool) -> None:
            self.stats.attempts += 1
            self.stats.output_tokens += tokens
            gate.settle(res, cost, tokens, done)

        def on_failed(err: ErrorInfo, attempt: int, cost: float, tokens: int) -> None:
            # Logged at once with what it cost: money billed for a failed attempt is kept
            # in the spend even if the process dies before the sample finishes.
            err_writer.append({"id": prompt.id, "attempt": attempt, "error": err.to_record(),
                               "action": err.action, "cost": cost,
                               "usage": {"completion_tokens": tokens}})
            if err.action == "retry" and attempt < self.settings.retry.max_attempts:
                self.stats.retries += 1

        try:
            result = await call_with_retries(
                self.settings, self.key, prompt.messages, prompt.tools, reserve, settle,
                self.rng, self._price_fallback, on_failed, self.stop_event)
        finally:
            if pending:  # never used: give the first reservation back
                gate.settle(first, 0.0, 0, False)
            self.stats.in_flight -= 1
            sem.release()
        self._finish(prompt, result, core, writer, gate)
        self._show()

    def _finish(self, prompt: Any, result: CallResult, core: TokenCore, writer: RecordWriter,
                gate: BudgetGate) -> None:
        err = result.error
        if err is None:
            resp = result.response
            assert resp is not None
            try:
                rec = core.reconstruct(prompt.messages, prompt.tools, resp)
            except Exception as exc:  # noqa: BLE001 - keep the paid answer whatever happens
                log.exception("reconstruction of %s failed", prompt.id)
                rec = {"ok": False, "issues": ["reconstruction_crashed"], "prompt_ids": [],
                       "output_ids": [], "loss_mask": [], "completion_tokens_reported": None,
                       "completion_tokens_reconstructed": 0, "reconstruction_error": str(exc)}
            record = {
                "id": prompt.id, **rec, "messages": prompt.messages, "tools": prompt.tools,
                "request": self.request, "response": resp, "usage": resp.get("usage"),
                "cost": result.cost, "provider": resp.get("provider"),
                "latency_s": round(result.latency_s, 4), "attempts": result.attempts,
                "error": None,
            }
            writer.append(record)
            self.stats.answered += 1
            self.stats.consecutive_failures = 0
        elif err.action == "fail":
            writer.append(_error_record(prompt, self.request, err, result.attempts))
            self.stats.failed[err.cls] += 1
            self.stats.consecutive_failures += 1
            limit = self.settings.retry.max_consecutive_failures
            if self.stats.consecutive_failures >= limit and not self.stop_event.is_set():
                self._stop(gate, "too_many_failures", (
                    f"{limit} samples in a row failed without retry (last: {err.message}); "
                    "check provider.model and provider.params. Their records are in "
                    f"{RECORDS} (error set); delete those lines, or use a fresh output_dir, "
                    "to try them again"))
        elif err is NO_BUDGET:
            if not self.stop_event.is_set():
                self._stop_for_budget(0.0)
        elif err is STOPPED:
            pass  # not answered: tried again on the next run
        elif err.action == "stop":
            self.stats.failed[err.cls] += 1
            if not self.stop_event.is_set():
                self._stop(gate, err.cls,
                           _STOP_MESSAGES.get(err.cls, "the provider refused: ") + err.message)
        else:
            self.stats.failed[err.cls] += 1
            self.stats.given_up += 1
            log.warning("%s: gave up after %d attempts (%s); it will be tried again on the "
                        "next run", prompt.id, result.attempts, err.cls)

    def _stop(self, gate: BudgetGate, reason: str, message: str) -> None:
        """Stop dispatching: requests in flight finish, nothing new is sent."""
        self.stop_event.set()
        gate.close()
        self.stats.stop_reason = reason
        self.stats.stop_message = scrub(message, self.key)
        log.error("stopping: %s", self.stats.stop_message)

    def _show(self) -> None:
        b = self.budget
        done = self.stats.skipped_done + self.stats.answered + sum(self.stats.failed.values())
        self.progress.update(Snapshot(
            done=done, total=self.total, spent_usd=b.spent_usd, cap_usd=b.cap_usd,
            output_tokens=self.stats.output_tokens, retries=self.stats.retries,
            failures=sum(self.stats.failed.values()), in_flight=self.stats.in_flight))

    # --- summary ------------------------------------------------------------------------
    def summary(self, records_path: Path, errors_path: Path,
                skipped_rows: Counter[str]) -> dict[str, Any]:
        counts: Counter[str] = Counter()
        flagged: Counter[str] = Counter()
        failed: Counter[str] = Counter()
        providers: Counter[str] = Counter()
        spend = prompt_tokens = reported = rebuilt = 0
        for rec in iter_records(records_path):
            counts["records"] += 1
            spend += float(rec.get("cost") or 0.0)
            if rec.get("error"):
                failed[rec["error"].get("class", "unknown")] += 1
                continue
            counts["answered"] += 1
            counts["ok" if rec.get("ok") else "flagged"] += 1
            flagged.update(rec.get("issues") or [])
            providers[str(rec.get("provider"))] += 1
            usage = rec.get("usage") or {}
            prompt_tokens += int(usage.get("prompt_tokens") or 0)
            if isinstance(rec.get("completion_tokens_reported"), int):
                reported += rec["completion_tokens_reported"]
                rebuilt += int(rec.get("completion_tokens_reconstructed") or 0)
        failed_attempts_cost = sum(float(r.get("cost") or 0.0) for r in iter_records(errors_path))
        wall = time.monotonic() - self.stats.started
        s = self.stats
        return {
            "run_dir": str(self.run_dir),
            "stop_reason": s.stop_reason,
            "stop_message": s.stop_message,
            "prompts": self.total,
            "prompt_rows_skipped": dict(skipped_rows),
            "counts": {"records": counts["records"], "answered": counts["answered"],
                       "ok": counts["ok"], "flagged": counts["flagged"],
                       "failed": sum(failed.values())},
            "flagged_by_issue": dict(flagged),
            "failed_by_class": dict(failed),
            "providers": dict(providers),
            "spend_usd": spend + failed_attempts_cost,
            "spend_usd_records": spend,
            "spend_usd_failed_attempts": failed_attempts_cost,
            "budget": {"usd": self.budget.cap_usd, "max_samples": self.budget.max_samples,
                       "max_output_tokens": self.budget.max_output_tokens,
                       "reserve_factor": self.reserve_factor,
                       "price_in_usd_per_mtok": self.pricing.input_per_token * 1e6,
                       "price_out_usd_per_mtok": self.pricing.output_per_token * 1e6,
                       "price_source": self.price_source,
                       "overruns": self.budget.overruns},
            "tokens": {"prompt": prompt_tokens, "completion_reported": reported,
                       "completion_reconstructed": rebuilt},
            "billing_drift": {"reconstructed_minus_reported": rebuilt - reported,
                              "ratio": (rebuilt / reported) if reported else None},
            "this_run": {
                "startup_s": round(self.startup_s, 3), "wall_s": round(wall, 3),
                "answered": s.answered, "failed": dict(s.failed),
                "given_up_retry_next_run": s.given_up, "skipped_already_done": s.skipped_done,
                "attempts": s.attempts, "retries": s.retries,
                "output_tokens_billed": s.output_tokens,
                "samples_per_s": s.answered / wall if wall > 0 else None,
                "output_tokens_per_s": s.output_tokens / wall if wall > 0 else None,
                "concurrency": self.settings.concurrency,
            },
        }


_STOP_MESSAGES = {
    "payment_required": "the provider answered 402 (out of credits or the key's limit); "
                        "add credits or raise the key limit, then run the same command again "
                        "to resume: ",
    "auth": "the provider answered 401 (bad API key); check the key in the environment: ",
}


# ---------------------------------------------------------------------------------------
# Entry points


def run_dir_of(cfg: DictConfig) -> Path:
    """The Hydra job's output dir (one per sweep job), else `output_dir`."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except (ImportError, ValueError):
        return Path(str(cfg.output_dir))


def _pointed_at(cfg: DictConfig, endpoint: dict[str, Any]) -> DictConfig:
    """A copy of cfg whose provider talks to the started local server."""
    from omegaconf import OmegaConf, open_dict

    out = cfg.copy()
    with open_dict(out):
        OmegaConf.update(out, "provider.model", endpoint["model"], force_add=True)
        OmegaConf.update(out, "provider.api_base", endpoint["api_base"], force_add=True)
        OmegaConf.update(out, "provider.server", None, force_add=True)
    return out


def generate(cfg: DictConfig, run_dir: Path | None = None) -> tuple[int, dict[str, Any] | None]:
    """Run the stage; returns (exit status, summary). Config/input problems -> status 2."""
    from kimi_pipe.core.tokenizers import TokenizerNotFound
    from kimi_pipe.providers.local_server import ServerError, provider_endpoint

    run_dir = run_dir or run_dir_of(cfg)
    try:
        # provider=local: its server is started around the run, reached like any provider.
        with provider_endpoint(cfg, run_dir) as endpoint:
            if endpoint.get("server") is not None:
                cfg = _pointed_at(cfg, endpoint)
            gen = Generator(cfg, run_dir)
            summary = asyncio.run(gen.run())
    except (MissingApiKey, GenerateError, ProviderConfigError, TokenizerNotFound,
            FileNotFoundError, ServerError) as exc:
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG, None
    except KeyboardInterrupt:
        # Every finished answer is already on disk; the requests in flight are lost.
        print(f"interrupted; run the same command again to resume ({run_dir})", file=sys.stderr)
        return EXIT_INTERRUPTED, None
    line = (f"generate {summary['stop_reason']}: {summary['counts']['answered']} answered "
            f"({summary['counts']['ok']} ok, {summary['counts']['flagged']} flagged), "
            f"{summary['counts']['failed']} failed, ${summary['spend_usd']:.4f} spent "
            f"-> {run_dir / RECORDS}")
    log.info("%s", line)
    if summary["stop_message"]:
        print(f"generate: {summary['stop_message']}", file=sys.stderr)
    stopped = summary["stop_reason"] in ("payment_required", "auth", "too_many_failures")
    return (EXIT_STOPPED if stopped else 0), summary


def _refuse_keys_on_the_command_line(argv: list[str]) -> None:
    """Hydra saves every override in .hydra/ before the task runs: refuse a key there."""
    for arg in argv:
        name = arg.split("=", 1)[0].lstrip("+~")
        if "=" in arg and name.rsplit(".", 1)[-1].lower().replace("-", "_").endswith(
                ("api_key", "apikey")):
            print(f"error: {name} must not be in the config (Hydra would save it in .hydra/); "
                  "export the provider's key variable (e.g. OPENROUTER_API_KEY) instead",
                  file=sys.stderr)
            raise SystemExit(EXIT_CONFIG)


def main() -> None:
    import hydra

    _refuse_keys_on_the_command_line(sys.argv[1:])

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def generate_stage(cfg: DictConfig) -> None:
        status, _ = generate(cfg)
        if status:
            raise SystemExit(status)

    generate_stage()


if __name__ == "__main__":
    main()
