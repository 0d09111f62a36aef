"""`python -m kimi_pipe <stage> ...`: the `kimi-pipe` command (kimi_pipe/cli.py)."""

import sys

try:
    from kimi_pipe.cli import main
except ModuleNotFoundError as exc:  # a Python without the dependencies (not the .venv)
    if (exc.name or "").split(".")[0] == "kimi_pipe":
        raise
    print(
        f"error: {exc.name} is not installed in this Python ({sys.executable}): run "
        "`make setup`, then `.venv/bin/python -m kimi_pipe ...` (or `pip install` the wheel "
        "and run `kimi-pipe ...`; README, Install)",
        file=sys.stderr,
    )
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
