"""Stage: export hidden-state stores for an EAGLE-3 trainer, with a dataset card.

    python -m kimi_pipe export format=specforge stores=[runs/B5/x/hidden_hf,runs/B6/x/hidden_hf] \
        seed=0 output=exports/b5-b6 [target_model_path=/models/Kimi-K2.5]

Formats are plug-ins (docs/export.md): one file in kimi_pipe/exporters/ and one config
`conf/export/<name>.yaml` each (`specforge`, `speculators`, `modelopt`, `tokens`); `format=NAME`
picks one (an alias of the group choice `export=NAME`). The exporter protocol is in `base.py`.

Every export reads the store's manifest and converts (post-norm from a pre-norm store that
recorded its final norm; layer ids renamed to the trainer's convention; fp8 states
dequantized) or refuses with a message before writing anything: it never writes a convention
it was not asked for. Its summary and card describe the files as written (`files`), with the
store's own description (`source_manifest`) and what was converted (`converted`) apart.

Merge and shuffle are deterministic: samples of all stores are ordered by (store path, sample
id) and shuffled with `random.Random(seed)`, so the same stores and seed always give the same
files, whatever order the stores are listed in. `export_index.jsonl` maps each file back to its
store and sample id. A killed export resumes: files are written tmp + rename and existing ones
are kept (the plan is checked to be the same). Samples with NaN/inf states are skipped, counted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.errors import ConfigError
from kimi_pipe.stages.command import compose_command
from kimi_pipe.stages.help import HELP

# The exporters (and torch under them) are imported where the stage runs, not here: `--help`,
# a mistyped override or a key on the command line is answered without loading them.


def inputs(cfg: DictConfig, run_dir: Path) -> list[Path]:
    from kimi_pipe.stages.jobs.export import stores_of  # torch: where the stage runs

    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    return [Path(s) for s in stores_of(values)]


def outputs(cfg: DictConfig, run_dir: Path) -> list[Path]:
    from kimi_pipe.exporters import CARD_FILE  # torch: where the stage runs
    from kimi_pipe.stages.jobs.export import output_dir  # torch: where the stage runs

    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    return [output_dir(values, run_dir) / CARD_FILE]


def run_stage(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """The stage entry: training files from `stores` (default output: <run_dir>/export_<fmt>)."""
    from kimi_pipe.exporters import run_export  # torch: where the stage runs
    from kimi_pipe.stages.jobs.export import export_job, stores_of  # torch: where the stage runs

    # Converted once, here: below the door plain values (a mandatory one never given: ???).
    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    if not stores_of(values):
        raise ConfigError("no store to export: run an extract stage first or pass stores=[...]")
    return run_export(export_job(values, run_dir))


def main(argv: list[str] | None = None) -> int:
    def export_stage(cfg: DictConfig) -> None:
        from kimi_pipe.exporters import run_export  # torch: where the stage runs
        from kimi_pipe.stages.jobs.export import export_job  # torch: where the stage runs

        values = cast(
            dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        )
        run_export(export_job(values))

    return compose_command(export_stage, argv, name="export", help=HELP["export"])


if __name__ == "__main__":
    sys.exit(main())
