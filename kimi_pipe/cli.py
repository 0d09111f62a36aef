"""The `kimi-pipe` console command: `kimi-pipe <stage> [hydra overrides | stage options]`.

Each stage is its module's `main()`, run exactly as `python -m kimi_pipe.<stage>` runs it
(the stage reads its arguments from sys.argv). Stage modules are imported only when asked
for, so a light install (`pip install kimi_pipe`) runs `reconstruct` without torch or
LiteLLM, and a stage whose dependencies are missing says which extra brings them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    module: str
    extra: str  # the pip extra that brings the stage's dependencies ("" = the base install)
    summary: str
    # Top-level modules the stage imports, checked before it runs: Hydra stages import
    # lazily inside @hydra.main, where a missing package is only a logged traceback.
    needs: tuple[str, ...] = ()


_GENERATE = ("litellm", "httpx", "datasets", "numpy")
_EXTRACT = ("torch", "transformers", "safetensors", "accelerate", "datasets", "numpy")
_REPORT = ("matplotlib", "jsonschema")

STAGES: dict[str, Stage] = {
    "generate": Stage(
        "kimi_pipe.stages.generate", "generate", "buy answers from a provider", _GENERATE
    ),
    "reconstruct": Stage(
        "kimi_pipe.stages.reconstruct", "", "provider answers -> exact token ids (the contract)"
    ),
    "audit": Stage("kimi_pipe.stages.audit", "extract", "audit reconstructed records", _EXTRACT),
    "extract": Stage(
        "kimi_pipe.stages.extract", "extract", "hidden states from the target", _EXTRACT
    ),
    "export": Stage("kimi_pipe.stages.export", "extract", "EAGLE-3 training data", _EXTRACT),
    "sweep": Stage(
        "kimi_pipe.stages.sweep", "generate,report", "compare providers", _GENERATE + _REPORT
    ),
    "report": Stage("kimi_pipe.stages.report", "report", "report over finished runs", _REPORT),
    "probe": Stage(
        "kimi_pipe.stages.probe", "generate", "conformance probes per provider", _GENERATE
    ),
    "demo": Stage(
        "kimi_pipe.pipeline.demo",
        "all",
        "the whole pipeline offline on SmolLM2",
        _GENERATE + _EXTRACT + _REPORT,
    ),
    # The generic runner (`kimi-pipe run pipeline=demo`); its module is imported by name.
    "run": Stage("kimi_pipe.run", "all", "run a pipeline config end to end"),
}

EXIT_USAGE = 2


def usage() -> str:
    width = max(len(name) for name in STAGES)
    lines = [
        "usage: kimi-pipe <stage> [overrides ...]",
        "",
        "stages (each as `python -m kimi_pipe.<stage>`; its own --help or Hydra overrides):",
    ]
    lines += [f"  {name:<{width}}  {stage.summary}" for name, stage in STAGES.items()]
    lines += ["", "example: kimi-pipe reconstruct model=kimi_k25 input=IN.jsonl output=OUT.jsonl"]
    return "\n".join(lines)


def missing_modules(stage: Stage) -> list[str]:
    return [module for module in stage.needs if importlib.util.find_spec(module) is None]


def _missing_dependency(name: str, stage: Stage, missing: str) -> int:
    if missing.split(".")[0] == "kimi_pipe":
        print(
            f"error: stage {name!r} is not in this kimi_pipe version ({missing} is missing)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    missing = missing.split(".")[0]
    extra = stage.extra or "all"
    print(
        f"error: kimi-pipe {name} needs the Python package {missing!r}, which this install "
        f"lacks. Install the stage's extra: pip install 'kimi_pipe[{extra}]' "
        "(in a checkout, `make setup` installs everything).",
        file=sys.stderr,
    )
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else EXIT_USAGE
    name, rest = args[0], args[1:]
    stage = STAGES.get(name)
    if stage is None:
        print(f"error: unknown stage {name!r}\n\n{usage()}", file=sys.stderr)
        return EXIT_USAGE
    absent = missing_modules(stage)
    if absent:
        return _missing_dependency(name, stage, absent[0])
    try:
        module = importlib.import_module(stage.module)
    except ModuleNotFoundError as exc:
        return _missing_dependency(name, stage, exc.name or str(exc))
    # Stages read sys.argv themselves (Hydra's @hydra.main does), as under `python -m`.
    saved_argv, sys.argv = sys.argv, [f"kimi-pipe {name}", *rest]
    try:
        status = module.main()
    except ModuleNotFoundError as exc:  # a stage importing an optional dependency lazily
        if (exc.name or "").split(".")[0] == "kimi_pipe":
            raise
        return _missing_dependency(name, stage, exc.name or str(exc))
    finally:
        sys.argv = saved_argv
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
