"""Installing outside a checkout: the `kimi-pipe` command, configs inside the wheel, locks.

The full user install (fresh venv, Python 3.12, dependencies from the index) is
tools/check_install.py, which .ci/run runs after the suite; these tests are its fast,
offline parts.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

from kimi_pipe import cli, config

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"


def _pins(lock_text: str) -> dict[str, list[str]]:
    """{normalised name: [versions]} of a requirements lock (a name forks by marker)."""
    pins: dict[str, list[str]] = {}
    for match in re.finditer(
        r"(?m)^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)", lock_text
    ):
        name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
        pins.setdefault(name, []).append(match.group(2))
    return pins


# --- the console command -------------------------------------------------------------


def test_every_stage_dispatches_to_a_module_with_main() -> None:
    for name, stage in cli.STAGES.items():
        module = importlib.import_module(stage.module)
        assert callable(module.main), name
        # No alias module beside it: `python -m kimi_pipe <stage>` is the one spelling (issue 32).
        assert not (REPO / "kimi_pipe" / f"{name}.py").exists(), name


def test_reconstruct_through_the_command_matches_the_stage(tmp_path: Path) -> None:
    """`python -m kimi_pipe reconstruct` from another directory: the same bytes as the stage
    module run directly."""
    source = FIXTURES / "qwen3_5_responses.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    outputs = []
    for command in (["kimi_pipe", "reconstruct"], ["kimi_pipe.stages.reconstruct"]):
        target = tmp_path / f"{len(command)}.jsonl"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                *command,
                "model=qwen3_5",
                f"input={source}",
                f"output={target}",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        outputs.append(target.read_bytes())
    assert outputs[0] == outputs[1]
    records = [json.loads(line) for line in outputs[0].splitlines()]
    assert len(records) > 3 and any(r["ok"] for r in records)


def test_unknown_stage_and_no_stage_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["reconstruc"]) == 2
    assert "unknown stage 'reconstruc'" in capsys.readouterr().err
    assert cli.main([]) == 2
    assert "usage: kimi-pipe <stage>" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.STAGES)


def test_a_stage_without_its_extra_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_find_spec = importlib.util.find_spec

    def without_litellm(name: str, *args: Any) -> Any:
        return None if name == "litellm" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_litellm)
    argv = list(sys.argv)
    assert cli.main(["generate", "dataset=B5"]) == 2
    err = capsys.readouterr().err
    assert "'litellm'" in err and "pip install 'kimi_pipe[generate]'" in err
    assert sys.argv == argv


def test_a_missing_stage_module_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(cli.STAGES, "later", cli.Stage("kimi_pipe.no_such_stage", "", "x"))
    assert cli.main(["later"]) == 2
    assert "not in this kimi_pipe version" in capsys.readouterr().err


def test_console_script_is_declared() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["scripts"] == {"kimi-pipe": "kimi_pipe.cli:main"}
    assert project["requires-python"] == ">=3.11,<3.14"


# --- configs: the checkout's, or the wheel's copy ------------------------------------


def test_packaged_configs_win_over_a_stray_folder_beside_the_package(tmp_path: Path) -> None:
    package = tmp_path / "site-packages" / "kimi_pipe"
    (package / "conf").mkdir(parents=True)
    (tmp_path / "site-packages" / "conf").mkdir()  # some other distribution's folder
    assert config.bundled_dir("conf", package) == package / "conf"
    shutil.rmtree(package / "conf")
    assert config.bundled_dir("conf", package) == tmp_path / "site-packages" / "conf"


def test_checkout_reads_its_root_configs() -> None:
    assert config.CONF_DIR == REPO / "conf"
    assert config.DATA_DIR == REPO / "data"
    assert (config.require_conf_dir() / "config.yaml").is_file()


def test_wheel_carries_configs_data_and_the_command(tmp_path: Path) -> None:
    """Build the wheel from a copy of the sources (no build/ in the checkout)."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("kimi_pipe", "conf", "data"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(REPO / name, source / name)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("kimi_pipe-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "kimi-pipe = kimi_pipe.cli:main" in archive.read(entry_points).decode()
        metadata = archive.read(next(n for n in names if n.endswith("/METADATA"))).decode()
    configs = {p.relative_to(REPO).as_posix() for p in (REPO / "conf").rglob("*.yaml")}
    assert configs and {f"kimi_pipe/{c}" for c in configs} <= names
    assert "kimi_pipe/data/demo_prompts.jsonl" in names
    assert not any(n.startswith(("tests/", "conf/", "scripts/")) for n in names)
    assert "Requires-Python: <3.14,>=3.11" in metadata
    # The light install: the reconstruct contract needs neither torch nor LiteLLM.
    base = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert not [
        line for line in base if "extra ==" not in line and ("torch" in line or "litellm" in line)
    ]


