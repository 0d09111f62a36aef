"""Install kimi_pipe like a user and check the reconstruct contract, id for id.

    python -m tools.check_install [--python python3.12] [--wheel-dir dist]
        [--cases tests/fixtures/kimi_k25_responses.jsonl] [--tokenizer-dir DIR] [--keep]

1. takes the built wheel (`make wheel`) and installs it with pip into a fresh virtual
   environment in a temporary folder outside the checkout, with the given Python (the
   light install: no extras). pip resolves the dependencies from its configured indexes;
   their versions are held to requirements.lock by a constraints file made from it;
2. from another empty folder, with no PYTHONPATH, runs `kimi-pipe reconstruct` (and
   `python -m kimi_pipe reconstruct`) on the cases and checks that the installed package,
   not the checkout, ran, with the configs from inside the wheel;
3. compares every record with the checkout's own reconstruction of the same line, and the
   output ids and issue codes with the suite's expectations (`expect` in the cases,
   tests/conftest.py's `expected_output_ids`) where a case carries them;
4. checks that a stage whose extra is not installed says which extra to install.

Exit 0 when everything matches; 1 with the differences otherwise; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CASES = REPO / "tests" / "fixtures" / "kimi_k25_responses.jsonl"
RECORD_KEYS = ("id", "messages", "tools", "response")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python", default="3.12", help="the fresh venv's Python: a version (3.12) or a path"
    )
    parser.add_argument("--wheel-dir", type=Path, default=REPO / "dist")
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    parser.add_argument("--model", default="kimi_k25")
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        default=Path(
            os.environ.get("KIMI_TOKENIZER_DIR")
            or REPO.parent / "shared" / "tokenizers" / "kimi-k2.5"
        ),
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    return parser.parse_args(argv)


def find_python(wanted: str) -> str | None:
    """An interpreter that runs: a path, `pythonX.Y` on PATH, or a pyenv-installed X.Y
    (pyenv's shim for a version that is installed but not selected fails when run)."""
    if "/" in wanted:
        candidates = [wanted]
    else:
        name = wanted if wanted.startswith("python") else f"python{wanted}"
        version = name.removeprefix("python")
        root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
        candidates = [name, *sorted(map(str, root.glob(f"versions/{version}.*/bin/{name}")))]
    for candidate in candidates:
        try:
            done = subprocess.run(
                [candidate, "-c", "import sys; print(sys.version)"],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except OSError:
            continue
        if done.returncode == 0:
            return candidate
    return None


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    except FileNotFoundError as exc:  # e.g. a wheel without the console command
        return subprocess.CompletedProcess(cmd, 127, "", f"{exc}\n")


def must(done: subprocess.CompletedProcess[str], what: str) -> None:
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"FAIL  {what} (exit {done.returncode})")


def lock_constraints(target: Path) -> Path:
    """requirements.lock without hashes: pip constraints that hold versions to the lock."""
    lines = []
    for line in (REPO / "requirements.lock").read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "--")):
            continue
        lines.append(stripped.rstrip("\\").strip())
    target.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return target


def user_env() -> dict[str, str]:
    """The caller's environment without anything that would import the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


# The suite's expectations are for a stack that keeps the reasoning's tail and the tool-call
# arguments' edges (the default `unknown` profile flags most of them: tests/conftest.py's
# TAIL_KEPT): both sides use these.
SERVING = ("serving.reasoning_tail=kept", "serving.argument_edges=kept")


def checkout_records(cases: list[dict[str, Any]], model_name: str, tokenizer_dir: Path) -> Any:
    """The checkout's own records for the same lines, and its loaded model."""
    from kimi_pipe.config import compose
    from kimi_pipe.core.models import load_model
    from kimi_pipe.core.serving import serving_profile
    from kimi_pipe.stages.reconstruct import reconstruct_line

    cfg = compose([f"model={model_name}", f"model.tokenizer.path={tokenizer_dir}", *SERVING])
    serving = serving_profile(cfg)
    model = load_model(cfg.model)
    tolerance = int(cfg.validation.billing_tolerance)
    records = [
        reconstruct_line(model, json.dumps(_record_input(case)), n, tolerance, serving=serving)
        for n, case in enumerate(cases, 1)
    ]
    return model, records


def _record_input(case: dict[str, Any]) -> dict[str, Any]:
    return {k: case[k] for k in RECORD_KEYS if k in case}


def suite_expectations(model: Any, case: dict[str, Any]) -> tuple[list[int], list[str]] | None:
    if "expect" not in case:
        return None
    from tests.support.cases import (
        expected_output_ids,  # the suite's own definition of the true ids
    )

    return expected_output_ids(model, case), sorted(case["expect"]["issues"])


