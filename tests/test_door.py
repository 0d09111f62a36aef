"""The door a user walks through (issue 42): a typo is answered with what it meant, `--help`
says what a stage does, and a refused start leaves nothing behind. Each command runs in a
subprocess, as a user types it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_pipe.config import CONF_DIR, compose
from kimi_pipe.stages.config_errors import did_you_mean, setting_keys
from kimi_pipe.stages.help import HELP
from tests.support.cases import load_or_skip

REPO = Path(__file__).resolve().parent.parent
FAKE_KEY = "sk" + "-test-not-a-real-key"


def kimi_pipe(*args: str, cwd: Path, key: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    env.pop("OPENROUTER_API_KEY", None)
    if key:
        env["OPENROUTER_API_KEY"] = FAKE_KEY
    return subprocess.run(
        [sys.executable, "-m", "kimi_pipe", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def one_error(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused command prints: exit 2, no traceback, nothing said twice."""
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "error" in line.lower()]
    assert len(errors) == 1, errors
    assert errors[0].startswith("error: ")
    return errors[0]


KEYS = ["dataset", "dataset.limit", "dataset.path", "dataset.name", "budget", "budget.usd",
        "sweep.usd", "probe.usd", "export.workers", "format", "seed"]  # fmt: skip


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("dataset.limt", ["dataset.limit"]),  # beside it
        ("datset", ["dataset"]),
        ("budget.ud", ["budget.usd"]),
        ("usd", ["budget.usd", "probe.usd", "sweep.usd"]),  # the same name under other nodes
        ("formt", ["format"]),
        ("colour", []),  # nothing close: no guess
        ("export.shard_sze", []),
    ],
)
def test_did_you_mean_names_only_close_settings(typed: str, meant: list[str]) -> None:
    assert sorted(did_you_mean(typed, KEYS)) == meant


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["generate", "dataset.limt=4"],
         "dataset.limt=4: no such setting; did you mean dataset.limit?"),
        (["demo", "dataset.limt=4"], "did you mean dataset.limit?"),
        (["export", "export.workrs=2"], "did you mean export.workers?"),
        (["generate", "dataset=jsonl", "dataset.pth=x"], "did you mean dataset.path?"),
        (["sweep", "sweep.provders=[a]"], "did you mean sweep.providers?"),
        (["generate", "--multirun", "dataset.limt=1,2"],
         "dataset.limt=1,2: no such setting; did you mean dataset.limit?"),
        (["generate", "colour=red"], "colour=red: no such setting"),
    ],
)  # fmt: skip
def test_a_typo_is_one_line_with_what_it_meant(args: list[str], said: str, tmp_path: Path) -> None:
    line = one_error(kimi_pipe(*args, cwd=tmp_path))
    assert said in line, line
    assert "To append" not in line  # Hydra's hint would add the typo as a new key
    assert not any(tmp_path.iterdir())  # nothing written


# --- `--help` -----------------------------------------------------------------------------


@pytest.mark.parametrize("stage", sorted(HELP))
def test_help_says_what_the_stage_does_in_a_page(stage: str, tmp_path: Path) -> None:
    """Not Hydra's 337-line dump of the config: what it does, its main settings with their
    values, two examples; nothing run, nothing written."""
    done = kimi_pipe(stage, "--help", cwd=tmp_path, key=False)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    lines = out.splitlines()
    assert lines[0] == f"python -m kimi_pipe {stage} [key=value ...]"
    assert 10 < len(lines) < 60, len(lines)
    assert HELP[stage].what.split()[0] in out and "examples:" in out
    for key, _ in HELP[stage].settings:
        assert f"  {key}=" in out, key
    assert "tokenizer:" not in out and "hydra:" not in out  # no config dump
    assert not any(tmp_path.iterdir())


