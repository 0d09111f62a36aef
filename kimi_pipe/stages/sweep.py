"""Provider sweep: one Hydra multirun of the generate stage, one job per OpenRouter provider.

    python -m kimi_pipe.sweep dataset=B5 providers=moonshotai,fireworks,novita n=50 usd=6 \
        [sweep_dir=runs/sweep/B5] [report=true] [dry_run=false] [ANY.HYDRA=OVERRIDE ...]

Every job pins one provider (`provider.routing.order=[<slug>]`,
`provider.routing.allow_fallbacks=false`), answers the same first `n` prompts of the dataset,
and writes `<sweep_dir>/<slug>/` (records.jsonl, summary.json, .hydra/). The shared budget
`usd` is split evenly, so every provider gets the same cap on the same prompts and no job
can spend another's share. Running the same command again resumes every job (generate
skips answered ids and counts money already spent). Then `kimi_pipe.stages.report` writes
`<sweep_dir>/report.md` and its charts.

Every other argument (`provider.params.max_tokens=4096`, `dataset.path=p.jsonl`,
`model=...`) goes to generate unchanged, except `budget.usd=X`, which is the same as `usd=X`
(the shared total).
The API key comes from the environment, as for generate.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimi_pipe.errors import UsageError

# Where the provider group keeps the pinned order and the fallback switch.
ORDER_KEY = "provider.routing.order"
FALLBACKS_KEY = "provider.routing.allow_fallbacks"
# The dataset keys that cap how many prompts a source yields, in order of preference.
LIMIT_KEYS = ("num_samples", "limit")
SLUG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")  # OpenRouter slugs, e.g. deepinfra/fp8

USAGE = (
    "usage: python -m kimi_pipe.sweep dataset=NAME providers=a,b,c n=50 usd=5 "
    "[sweep_dir=PATH] [report=true|false] [dry_run=true|false] [probes=true|false] "
    "[probe_usd=X] [group.key=value ...]"
)


@dataclass(frozen=True)
class SweepArgs:
    dataset: str
    providers: list[str]
    n: int
    usd: float
    sweep_dir: Path | None = None
    report: bool = True
    dry_run: bool = False
    overrides: list[str] = field(default_factory=list)
    probes: bool = True  # conformance probes first (kimi_pipe.stages.probe)
    probe_usd: float | None = None  # their own small budget; None: the battery's default

    @property
    def usd_each(self) -> float:
        # Rounded down to a micro-dollar so the shares never add up to more than `usd`.
        return int(self.usd / len(self.providers) * 1e6) / 1e6


def _bool(key: str, value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise UsageError(f"{key}={value!r}: expected true or false")


def parse_args(argv: list[str]) -> SweepArgs:
    if any(a in ("-h", "--help") for a in argv):
        raise UsageError(USAGE)
    mine: dict[str, str] = {}
    overrides: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise UsageError(f"bad argument {arg!r}: expected key=value\n{USAGE}")
        if key == "budget.usd":
            # The shared budget, never one job's: passed through, it would give every
            # provider the whole amount.
            if mine.get("usd") not in (None, value):
                raise UsageError(f"usd={mine['usd']} and budget.usd={value} disagree")
            mine["usd"] = value
        elif key in (
            "dataset",
            "providers",
            "n",
            "usd",
            "sweep_dir",
            "report",
            "dry_run",
            "probes",
            "probe_usd",
        ):
            if key == "usd" and mine.get("usd") not in (None, value):
                raise UsageError(f"usd={value} and budget.usd={mine['usd']} disagree")
            mine[key] = value
        else:
            overrides.append(arg)  # a Hydra override for generate (checked when composed)
    return sweep_args(mine, overrides)


def sweep_args(mine: dict[str, str], overrides: list[str]) -> SweepArgs:
    """Checked sweep settings from their text values (the command line's, or the `sweep`
    config node's in a pipeline)."""
    missing = [k for k in ("dataset", "providers", "n", "usd") if not mine.get(k)]
    if missing:
        raise UsageError(f"missing {', '.join(f'{k}=' for k in missing)}\n{USAGE}")
    providers = [p.strip() for p in mine["providers"].split(",") if p.strip()]
    bad = [p for p in providers if not SLUG.match(p)]
    if not providers or bad:
        raise UsageError(
            f"providers={mine['providers']!r}: give OpenRouter provider slugs separated by "
            f"commas (bad: {bad or 'none given'})"
        )
    if len(set(providers)) != len(providers):
        raise UsageError(f"providers={mine['providers']!r} names a provider twice")
    try:
        n, usd = int(mine["n"]), float(mine["usd"])
    except ValueError:
        raise UsageError(
            f"n={mine['n']!r} must be an integer, usd={mine['usd']!r} a number"
        ) from None
    if n < 1 or usd <= 0:
        raise UsageError("n must be >= 1 and usd > 0")
    return SweepArgs(
        dataset=mine["dataset"],
        providers=providers,
        n=n,
        usd=usd,
        sweep_dir=Path(mine["sweep_dir"]) if mine.get("sweep_dir") else None,
        report=_bool("report", mine.get("report", "true")),
        dry_run=_bool("dry_run", mine.get("dry_run", "false")),
        overrides=overrides,
        probes=_bool("probes", mine.get("probes", "true")),
        probe_usd=float(mine["probe_usd"]) if mine.get("probe_usd") else None,
    )


def resolve_dataset(args: SweepArgs) -> tuple[str, str]:
    """(dataset name, the key that limits its prompt count), from the composed config."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from kimi_pipe.config import compose

    try:
        cfg = compose([f"dataset={args.dataset}", *args.overrides])
    except (HydraException, OmegaConfBaseException) as exc:
        raise UsageError(f"bad dataset or override: {exc}\n{USAGE}") from None
    for key in LIMIT_KEYS:
        if key in cfg.dataset:
            return str(cfg.dataset.name), key
    raise UsageError(
        f"dataset={args.dataset} has none of {LIMIT_KEYS}; the sweep cannot give every "
        "provider the same n prompts"
    )


def sweep_dir_for(args: SweepArgs, dataset_name: str) -> Path:
    return args.sweep_dir or Path("runs") / "sweep" / dataset_name


def job_overrides(args: SweepArgs, slug: str, limit_key: str) -> list[str]:
    """The generate overrides of one provider's job (what the multirun command sets)."""
    return [
        f"dataset={args.dataset}",
        f"provider.name={slug}",
        f"{ORDER_KEY}=[{slug}]",
        f"{FALLBACKS_KEY}=false",
        f"dataset.{limit_key}={args.n}",
        f"budget.usd={args.usd_each}",
        # A sweep measures every provider as it is (the probes ran first, into probes/):
        # serving=auto would refuse the unusable ones; `serving=NAME` among the overrides wins.
        "serving=unknown",
        *args.overrides,
    ]


def build_command(args: SweepArgs, dataset_name: str, limit_key: str) -> list[str]:
    """The same sweep as one Hydra multirun of the generate command (shown to the user; the
    sweep itself calls generate as a function, job by job, with `job_overrides`)."""
    sweep_dir = sweep_dir_for(args, dataset_name)
    return [
        sys.executable,
        "-m",
        "kimi_pipe.generate",
        "--multirun",
        f"dataset={args.dataset}",
        # One job per slug, in <sweep_dir>/<slug> (hydra.sweep.subdir below).
        f"provider.name={','.join(args.providers)}",
        f"{ORDER_KEY}=[${{provider.name}}]",
        f"{FALLBACKS_KEY}=false",
        f"dataset.{limit_key}={args.n}",
        f"budget.usd={args.usd_each}",
        # A sweep measures every provider as it is (the probes ran first, into probes/):
        # serving=auto would refuse the unusable ones; `serving=NAME` among the overrides wins.
        "serving=unknown",
        *args.overrides,
        f"hydra.sweep.dir={sweep_dir.as_posix()}",
        # The jobs differ by slug alone: name their directories by it (the report reads them).
        "hydra.sweep.subdir=${provider.name}",
    ]


def run_probe_stage(args: SweepArgs, sweep_dir: Path) -> None:
    """Conformance probes pinned to each provider, into <sweep_dir>/probes (resumable)."""
    from kimi_pipe.config import compose
    from kimi_pipe.reporting.data import PROBES_DIR
    from kimi_pipe.stages.probe import default_battery, load_battery, run_probes

    # Dataset and budget settings belong to the sweep's prompts, not to the probe battery.
    keep = [o for o in args.overrides if not o.lstrip("+~").startswith(("dataset", "budget"))]
    battery = load_battery(default_battery(str(compose(keep).model.name)))
    print(
        f"[sweep] conformance probes first ({len(battery.probes)} per provider)",
        file=sys.stderr,
        flush=True,
    )
    run_probes(args.providers, sweep_dir / PROBES_DIR, battery, args.probe_usd, keep)


def sweep_dir_of(command: list[str]) -> Path:
    return Path(next(a for a in command if a.startswith("hydra.sweep.dir=")).split("=", 1)[1])


def run_jobs(args: SweepArgs, sweep_dir: Path, limit_key: str) -> int:
    """One generate job per provider, in this process; the worst job's exit status."""
    from omegaconf import OmegaConf

    from kimi_pipe.stages.command import compose_overrides
    from kimi_pipe.stages.generate import generate

    worst = 0
    for slug in args.providers:
        cfg = compose_overrides(job_overrides(args, slug, limit_key))
        run_dir = sweep_dir / slug
        # What a Hydra job saves: the job's composed config, for the report and for humans.
        saved = run_dir / ".hydra" / "generate"
        saved.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, saved / "config.yaml")
        print(f"[sweep] {slug} -> {run_dir}", file=sys.stderr, flush=True)
        status, _ = generate(cfg, run_dir)
        if status:
            print(f"[sweep] {slug}: generate exited with status {status}", file=sys.stderr)
            worst = max(worst, status)
    return worst