def compare(
    cases: list[dict[str, Any]], got: list[dict[str, Any]], model: Any, want: list[Any]
) -> list[str]:
    problems: list[str] = []
    if len(got) != len(cases):
        return [f"{len(got)} records for {len(cases)} cases"]
    for case, record, reference in zip(cases, got, want, strict=True):
        if record != reference:
            fields = [k for k in reference if record.get(k) != reference[k]]
            problems.append(f"{case.get('id')}: differs from the checkout in {fields}")
        expected = suite_expectations(model, case)
        if expected is not None:
            ids, issues = expected
            if record["output_ids"] != ids:
                problems.append(f"{case.get('id')}: output_ids differ from the suite's")
            if sorted(record["issues"]) != issues:
                problems.append(f"{case.get('id')}: issues {record['issues']} != {issues}")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    wheels = sorted(args.wheel_dir.glob("kimi_pipe-*.whl"))
    if len(wheels) != 1:
        print(
            f"error: want one kimi_pipe wheel in {args.wheel_dir} (make wheel), found "
            f"{[w.name for w in wheels]}",
            file=sys.stderr,
        )
        return 2
    python = find_python(args.python)
    if python is None:
        print(
            f"error: no working Python {args.python} (PATH, pyenv); give --python PATH",
            file=sys.stderr,
        )
        return 2
    args.python = python
    if not args.tokenizer_dir.is_dir():
        print(
            f"error: tokenizer folder {args.tokenizer_dir} not found "
            "(--tokenizer-dir or KIMI_TOKENIZER_DIR)",
            file=sys.stderr,
        )
        return 2
    args.tokenizer_dir = args.tokenizer_dir.resolve()  # used from other folders
    cases = read_jsonl(args.cases)
    work = Path(tempfile.mkdtemp(prefix="kimi-pipe-install-"))
    try:
        return check(args, wheels[0].resolve(), cases, work)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def check(args: argparse.Namespace, wheel: Path, cases: list[dict[str, Any]], work: Path) -> int:
    env = user_env()
    venv, elsewhere = work / "venv", work / "elsewhere"
    elsewhere.mkdir()
    must(run([args.python, "-m", "venv", str(venv)], work, env), "venv")
    bin_dir = venv / "bin"
    constraints = lock_constraints(work / "constraints.txt")
    must(
        run(
            [
                str(bin_dir / "python"),
                "-m",
                "pip",
                "install",
                "--quiet",
                "-c",
                str(constraints),
                str(wheel),
            ],
            work,
            env,
        ),
        f"pip install {wheel.name}",
    )
    version = run([str(bin_dir / "python"), "--version"], elsewhere, env).stdout.strip()
    where = run(
        [
            str(bin_dir / "python"),
            "-c",
            "import kimi_pipe, kimi_pipe.config as c; print(kimi_pipe.__file__); print(c.CONF_DIR)",
        ],
        elsewhere,
        env,
    )
    must(where, "import kimi_pipe")
    package_file, conf_dir = where.stdout.split()
    problems: list[str] = []
    for path in (package_file, conf_dir):
        if not Path(path).is_relative_to(venv):
            problems.append(f"{path} is not inside the installed venv")

    source = elsewhere / "in.jsonl"
    source.write_text(
        "".join(json.dumps(_record_input(case)) + "\n" for case in cases), encoding="utf-8"
    )
    overrides = [
        f"model={args.model}",
        f"model.tokenizer.path={args.tokenizer_dir}",
        "input=in.jsonl",
        *SERVING,
    ]
    outputs = {
        "kimi-pipe reconstruct": [str(bin_dir / "kimi-pipe"), "reconstruct"],
        "python -m kimi_pipe reconstruct": [
            str(bin_dir / "python"),
            "-m",
            "kimi_pipe",
            "reconstruct",
        ],
    }
    model, reference = checkout_records(cases, args.model, args.tokenizer_dir)
    for label, command in outputs.items():
        target = elsewhere / f"out-{len(label)}.jsonl"
        must(run([*command, *overrides, f"output={target.name}"], elsewhere, env), label)
        found = compare(cases, read_jsonl(target), model, reference)
        problems += [f"{label}: {p}" for p in found]
        print(f"{label}: {len(cases)} records, {len(found)} differences", file=sys.stderr)

    # The light install has no LiteLLM: the stage must say which extra brings it.
    light = run([str(bin_dir / "kimi-pipe"), "generate", "dataset=B5"], elsewhere, env)
    if light.returncode != 2 or "kimi_pipe[generate]" not in light.stderr:
        problems.append(
            f"kimi-pipe generate without its extra: exit {light.returncode}, "
            f"stderr {light.stderr[-300:]!r}"
        )

    for problem in problems:
        print(f"FAIL  {problem}", file=sys.stderr)
    if problems:
        return 1
    print(
        f"OK    {wheel.name} installed with {version} outside the checkout; "
        f"kimi-pipe reconstruct reproduced {len(cases)} cases id for id",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
