"""`--help` of every command: what the stage does, its main settings (each with one line and
the value it has now) and two examples, instead of Hydra's dump of the whole config.

One `StageHelp` per command, in `HELP`; `help_text` renders it (the commands print it).
`tests/test_door.py` checks that every setting named here exists in the composed config.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
from yaml import YAMLError

from kimi_pipe.config import CONF_DIR
from kimi_pipe.stages.settings_help import HELP as DESCRIBED
from kimi_pipe.stages.settings_help import MIRRORED_HELP


@dataclass(frozen=True)
class StageHelp:
    """What `python -m kimi_pipe <name> --help` says."""

    name: str
    what: str  # what the stage does, a few lines
    main: tuple[str | tuple[str, str], ...]  # a key a schema describes, or (key, line)
    examples: tuple[str, ...]
    more: str = ""  # where to read on
    whole_config: bool = False  # a Hydra app: `--cfg job` prints every setting

    @property
    def settings(self) -> tuple[tuple[str, str], ...]:
        """(setting, one line on it): a schema's field by its description (one source)."""
        return tuple((k, _described(k)) if isinstance(k, str) else k for k in self.main)


_GENERATE = StageHelp(
    "generate",
    "Buy answers to a dataset's prompts from a provider (LiteLLM) under a hard USD cap and "
    "store each with its exact token ids (records.jsonl in the run directory). Running the "
    "same command again resumes: answered prompts are skipped, money spent counts.",
    (
        ("dataset", "the prompts: jsonl (dataset.path=FILE) or B3..B8 (downloaded from the Hub)"),
        "dataset.path",
        "dataset.limit",
        ("provider", "where answers are bought: openrouter (key in OPENROUTER_API_KEY) or local"),
        "budget.usd",
        "provider.concurrency",
        "provider.params.max_tokens",
        ("serving", "what the provider's stack does to text: auto (probed first) or a profile"),
        ("model", "the target model's config (tokenizer, markers): conf/model/"),
        "output_dir",
    ),
    (
        "python -m kimi_pipe generate dataset=B5 budget.usd=5",
        "make generate dataset=jsonl dataset.path=prompts.jsonl budget.usd=2 serving=unknown",
    ),
    "docs/generate.md",
    whole_config=True,
)

_RECONSTRUCT = StageHelp(
    "reconstruct",
    "Turn provider answers (one {id, messages, tools?, response} a line) into exact token "
    "records (prompt_ids, output_ids, loss_mask, issues), checked against the billed "
    "completion tokens; OUT.jsonl.summary.json counts them. Buys nothing.",
    (
        "input",
        "output",
        ("model", "the target model's config: conf/model/ (kimi_k25, qwen3_5, smollm2)"),
        "model.tokenizer.path",
        ("serving", "what the provider's stack did to text (conf/serving/)"),
        "validation.billing_tolerance",
    ),
    (
        "python -m kimi_pipe reconstruct model=kimi_k25 input=IN.jsonl output=OUT.jsonl",
        "python -m kimi_pipe reconstruct model=smollm2 input=runs/demo/records.jsonl "
        "output=out.jsonl serving=exact",
    ),
    "docs/reconstruct.md",
)

_AUDIT = StageHelp(
    "audit",
    "The fidelity audit: a run's reconstructed ids against ids an engine really produced "
    "(greedy generation with the same weights), as an exact-match rate and mismatch "
    "classes (audit.json, audit.md).",
    (
        "audit.run_dir",
        "audit.records",
        "audit.model_path",
        "audit.limit",
        "audit.device",
        "audit.output_dir",
    ),
    (
        "python -m kimi_pipe audit model=smollm2 audit.run_dir=runs/demo",
        "python -m kimi_pipe audit model=smollm2 audit.records=out.jsonl audit.limit=8",
    ),
    "docs/demo.md",
)

