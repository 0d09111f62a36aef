r"""Provider sweep: one pinned generate job per OpenRouter provider, then the report.

    python -m kimi_pipe sweep dataset=B5 sweep.providers=[moonshotai,fireworks,novita] \
        sweep.n=50 sweep.usd=6 [sweep.sweep_dir=runs/sweep/B5] [sweep.report=true] \
        [sweep.dry_run=false] [sweep.probes=true] [sweep.probe_usd=X] [group.key=value ...]
    make sweep dataset=B5 providers=moonshotai,fireworks,novita n=50 usd=6     # the same

A Hydra app over the shared config; its settings are the `sweep` group
(conf/sweep/default.yaml). Every job is the sweep's own composed config with one provider
pinned (`provider.routing.order=[<slug>]`, `provider.routing.allow_fallbacks=false`), the
same first `sweep.n` prompts of the dataset and an even share of `sweep.usd` (null:
`budget.usd` is the shared total), so every provider gets the same cap on the same prompts
and no job can spend another's share. It writes `<sweep_dir>/<slug>/` (records.jsonl,
summary.json, .hydra/). Running the same command again resumes every job (generate skips
answered ids and counts money already spent). Then `kimi_pipe.reporting.report` writes
`<sweep_dir>/report.md` and its charts under the `report.*` policy.

Every other override (`provider.params.max_tokens=4096`, `dataset.path=p.jsonl`,
`model=...`) is part of each job's config, as for generate. The API key comes from the
environment, as for generate.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.config import comma_lists, node_settings
from kimi_pipe.conformance.probe import battery_of, check_providers
from kimi_pipe.core.models import load_model
from kimi_pipe.errors import (
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    ConfigError,
    InputError,
    KimiPipeError,
    one_line,
)
from kimi_pipe.generation.probes import probe_providers, run_generate
from kimi_pipe.generation.run import finish_status
from kimi_pipe.reporting.report import build_report
from kimi_pipe.stages.command import compose_command
from kimi_pipe.stages.config_errors import override_key
from kimi_pipe.stages.help import HELP
from kimi_pipe.stages.jobs.generate import generate_job
from kimi_pipe.stages.jobs.groups import mapping_node, plain_node, with_overrides
from kimi_pipe.stages.jobs.probe import probe_job
from kimi_pipe.stages.jobs.report import read_saved_config, report_settings
from kimi_pipe.stages.schemas import SweepFields
from kimi_pipe.store.layout import PROBES_DIR, RECORDS
from kimi_pipe.store.prompt_datasets import check_prompt_source

# Where the provider group keeps the pinned order and the fallback switch.
ORDER_KEY = "provider.routing.order"
FALLBACKS_KEY = "provider.routing.allow_fallbacks"
# The dataset keys that cap how many prompts a source yields, in order of preference.
LIMIT_KEYS = ("num_samples", "limit")


@dataclass
class SweepSettings(SweepFields):
    """The `sweep` config node (conf/sweep/default.yaml): the schema's fields, `usd` checked
    by `settings_of` (the shared total; budget.usd when null)."""

    @property
    def usd_each(self) -> float:
        assert self.usd is not None, "settings_of fills usd"
        # Rounded down to a micro-dollar so the shares never add up to more than `usd`.
        return int(self.usd / len(self.providers) * 1e6) / 1e6


def settings_of(cfg: Any) -> SweepSettings:
    """The checked `sweep` settings of a composed config (usd filled from budget.usd)."""

    settings = node_settings(cfg, "sweep", SweepSettings, fix=comma_lists("providers"))
    check_providers(settings.providers, "sweep.providers")
    usd = settings.usd
    if usd is None:
        usd = OmegaConf.select(cfg, "budget.usd", default=None)
    if usd is None:
        raise ConfigError("sweep.usd=X is required: the budget shared by the whole sweep")
    if settings.n < 1 or float(usd) <= 0:
        raise ConfigError(f"sweep.n must be >= 1 and sweep.usd > 0 (got n={settings.n}, usd={usd})")
    return replace(settings, usd=float(usd))


def resolve_dataset(cfg: Any) -> tuple[str, str]:
    """(dataset name, the key that limits its prompt count) of a composed config."""
    for key in LIMIT_KEYS:
        if key in cfg.dataset:
            return str(cfg.dataset.name), key
    raise ConfigError(
        f"dataset={cfg.dataset.name} has none of {LIMIT_KEYS}; the sweep cannot give every "
        "provider the same n prompts"
    )


def measures_as_is(cfg: Any) -> bool:
    """A sweep measures every provider as it is (the probes ran first, into probes/):
    serving=auto, the default, would refuse the unusable ones, so its jobs run as
    serving=unknown; a profile named with serving=NAME is kept."""
    return str(OmegaConf.select(cfg, "serving.name", default="")) == "auto"


def job_overrides(settings: SweepSettings, slug: str, limit_key: str, as_is: bool) -> list[str]:
    """What one provider's job sets on the sweep's config."""
    return [
        f"provider.name={slug}",
        f"{ORDER_KEY}=[{slug}]",
        f"{FALLBACKS_KEY}=false",
        f"dataset.{limit_key}={settings.n}",
        f"budget.usd={settings.usd_each}",
        *(["serving=unknown"] if as_is else []),
    ]


def job_config(base: DictConfig, settings: SweepSettings, slug: str, limit_key: str) -> Any:
    return with_overrides(base, job_overrides(settings, slug, limit_key, measures_as_is(base)))


def build_command(
    settings: SweepSettings,
    limit_key: str,
    sweep_dir: Path,
    given: Sequence[str],
    as_is: bool,
) -> list[str]:
    """The same sweep as one Hydra multirun of the generate command, from the overrides the
    sweep was given (shown to the user; the sweep calls generate as a function, job by job)."""
    return [
        sys.executable,
        "-m",
        "kimi_pipe",
        "generate",
        "--multirun",
        *given,
        *settings.overrides,
        # One job per slug, in <sweep_dir>/<slug> (hydra.sweep.subdir below).
        f"provider.name={','.join(settings.providers)}",
        f"{ORDER_KEY}=[${{provider.name}}]",
        f"{FALLBACKS_KEY}=false",
        f"dataset.{limit_key}={settings.n}",
        f"budget.usd={settings.usd_each}",
        *(["serving=unknown"] if as_is else []),
        f"hydra.sweep.dir={sweep_dir.as_posix()}",
        # The jobs differ by slug alone: name their directories by it (the report reads them).
        "hydra.sweep.subdir=${provider.name}",
    ]


def run_probe_step(base: DictConfig, settings: SweepSettings, sweep_dir: Path) -> None:
    """Conformance probes pinned to each provider, into <sweep_dir>/probes (resumable)."""

    battery = battery_of(str(plain_node(base, "model.name")))
    print(
        f"[sweep] conformance probes first ({len(battery.probes)} per provider)",
        file=sys.stderr,
        flush=True,
    )
    probe_providers(
        probe_job(base),
        settings.providers,
        sweep_dir / PROBES_DIR,
        battery,
        settings.probe_usd,
        usd_key="sweep.probe_usd",
    )


def run_jobs(base: DictConfig, settings: SweepSettings, sweep_dir: Path, limit_key: str) -> int:
    """One generate job per provider, in this process; the worst job's exit status. A
    mistake in the shared config (ConfigError, InputError) stops the sweep, said once; a
    failure of one provider's job is said for it and the next provider goes on."""

    worst = 0
    for slug in settings.providers:
        cfg = job_config(base, settings, slug, limit_key)
        run_dir = sweep_dir / slug
        # What a Hydra job saves: the job's composed config, for the report and for humans.
        saved = run_dir / ".hydra" / "generate"
        saved.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, saved / "config.yaml")
        print(f"[sweep] {slug} -> {run_dir}", file=sys.stderr, flush=True)
        try:
            status = finish_status(*run_generate(generate_job(cfg, run_dir), run_dir))
        except (ConfigError, InputError):
            raise  # the same in every job
        except (KimiPipeError, OSError) as exc:
            message = one_line(exc)
            if message is None:
                raise  # a bug
            print(f"[sweep] {slug}: {message}", file=sys.stderr, flush=True)
            status = EXIT_USER_ERROR
        except KeyboardInterrupt:
            print(f"interrupted; run the same command again to resume ({sweep_dir})",
                  file=sys.stderr)  # fmt: skip
            return EXIT_INTERRUPTED
        if status:
            print(f"[sweep] {slug}: generate exited with status {status}", file=sys.stderr)
            worst = max(worst, status)
    return worst


