"""`python -m kimi_pipe <stage> ...`: the `kimi-pipe` command (kimi_pipe/cli.py)."""

import sys

from kimi_pipe.cli import main

if __name__ == "__main__":
    sys.exit(main())