# --- locks ------------------------------------------------------------------------------


def test_torch_comes_from_its_cpu_index_and_only_from_the_torch_lock() -> None:
    lock = (REPO / "requirements.lock").read_text(encoding="utf-8")
    torch_lock = TORCH_LOCK
    wanted = re.search(r"(?m)^torch==(\S+)", (REPO / "requirements.in").read_text()).group(1)
    assert "torch" not in _pins(lock)
    assert re.search(r"(?m)^--extra-index-url https://download\.pytorch\.org/whl/cpu$", torch_lock)
    assert _pins(torch_lock) == {"torch": [wanted]}
    assert len(re.findall(r"--hash=sha256:[0-9a-f]{64}", torch_lock)) >= 3  # cp311..cp313
    # Its dependencies are locked (resolved with torch, emitted without it).
    assert {"sympy", "networkx", "filelock", "fsspec"} <= set(_pins(lock))


def test_the_cuda_lock_agrees_with_the_main_lock() -> None:
    main = _pins((REPO / "requirements.lock").read_text(encoding="utf-8"))
    cuda = _pins((REPO / "requirements-torch-cuda.lock").read_text(encoding="utf-8"))
    assert "torch" in cuda and not any("+" in v for v in cuda["torch"])
    shared = set(main) & set(cuda)
    assert shared and all(main[name] == cuda[name] for name in shared), shared


def test_pyproject_pins_equal_the_lock() -> None:
    """pip users (the wheel) and `make setup` (the lock) get the same direct versions."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    lock = _pins((REPO / "requirements.lock").read_text(encoding="utf-8"))
    requirements = list(project["dependencies"])
    for extra, items in project["optional-dependencies"].items():
        if extra != "sglang":  # its own environment (docs/sglang.md)
            requirements += items
    checked = 0
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==(\S+)", requirement)
        if match is None:
            continue  # a range (torch, transformers) or this package's own extras
        name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
        assert lock.get(name) == [match.group(2)], (name, lock.get(name), match.group(2))
        checked += 1
    assert checked > 15


def test_lock_covers_python_3_11_to_3_13() -> None:
    lock = (REPO / "requirements.lock").read_text(encoding="utf-8")
    # Universal: where a package dropped 3.11, the lock forks by Python version.
    assert re.search(r"(?m)^\S+==\S+ ; python_full_version >= '3\.12'", lock)
    assert re.search(r"(?m)^\S+==\S+ ; python_full_version < '3\.12'", lock)


TORCH_LOCK = (REPO / "requirements-torch-cpu.lock").read_text(encoding="utf-8")


def _local_torch_wheels() -> list[Path]:
    """This machine's copies of the locked torch file (pip's find-links folders)."""
    version = _pins(TORCH_LOCK)["torch"][0]
    folders = os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split()
    return [w for folder in folders for w in Path(folder).glob(f"torch-{version}-*.whl")]


@pytest.mark.skipif(not _local_torch_wheels(), reason="no local copy of the torch wheel here")
def test_the_local_torch_wheel_is_the_published_one() -> None:
    """On machines with a local wheel folder, its torch file must be byte-identical to the
    one PyTorch's index publishes: its sha256 is one the torch lock accepts."""
    accepted = set(re.findall(r"--hash=sha256:([0-9a-f]{64})", TORCH_LOCK))
    for wheel in _local_torch_wheels():
        digest = hashlib.sha256()
        with wheel.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        assert digest.hexdigest() in accepted, wheel
