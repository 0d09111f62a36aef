r"""Stage `probe`: conformance probes, pinned to each provider, and a conformance table.

    python -m kimi_pipe probe probe.providers=[moonshotai,fireworks] [probe.usd=0.3] \
        [probe.output_dir=runs/probe] [probe.battery=PATH.yaml] [group.key=value ...]
    make probe providers=moonshotai,fireworks [usd=0.3]          # the same

A Hydra app over the shared config; its settings are the `probe` group
(conf/probe/default.yaml), the model and provider settings those of generate.
A battery (`conf/probes/<model>.yaml`) holds small prompts built so that one server
transformation (a quirk) shows in the answer, each with a deterministic check. For every
provider the battery is bought through the generate stage, pinned to it
(`provider.routing.order=[slug]`, `allow_fallbacks=false`), asking for logprobs without
requiring them (a provider without logprobs still answers), under `usd` split evenly.
Then `conformance.json` and `conformance.md` say per provider and quirk: clean (the answer
shows the model's text intact), seen (changed), unknown (no usable answer); whether the
provider returns logprobs and whether they agree with the text; the serving profile that
fits; and whether the provider can be used (no seen quirk that cannot be inverted).

Run directory: `<output_dir>/prompts.jsonl`, `<output_dir>/<slug>/` (generate's run),
`conformance.json`, `conformance.md`. Running it again resumes (answered probes are kept).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kimi_pipe.config import compose
from kimi_pipe.conformance.probe import (
    Battery,
    ProbeSettings,
    ProviderConformance,
    battery_of,
    check_providers,
    probe_overrides,
)
from kimi_pipe.generation.probes import probe_providers
from kimi_pipe.stages.command import compose_command
from kimi_pipe.stages.help import HELP
from kimi_pipe.stages.jobs.groups import plain_node, with_overrides
from kimi_pipe.stages.jobs.probe import probe_job
from kimi_pipe.stages.jobs.probe import probe_settings as settings_of
from kimi_pipe.store.layout import CONFORMANCE_JSON, PROBES_DIR


def probe(
    cfg: Any, out_dir: Path, settings: ProbeSettings | None = None
) -> list[ProviderConformance]:
    """The probes the composed config's `probe` node asks for, into `out_dir`."""
    settings = settings or settings_of(cfg)
    composed = with_overrides(cfg, probe_overrides(settings.overrides))
    battery = battery_of(str(plain_node(composed, "model.name")), settings)
    base = probe_job(composed)
    return probe_providers(base, settings.providers, out_dir, battery, settings.usd)


def run_probes(
    providers: Sequence[str],
    out_dir: Path,
    battery: Battery,
    usd: float | None,
    overrides: Sequence[str] = (),
) -> list[ProviderConformance]:
    """`probe_providers` on the config composed from `overrides` (for scripts and tests)."""
    check_providers(providers, "providers")  # before the job's own checks, as the stage does
    base = probe_job(compose(probe_overrides(overrides)))
    return probe_providers(base, providers, out_dir, battery, usd)


def run_stage(cfg: Any, run_dir: Path | None = None) -> dict[str, Any]:
    """The stage entry: probes pinned to each of `probe.providers` (in pipeline=sweep, the
    sweep's providers and probe budget) into <run_dir>/probes."""
    out = Path(run_dir if run_dir is not None else "runs/probe") / PROBES_DIR
    results = probe(cfg, out)
    return {
        "conformance": str(out / "conformance.md"),
        "usable": [r.provider for r in results if r.usable],
        "left_out": [r.provider for r in results if not r.usable],
    }


def outputs(cfg: Any, run_dir: Path) -> list[Path]:
    return [run_dir / PROBES_DIR / CONFORMANCE_JSON]


# The command line before it was a Hydra app: `providers=a,b` is now `probe.providers=[a,b]`.
MOVED = {key: f"probe.{key}" for key in ("providers", "usd", "output_dir", "battery")}


def main(argv: Sequence[str] | None = None) -> int:
    def probe_command(cfg: Any) -> int:
        settings = settings_of(cfg)
        out = Path(settings.output_dir)
        results = probe(cfg, out, settings)
        usable = [r.provider for r in results if r.usable]
        print(
            f"probe: {len(usable)}/{len(results)} providers usable "
            f"({', '.join(usable) or 'none'}) -> {out / 'conformance.md'}",
            file=sys.stderr,
        )
        return 0

    return compose_command(probe_command, argv, help=HELP["probe"], moved=MOVED)


if __name__ == "__main__":
    raise SystemExit(main())