def run_stage(cfg: Any, run_dir: Path | None = None) -> dict[str, Any]:
    """The stage entry: the sweep described by the composed config's `sweep` node into
    run_dir (or `sweep.sweep_dir`, else runs/sweep/<dataset>)."""
    from omegaconf import OmegaConf

    from kimi_pipe.errors import ConfigError

    node = OmegaConf.select(cfg, "sweep", default=None)
    if node is None or not node.get("providers"):
        raise ConfigError("sweep.providers=[a,b,c] is required (OpenRouter provider slugs)")
    providers = node.providers
    if not isinstance(providers, str):
        providers = ",".join(str(p) for p in providers)
    mine = {"dataset": str(cfg.dataset.name), "providers": providers, "n": str(node.n),
            "usd": str(node.usd)}  # fmt: skip
    if run_dir is not None or node.get("sweep_dir"):
        mine["sweep_dir"] = str(run_dir if run_dir is not None else node.sweep_dir)
    for key in ("report", "dry_run", "probes", "probe_usd"):
        if node.get(key) is not None:
            mine[key] = str(node.get(key)).lower()
    status = sweep(sweep_args(mine, [str(o) for o in node.get("overrides") or []]))
    if status != 0:
        raise ConfigError(f"the sweep's generate jobs exited with status {status}")
    where = Path(str(run_dir or node.get("sweep_dir") or f"runs/sweep/{cfg.dataset.name}"))
    return {"sweep_dir": str(where), "report": str(where / "report.md")}


def main(argv: list[str] | None = None) -> int:
    from kimi_pipe.stages.command import report

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        return sweep(parse_args(argv))
    except Exception as exc:
        status = report(exc)
        if status is None:
            raise
        return status


def sweep(args: SweepArgs) -> int:
    """Probes, one generate job per provider, then the report; the jobs' exit status."""
    name, limit_key = resolve_dataset(args)
    command = build_command(args, name, limit_key)
    sweep_dir = sweep_dir_of(command)
    print(
        f"[sweep] {len(args.providers)} providers x {args.n} prompts of {name}, "
        f"${args.usd_each} each (of ${args.usd:g}) -> {sweep_dir}",
        file=sys.stderr,
        flush=True,
    )
    print("[sweep] the same as: " + shlex.join(command), file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    if args.probes:
        run_probe_stage(args, sweep_dir)
    status = run_jobs(args, sweep_dir, limit_key)
    if args.report and any(sweep_dir.rglob("records.jsonl")):
        from kimi_pipe.stages.report import build_report

        build_report(sweep_dir, sweep_dir)  # also reports a partly finished sweep
    return status


if __name__ == "__main__":
    raise SystemExit(main())
