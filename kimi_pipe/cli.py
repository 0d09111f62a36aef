"""The `kimi-pipe` console command: `kimi-pipe <stage> [hydra overrides | stage options]`.

Each stage is its module's `main()`, run exactly as `python -m kimi_pipe.<stage>` runs it
(the stage reads its arguments from sys.argv). Stage modules are imported only when asked
for, so a light install (`pip install kimi_pipe`) runs `reconstruct` without torch or
LiteLLM, and a stage whose dependencies are missing says which extra brings them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    module: str
    extra: str  # the pip extra that brings the stage's dependencies ("" = the base install)
    summary: str


STAGES: dict[str, Stage] = {
    "generate": Stage("kimi_pipe.stages.generate", "generate", "buy answers from a provider"),
    "reconstruct": Stage(
        "kimi_pipe.stages.reconstruct", "", "provider answers -> exact token ids (the contract)"
    ),
    "audit": Stage("kimi_pipe.stages.audit", "extract", "audit reconstructed records"),
    "extract": Stage("kimi_pipe.stages.extract", "extract", "hidden states from the target"),
    "export": Stage("kimi_pipe.stages.export", "extract", "EAGLE-3 training data"),
    "sweep": Stage("kimi_pipe.stages.sweep", "generate,report", "compare providers"),
    "report": Stage("kimi_pipe.stages.report", "report", "report over finished runs"),
    "demo": Stage("kimi_pipe.stages.demo", "all", "the whole pipeline offline on SmolLM2"),
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


def _missing_dependency(name: str, stage: Stage, exc: ModuleNotFoundError) -> int:
    missing = (exc.name or "").split(".")[0]
    if missing == "kimi_pipe" or (exc.name or "").startswith(f"{stage.module}"):
        print(
            f"error: stage {name!r} is not in this kimi_pipe version ({exc.name} is missing)",
            file=sys.stderr,
        )
        return EXIT_USAGE
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
    try:
        module = importlib.import_module(stage.module)
    except ModuleNotFoundError as exc:
        return _missing_dependency(name, stage, exc)
    # Stages read sys.argv themselves (Hydra's @hydra.main does), as under `python -m`.
    sys.argv = [f"kimi-pipe {name}", *rest]
    try:
        status = module.main()
    except ModuleNotFoundError as exc:  # a stage importing an optional dependency lazily
        if (exc.name or "").split(".")[0] == "kimi_pipe":
            raise
        return _missing_dependency(name, stage, exc)
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