def sweep(
    cfg: DictConfig,
    settings: SweepSettings,
    run_dir: Path | None = None,
    given: Sequence[str] | None = None,
) -> tuple[int, dict[str, Any]]:
    """Probes, one generate job per provider, then the report; (the jobs' worst exit status,
    summary). `given`: the command line's overrides, to show the equivalent multirun."""
    base = with_overrides(cfg, settings.overrides) if settings.overrides else cfg
    name, limit_key = resolve_dataset(base)
    sweep_dir = run_dir or Path(settings.sweep_dir or Path("runs") / "sweep" / name)
    summary = {"sweep_dir": str(sweep_dir), "report": str(sweep_dir / "report.md")}
    print(
        f"[sweep] {len(settings.providers)} providers x {settings.n} prompts of {name}, "
        f"${settings.usd_each} each (of ${settings.usd:g}) -> {sweep_dir}",
        file=sys.stderr,
        flush=True,
    )
    if given is not None:
        command = build_command(settings, limit_key, sweep_dir, given, measures_as_is(base))
        print("[sweep] the same as: " + shlex.join(command), file=sys.stderr, flush=True)
    if settings.dry_run:
        return 0, summary

    # What every job shares is checked once, before the probes buy anything: the prompts,
    # and a model config its tokenizer contradicts.
    check_prompt_source(mapping_node(base, "dataset"))
    load_model(base.model)
    if settings.probes:
        run_probe_step(base, settings, sweep_dir)
    status = run_jobs(base, settings, sweep_dir, limit_key)
    if settings.report and any(sweep_dir.rglob(RECORDS)):
        # also a partly finished sweep
        build_report(
            sweep_dir, sweep_dir, report_settings(cfg).policy(), read_config=read_saved_config
        )
    return status, summary


