"""`python -m kimi_pipe <stage> ...`: the `kimi-pipe` command (kimi_pipe/cli.py)."""

from kimi_pipe.errors import dependencies_installed

with dependencies_installed():  # a Python without them: one line and exit 2, no traceback
    from kimi_pipe.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