_EXTRACT = StageHelp(
    "extract",
    "EAGLE-3 hidden states of a run's token records, computed by the target model "
    "(transformers, or SGLang) into a sharded store (default <run>/hidden_<backend>/). Ids "
    "come from the records, never re-tokenised; running it again resumes.",
    (
        ("extract", "the engine: hf (transformers, CPU or GPU) or sglang"),
        "extract.run_dir",
        "extract.records",
        "extract.model_path",
        "extract.device",
        "extract.max_len",
        "extract.store_dtype",
        "extract.output_dir",
        "extract.executor",
    ),
    (
        "python -m kimi_pipe extract model=smollm2 extract.run_dir=runs/demo",
        "python -m kimi_pipe extract extract=sglang extract.run_dir=runs/B5/x "
        "extract.model_path=/models/Kimi-K2.5",
    ),
    "docs/extract.md",
    whole_config=True,
)

_EXPORT = StageHelp(
    "export",
    "Training files for an EAGLE-3 trainer (SpecForge, speculators, ModelOpt or tokens "
    "only) from hidden-state stores, merged and shuffled deterministically, with a dataset "
    "card. A killed export resumes.",
    (
        "format",
        "stores",
        "output",
        "seed",
        "export.accept",
        "export.workers",
        "target_model_path",
        "export.push_to_hub.repo_id",
    ),
    (
        "python -m kimi_pipe export format=specforge stores=[runs/demo/hidden_hf] output=out",
        "python -m kimi_pipe export format=tokens stores=[runs/B5/x/hidden_hf] output=tok seed=1",
    ),
    "docs/export.md",
    whole_config=True,
)

_PROBE = StageHelp(
    "probe",
    "Conformance probes (conf/probes/<model>.yaml) pinned to each named provider: what its "
    "serving stack does to text, judged per probe, into runs/probe/conformance.md.",
    (
        "probe.providers",
        "probe.usd",
        "probe.battery",
        "probe.output_dir",
        ("model", "the target model's config (conf/model/)"),
    ),
    (
        "python -m kimi_pipe probe probe.providers=[moonshotai,fireworks]",
        "make probe providers=moonshotai,fireworks usd=0.3",
    ),
    "docs/provider-truth.md",
)

_SWEEP = StageHelp(
    "sweep",
    "Compare providers: one pinned generate job per OpenRouter provider on the same first n "
    "prompts, sharing one budget, then a report (report.md and charts) over them.",
    (
        "sweep.providers",
        "sweep.n",
        "sweep.usd",
        ("dataset", "the prompts (conf/dataset/)"),
        "sweep.dry_run",
        "sweep.probes",
        "sweep.sweep_dir",
    ),
    (
        "python -m kimi_pipe sweep dataset=B5 sweep.providers=[moonshotai,novita] sweep.usd=6",
        "make sweep dataset=B5 providers=moonshotai,fireworks n=50 usd=6",
    ),
    "docs/sweep.md",
)

_REPORT = StageHelp(
    "report",
    "The provider report over finished generate runs: fidelity, cost, speed and the routing "
    "it recommends (report.md, report.json and charts).",
    (
        "report.sweep_dir",
        "report.out_dir",
        "report.min_ok_rate",
        "report.max_error_rate",
    ),
    (
        "python -m kimi_pipe report report.sweep_dir=runs/sweep/B5",
        "make report sweep_dir=runs/demo",
    ),
    "docs/sweep.md",
)

_DEMO = StageHelp(
    "demo",
    "The whole pipeline offline on SmolLM2-135M served on 127.0.0.1 (no key, no GPU, no "
    "Hub): generate -> reconstruct -> audit -> extract -> export on the bundled prompts, "
    "then where everything is and the exact-match rate. Again: finished stages are skipped.",
    (
        "dataset.limit",
        "provider.params.max_tokens",
        "output_dir",
    ),
    (
        "python -m kimi_pipe demo",
        "make demo dataset.limit=4 provider.params.max_tokens=16 output_dir=runs/demo-small",
    ),
    "docs/demo.md",
)