def test_help_piped_into_a_reader_that_stops_early_ends_quietly(tmp_path: Path) -> None:
    """`--help | head -1`: the reader closes the pipe; no BrokenPipeError traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "kimi_pipe", "export", "--help"]
    with subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        first = process.stdout.readline()
        process.stdout.close()  # as `head -1` does after its line
        stderr = process.stderr.read().decode()
        process.wait(timeout=120)
    assert first.startswith(b"python -m kimi_pipe export")
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_help_loads_no_engine(tmp_path: Path) -> None:
    """`--help` of every stage, and extract's missing input, answer without importing torch,
    transformers, LiteLLM or datasets: those load only where a stage runs (export and extract
    used to load torch for their help, about 2 s of 3)."""
    heavy = ("torch", "transformers", "litellm", "datasets")
    missing = ["extract", "extract.run_dir=/missing/run", "extract.model_path=/missing/model"]
    script = (
        "import contextlib, io, json, sys\n"
        "from kimi_pipe.cli import STAGES, main\n"
        "loaded = {}\n"
        f"for args in [[stage, '--help'] for stage in STAGES] + [{missing!r}]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        status = main(args)\n"
        f"    loaded[' '.join(args)] = [status, sorted(m for m in {heavy!r} if m in sys.modules)]\n"
        "print(json.dumps(loaded))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert {"export --help", "extract --help", "generate --help"} <= set(loaded)
    assert loaded.pop(" ".join(missing)) == [2, []], done.stderr[-2000:]
    assert "records.jsonl not found" in done.stderr
    assert all(status == [0, []] for status in loaded.values()), loaded
    assert not any(tmp_path.iterdir())


def test_help_shows_the_values_the_other_arguments_give(tmp_path: Path) -> None:
    out = kimi_pipe("generate", "dataset=B5", "budget.usd=7", "--help", cwd=tmp_path).stdout
    assert "  dataset=B5 " in out and "  budget.usd=7 " in out


@pytest.mark.parametrize("stage", sorted(HELP))
def test_every_setting_and_example_in_help_is_real(stage: str) -> None:
    """A setting named in --help exists (a key of the composed config or a group), and every
    `python -m kimi_pipe` example composes: help cannot drift from the config."""
    base = ["pipeline=demo"] if stage == "demo" else []
    keys = set(setting_keys(compose(base)))
    for key, about in HELP[stage].settings:
        assert key in keys or (CONF_DIR / key).is_dir(), key
        assert about and "\n" not in about
    assert len(HELP[stage].examples) == 2
    for example in HELP[stage].examples:
        words = example.split()
        if words[:3] == ["python", "-m", "kimi_pipe"]:
            assert words[3] == stage
            compose(base + words[4:])  # raises on an unknown key or option


# --- errors a user reads once, naming the real cause; nothing left behind ------------------


def prompts(tmp: Path) -> Path:
    path = tmp / "prompts.jsonl"
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    return path


NOBODY = "provider.api_base=http://127.0.0.1:9/v1"  # nothing listens there


def test_no_network_is_named_not_the_budget(tmp_path: Path) -> None:
    """Network down (nothing at the api_base): said as such, not as serving=auto's probes
    not fitting the budget at the fallback prices."""
    load_or_skip("kimi_k25")  # the default model: its tokenizer renders the prompt
    done = kimi_pipe("generate", f"dataset.path={prompts(tmp_path)}", "output_dir=run", NOBODY,
                     cwd=tmp_path)  # fmt: skip
    line = one_error(done)
    assert "cannot reach the provider at http://127.0.0.1:9/v1/models" in line, line
    assert "budget" not in line
    # Nothing reached the provider: the run directory (serving=auto's probe prompts, a
    # journal that reserved the probes and settled them at $0) goes, as after a refused start.
    assert not (tmp_path / "run").exists(), sorted(p.name for p in (tmp_path / "run").rglob("*"))


def test_a_run_directory_with_money_or_work_in_it_stays(tmp_path: Path) -> None:
    """After a failed start, a directory goes only when nothing in it was used: a journal
    with a request open (the provider may have billed it), one settled as billed, or any
    file a start does not write keeps it all."""
    from kimi_pipe.store.run_dir import remove_if_unused
    from kimi_pipe.store.spend_journal import JOURNAL, SpendJournal

    def started(name: str) -> Path:
        run = tmp_path / name
        (run / ".hydra" / "generate").mkdir(parents=True)
        (run / ".hydra" / "generate" / "config.yaml").write_text("{}")
        (run / "generate.log").write_text("error: ...")
        (run / "serving_auto").mkdir()
        (run / "serving_auto" / "prompts.jsonl").write_text("{}\n")
        return run

    def journal(run: Path, cost: float | None, billed: bool, answered: bool = False) -> None:
        with SpendJournal(run / JOURNAL) as j:
            seq = j.intent("serving_auto:_route", 1, 0.05)
            if answered:
                j.generation(seq, "gen-1")
            if cost is not None:
                j.settle(seq, cost, billed)

    kept = {
        "open": lambda run: journal(run, None, False),  # killed mid-request: booked $0.05
        "billed": lambda run: journal(run, 0.0, True),  # an attempt the provider took
        "answered": lambda run: journal(run, 0.0, False, answered=True),  # an answer came
        "probe_journal": lambda run: journal(run / "serving_auto" / "_route", None, False),
        "records": lambda run: (run / "records.jsonl").write_text("{}\n"),
    }
    for name, use in kept.items():
        run = started(name)
        use(run)
        remove_if_unused([run], "generate")
        assert run.exists(), name
    run = started("unused")
    journal(run, 0.0, False)  # refused before generating: $0, not billed
    remove_if_unused([run], "generate")
    assert not run.exists()


def test_a_refused_start_leaves_no_run_directory(tmp_path: Path) -> None:
    """No key: refused before Hydra makes the run directory. A value of the wrong kind, an
    export without an output directory: the directory was made, and it goes again (with the
    parents the command made)."""
    done = kimi_pipe("generate", f"dataset.path={prompts(tmp_path)}", cwd=tmp_path, key=False)
    assert "no API key" in one_error(done)
    assert not (tmp_path / "runs").exists()
    # A value of the wrong kind: refused after the launch checks made the run directory.
    done = kimi_pipe("generate", f"dataset.path={prompts(tmp_path)}",
                     "provider.params.max_tokens=1.5", cwd=tmp_path)  # fmt: skip
    assert "provider.params.max_tokens=1.5" in one_error(done)
    assert not (tmp_path / "runs").exists()
    done = kimi_pipe("export", "stores=[]", "output_dir=runs/a/b", cwd=tmp_path)
    assert "pass output=DIR" in one_error(done)
    assert not (tmp_path / "runs").exists()
    # A directory that holds anything else stays, with what Hydra wrote.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    done = kimi_pipe("export", "stores=[]", "output_dir=mine", cwd=tmp_path)
    assert "pass output=DIR" in one_error(done)
    assert (tmp_path / "mine" / "notes.txt").exists()


def test_every_request_failed_is_said_once_with_its_count(tmp_path: Path) -> None:
    """Not "0 answered ... 0 failed" and then "every request failed": one line, counting
    the requests given up after their retries."""
    load_or_skip("kimi_k25")  # the default model: its tokenizer renders the prompt
    done = kimi_pipe("generate", f"dataset.path={prompts(tmp_path)}", "output_dir=run", NOBODY,
                     "serving=unknown", "provider.pricing.input_usd_per_mtok=1",
                     "provider.pricing.output_usd_per_mtok=1", "provider.retry.max_attempts=1",
                     cwd=tmp_path)  # fmt: skip
    assert done.returncode == 4, done.stderr[-2000:]
    said = done.stdout + done.stderr
    assert "0 answered" not in said
    final = [line for line in said.splitlines() if "every request of this run failed" in line]
    assert len(final) == 1, said[-2000:]
    assert "(connection: 1)" in final[0] and "1 given up after their retries" in final[0]


# --- the groups' schemas (kimi_pipe/stages/schemas.py) ---------------------------------------


def test_each_schema_field_has_a_one_line_description_and_the_yaml_its_keys() -> None:
    """Every field of every schema says what it is, and each group's yaml sets only fields
    its schema has (the schema is the yaml's base: a stray key would fail every compose)."""
    import dataclasses
    import pickle
    from typing import Any

    from omegaconf import OmegaConf

    from kimi_pipe.stages.schemas import SCHEMAS, ConfigSchema

    def described(schema: type, where: str) -> set[str]:
        for item in dataclasses.fields(schema):
            about = item.metadata.get("help")
            if dataclasses.is_dataclass(item.type):  # a nested schema: its own fields are
                described(item.type, f"{where}.{item.name}")
            elif item.type is not Any or where != "":  # the config's open groups: none
                assert about and "\n" not in about and len(about) <= 90, (where, item.name)
        return {f.name for f in dataclasses.fields(schema)}

    assert set(SCHEMAS) >= {"budget", "report", "audit", "probe", "validation", "serving_auto"}
    for group, schema in SCHEMAS.items():
        names = described(schema, group)
        for path in (CONF_DIR / group).glob("*.yaml"):
            keys = set(OmegaConf.load(path)) - {"defaults"}
            assert keys <= names, (path.name, keys - names)
        node = compose([])[group]
        assert OmegaConf.get_type(node) is schema, group  # the schema is the group's base
    # The config's own keys: each of config.yaml's typed, in the order composing gives them.
    written = [
        k for k in OmegaConf.load(CONF_DIR / "config.yaml") if k not in ("defaults", "hydra")
    ]
    assert OmegaConf.get_type(compose([])) is ConfigSchema
    assert set(written) <= described(ConfigSchema, "")
    # export and dataset: every option has its schema (by its name, or its source), and its
    # yaml only keys the schema has; a key of another option is not one of this one's.
    for group, others in (("export", ["max_length", "dtype"]), ("dataset", ["hf_id", "path"])):
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            node = compose([f"{group}={path.stem}"])[group]
            names = described(OmegaConf.get_type(node), group)  # type: ignore[arg-type]
            assert OmegaConf.get_type(node).__name__.endswith("Schema"), path.name
            assert set(OmegaConf.load(path)) <= names, path.name
            assert not set(others) <= names, path.name
    # A group whose schema mirrors each option's yaml: the composed option is its yaml, typed.
    from kimi_pipe.stages.schemas import MIRRORED

    for group in MIRRORED:
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            written = OmegaConf.load(path)
            node = compose([f"{group}={path.stem}"])[group]
            if "defaults" not in written:
                assert OmegaConf.get_type(node).__name__ == f"_{group}_{path.stem}", path
                assert OmegaConf.to_container(node) == OmegaConf.to_container(written), path
                described(OmegaConf.get_type(node), group)  # type: ignore[arg-type]
    # A string setting stays open: `node_rank: auto` also takes a rank, kept a number.
    assert compose(["extract=sglang", "extract.node_rank=0"]).extract.node_rank == 0
    # Workers get configs pickled (Ray, submitit): a schema's node must travel.
    cfg = pickle.loads(pickle.dumps(compose(["budget.usd=3"])))
    assert cfg.budget.usd == 3.0 and OmegaConf.get_type(cfg.budget) is SCHEMAS["budget"]


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("budget.usd=abc", "budget.usd='abc': expected a number"),
        ("budget.max_samples=1.5", "budget.max_samples=1.5: expected a whole number"),
        ("budget.slow_start=maybe", "budget.slow_start='maybe': expected true or false"),
        ("audit.examples=many", "audit.examples='many': expected a whole number"),
        ("budget.udss=5", "budget.udss=5: no such setting; did you mean budget.usd?"),
        ("report.rank_stp=0.1", "did you mean report.rank_step?"),
        ("sweep.n=many", "sweep.n='many': expected a whole number"),
        ("sweep.probes=maybe", "sweep.probes='maybe': expected true or false"),
        # The config's own keys, validation, serving_auto, export and dataset options.
        ("seed=1.5", "seed=1.5: expected a whole number"),
        ("max_length=some", "max_length='some': expected a whole number"),
        ("validation.billing_tolerance=x", "validation.billing_tolerance='x': expected a whole"),
        ("serving_auto.cache_days=x", "serving_auto.cache_days='x': expected a number"),
        ("export.workers=many", "export.workers='many': expected a whole number"),
        ("export.push_to_hub.private=no?", "export.push_to_hub.private='no?': expected true or"),
        ("export.compres=true", "did you mean export.compress?"),
        ("dataset.limit=some", "dataset.limit='some': expected a whole number"),
        ("dataset=B5", None),
        ("dataset=B5 dataset.limit=4", "dataset.limit=4: no such setting"),  # jsonl's key
        ("export=dflash export.max_length=4", "export.max_length=4: no such setting"),
        # Groups whose schema mirrors each option's yaml.
        ("extract.max_len=abc", "extract.max_len='abc': expected a whole number"),
        ("extract=sglang extract.tp_size=two", "extract.tp_size='two': expected a whole number"),
        ("resolve.min_posterior=high", "resolve.min_posterior='high': expected a number"),
        ("provider.logprobs=maybe", "provider.logprobs='maybe': expected true or false"),
        ("provider.retry.max_attempts=x", "provider.retry.max_attempts='x': expected a whole"),
        ("provider=local provider.server.threads=x", "server.threads='x': expected a whole"),
        ("+provider.params.user=x +dataset.data_files=x +extract.note=x +extra.note=x", None),
        # serving's schema is ServingProfile: its fields no option writes compose too.
        ("serving=vllm_0_33 serving.history=template serving.think_open=output", None),
        ("serving.histroy=template", "did you mean serving.history?"),
        ("provider.params.temperature=0.5 extract.max_len=null seed=3", None),
    ],
)
def test_a_schema_refuses_a_wrong_type_or_key_at_compose(override: str, said: str | None) -> None:
    """Refused while composing, before any stage reads the value: one ConfigError line."""
    from kimi_pipe.errors import ConfigError
    from kimi_pipe.stages.command import compose_overrides

    if said is None:  # composes: a key of the user's own (+key), a value of the right kind
        compose_overrides(override.split())
        return
    with pytest.raises(ConfigError) as refused:
        compose_overrides(override.split())
    assert said in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("provider.params.max_tokens=1.5", "provider.params.max_tokens=1.5: expected a whole"),
        ("provider.params.temperature=hot", "provider.params.temperature='hot': expected a"),
        ("provider.pricing.input_usd_per_mtok=x", "input_usd_per_mtok='x': expected a number"),
    ],
)
def test_the_providers_sampling_params_are_checked_where_they_are_read(
    override: str, said: str
) -> None:
    """provider.params stays open (sent as given, digested into the run directory's name):
    the values the budget reads are checked when the provider's settings are read."""
    from kimi_pipe.errors import ConfigError
    from kimi_pipe.providers.settings import ProviderSettings

    with pytest.raises(ConfigError, match="expected") as refused:
        ProviderSettings.from_config(compose([override]).provider)
    assert said in str(refused.value)