def run_stage(cfg: Any, run_dir: Path | None = None) -> dict[str, Any]:
    """The stage entry: the sweep the composed config's `sweep` node describes, into run_dir
    (or `sweep.sweep_dir`, else runs/sweep/<dataset>)."""
    status, summary = sweep(cfg, settings_of(cfg), run_dir)
    if status != 0:
        raise ConfigError(f"the sweep's generate jobs exited with status {status}")
    return summary


# The command line before it was a Hydra app: `providers=a,b` is now `sweep.providers=[a,b]`.
MOVED = {
    key: f"sweep.{key}"
    for key in ("providers", "n", "usd", "sweep_dir", "report", "dry_run", "probes", "probe_usd")
}


def main(argv: Sequence[str] | None = None) -> int:

    overrides = list(sys.argv[1:] if argv is None else argv)
    # What the jobs take from the command line, for the equivalent multirun shown (not the
    # sweep's own settings, nor budget.usd: there the shared total, in a job its share).
    given = [
        o
        for o in overrides
        if override_key(o).split(".", 1)[0] not in ("sweep", "report")
        and override_key(o) != "budget.usd"
    ]
    return compose_command(
        lambda cfg: sweep(cfg, settings_of(cfg), None, given)[0],
        overrides,
        help=HELP["sweep"],
        moved=MOVED,
    )


if __name__ == "__main__":
    raise SystemExit(main())