_RUN = StageHelp(
    "run",
    "A whole job from conf/pipeline/NAME.yaml: its stages in order, each skipped when its "
    "outputs are complete for the same settings; a killed run is finished by running the "
    "same command again. One table of what ran at the end.",
    (
        ("pipeline", "which job: demo, openrouter_sglang or sweep (conf/pipeline/)"),
        "output_dir",
        ("dataset", "the prompts (conf/dataset/)"),
        "budget.usd",
    ),
    (
        "python -m kimi_pipe run pipeline=demo",
        "make run pipeline=openrouter_sglang dataset=B5 budget.usd=20 "
        "extract.model_path=/models/Kimi-K2.5",
    ),
    "docs/design.md (the runner)",
)

HELP: dict[str, StageHelp] = {
    h.name: h
    for h in (
        _GENERATE, _RECONSTRUCT, _AUDIT, _EXTRACT, _EXPORT, _PROBE, _SWEEP, _REPORT, _DEMO, _RUN
    )
}  # fmt: skip


def help_text(stage: StageHelp, argv: Sequence[str] = ()) -> str:
    """`--help`: what the stage does, its main settings with the values they have with the
    other arguments given (`generate dataset=B5 --help` shows B5's), and two examples."""
    overrides = [a for a in argv if not a.startswith("-")]
    cfg = OmegaConf.create({})
    for tried in (overrides, []):
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = hydra_compose("config", overrides=tried, return_hydra_config=True)
            break
        except (HydraException, OmegaConfBaseException, YAMLError, UnicodeDecodeError):
            continue
    choices = OmegaConf.select(cfg, "hydra.runtime.choices", default={})
    lines = [f"python -m kimi_pipe {stage.name} [key=value ...]", ""]
    lines += textwrap.wrap(stage.what, 92)
    lines += ["", "main settings (key=value; `make ... key=value` passes them too), now:"]
    rows = [
        (f"{key}={choices.get(key) if _options(key) else _shown(cfg, key)}", about, _options(key))
        for key, about in stage.settings
    ]
    width = min(max(len(left) for left, _, _ in rows), 34)
    for left, about, options in rows:
        if len(left) > width:
            lines += [f"  {left}", f"  {'':<{width}}  {about}"]
        else:
            lines.append(f"  {left:<{width}}  {about}")
        if options:
            lines += [f"  {'':<{width}}    {part}" for part in textwrap.wrap(options, 60)]
    lines += ["", "examples:", *(f"  {e}" for e in stage.examples), ""]
    every = (
        f"every setting: python -m kimi_pipe {stage.name} --cfg job"
        if stage.whole_config
        else "every setting: conf/config.yaml and its groups"
    )
    lines.append(every + (f"; more in {stage.more}" if stage.more else ""))
    return "\n".join(lines)


def _described(key: str) -> str:
    node, _, name = key.rpartition(".")
    if node in DESCRIBED:
        return DESCRIBED[node][name]
    group, _, below = key.partition(".")
    return MIRRORED_HELP[group][below]


def _options(key: str) -> str:
    """A config group's options (conf/<key>/*.yaml), said after its line; "" for a value."""
    if not (CONF_DIR / key).is_dir():
        return ""
    return "options: " + " ".join(sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml")))


def _shown(cfg: DictConfig, key: str) -> str:
    """A setting's value as typed on the command line: a group's choice by its name, a value
    resolved where it can be, else as written; `???` where it must be given."""
    try:
        value = OmegaConf.select(
            cfg, f"{key}.name" if _options(key) else key, throw_on_missing=True
        )
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
    except MissingMandatoryValue:
        return "??? (required)"
    except OmegaConfBaseException:
        value = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):  # a schema's float: 7, not 7.0, as it was typed
        return f"{value:g}"
    return str(value).replace("'", "").replace(" ", "")