def test_the_sweep_schema_is_the_sweep_stage_settings() -> None:
    """The stage reads the schema's own fields (one definition), so they cannot drift."""
    import dataclasses

    from kimi_pipe.stages.schemas import SweepFields
    from kimi_pipe.stages.sweep import SweepSettings

    assert issubclass(SweepSettings, SweepFields)
    assert [f.name for f in dataclasses.fields(SweepSettings)] == [
        f.name for f in dataclasses.fields(SweepFields)
    ]


def test_the_hub_schema_is_the_hub_settings_and_loads_no_torch() -> None:
    """The command layer's copy of HubSettings' fields (names, types, defaults) equals them,
    and composing through it imports no torch (a bare install's reconstruct has none)."""
    import dataclasses
    import typing

    from kimi_pipe.exporters.hub import HubSettings
    from kimi_pipe.stages.schemas import HubFields

    def shape(cls: type) -> list[tuple[str, object, object]]:
        hints = typing.get_type_hints(cls)
        return [(f.name, hints[f.name], f.default) for f in dataclasses.fields(cls)]

    assert shape(HubFields) == shape(HubSettings)
    code = (
        "import sys; import kimi_pipe.stages.command, kimi_pipe.stages.reconstruct; "
        "print('torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False", done.stdout


def test_help_reads_a_described_setting_from_its_schema() -> None:
    """One source: a setting --help names from a group with a schema has the schema's line."""
    from kimi_pipe.stages.schemas import HELP as DESCRIBED

    shown = 0
    for stage in HELP.values():
        for key, about in stage.settings:
            node, _, name = key.rpartition(".")  # "": the config's own keys
            if name in DESCRIBED.get(node, {}):
                assert about == DESCRIBED[node][name], key
                shown += 1
    assert shown >= 30


def test_a_list_setting_still_takes_one_slug_or_a_comma_list() -> None:
    """`probe.providers=a` and `report.ignore_quantizations=fp4` stay accepted (the stage's
    typed read makes the list), as before the schemas."""
    from kimi_pipe.stages.command import compose_overrides

    cfg = compose_overrides(["probe.providers=moonshotai", "report.ignore_quantizations=fp4"])
    assert cfg.probe.providers == "moonshotai" and cfg.report.ignore_quantizations == "fp4"


def test_cfg_prints_the_composed_config_and_other_hydra_flags_are_one_line(
    tmp_path: Path,
) -> None:
    """`--cfg job` (named in every --help) prints the config the job would get, with the
    overrides applied, and runs nothing; a Hydra flag the command does not take is one
    line, exit 2, not a run."""
    done = kimi_pipe("export", "seed=7", "--cfg", "job", cwd=tmp_path, key=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "\nseed: 7\n" in done.stdout and "hydra:" not in done.stdout
    assert not any(tmp_path.iterdir())
    line = one_error(kimi_pipe("export", "--info", cwd=tmp_path, key=False))
    assert "--info: not a flag of this command" in line
    line = one_error(kimi_pipe("export", "--cfg", cwd=tmp_path, key=False))
    assert "give --cfg job, --cfg hydra or --cfg all" in line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "logging_choice", ["hydra/job_logging=stdout", "hydra/job_logging=disabled"]
)
def test_hydras_other_job_logging_choices_still_run_a_job(
    logging_choice: str, tmp_path: Path
) -> None:
    """conf/ picks its own job logging (hydra/job_logging=guarded: the log file's refused
    writes said in one line); Hydra's other choices still configure a job's logging."""
    done = kimi_pipe("export", "stores=[]", "output_dir=runs/a", logging_choice, cwd=tmp_path)
    assert "pass output=DIR" in one_error(done)
    assert not (tmp_path / "runs").exists()


def test_a_multirun_given_output_dir_is_refused_before_any_job_starts(tmp_path: Path) -> None:
    """Every job of a multirun writes to its own hydra.sweep.dir/subdir: output_dir is refused
    before the launch, so no job's directory is made."""
    done = kimi_pipe("generate", "-m", "output_dir=x", f"dataset.path={prompts(tmp_path)}",
                     "provider.routing.only=[a],[b]", cwd=tmp_path)  # fmt: skip
    assert "output_dir with --multirun" in one_error(done)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]
