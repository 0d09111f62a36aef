"""The `kimi-pipe` console command: `kimi-pipe <stage> [hydra overrides | stage options]`.

Each stage is its module's `main(argv)`, given the arguments after the stage's name, as
`python -m kimi_pipe <stage>` runs it. Stage modules are imported only when asked
for, so a light install (`pip install kimi_pipe`) runs `reconstruct` without torch or
LiteLLM, and a stage whose dependencies are missing says which extra brings them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import sys
from collections.abc import Sequence

from kimi_pipe.errors import EXIT_USER_ERROR, ConfigError, one_line
from kimi_pipe.pipeline.registry import ENTRIES, StageEntry
from kimi_pipe.plugins import load_target

# The stage table is the registry's (kimi_pipe/pipeline/registry.py): one place for both.


def Stage(module: str, extra: str, summary: str, needs: tuple[str, ...] = ()) -> StageEntry:  # noqa: N802
    """A command entry by its module (what this table held before the registry)."""
    return StageEntry(module.rsplit(".", 1)[-1], module, summary, extra, needs)


STAGES: dict[str, StageEntry] = {name: e for name, e in ENTRIES.items() if e.command}


def usage() -> str:
    width = max(len(name) for name in STAGES)
    lines = [
        "usage: kimi-pipe <stage> [overrides ...]",
        "",
        "stages (each also as `python -m kimi_pipe <stage>`; its own --help or Hydra overrides):",
    ]
    lines += [f"  {name:<{width}}  {stage.summary}" for name, stage in STAGES.items()]
    lines += ["", "example: kimi-pipe reconstruct model=kimi_k25 input=IN.jsonl output=OUT.jsonl"]
    return "\n".join(lines)


def missing_modules(stage: StageEntry) -> list[str]:
    return [module for module in stage.needs if importlib.util.find_spec(module) is None]


def _missing_dependency(name: str, stage: StageEntry, missing: str) -> int:
    if missing.split(".")[0] == "kimi_pipe":
        print(
            f"error: stage {name!r} is not in this kimi_pipe version ({missing} is missing)",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    missing = missing.split(".")[0]
    extra = stage.extra or "all"
    print(
        f"error: kimi-pipe {name} needs the Python package {missing!r}, which this install "
        f"lacks. Install the stage's extra: pip install 'kimi_pipe[{extra}]' "
        "(in a checkout, `make setup` installs everything).",
        file=sys.stderr,
    )
    return EXIT_USER_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`--help | head`): stop quietly, as other commands do; what is
        # still buffered goes nowhere instead of into a second traceback at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _main(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else EXIT_USER_ERROR
    name, rest = args[0], args[1:]
    stage = STAGES.get(name)
    if stage is None:
        print(f"error: unknown stage {name!r}\n\n{usage()}", file=sys.stderr)
        return EXIT_USER_ERROR
    absent = missing_modules(stage)
    if absent:
        return _missing_dependency(name, stage, absent[0])
    try:
        module = load_target(stage.module, kind="stage")  # the one plug-in resolver
    except ModuleNotFoundError as exc:
        return _missing_dependency(name, stage, exc.name or str(exc))
    except ConfigError as exc:  # the entry names no module of this install
        print(f"error: stage {name!r} is not in this kimi_pipe version ({exc})", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        status = module.main(rest)
    except ModuleNotFoundError as exc:  # a stage importing an optional dependency lazily
        if (exc.name or "").split(".")[0] == "kimi_pipe":
            raise
        return _missing_dependency(name, stage, exc.name or str(exc))
    except Exception as exc:  # a stage that let a user-facing failure through
        message = one_line(exc)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
