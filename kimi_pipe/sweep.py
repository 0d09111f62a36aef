"""`python -m kimi_pipe.sweep`: the sweep stage, kimi_pipe/stages/sweep.py."""

import sys

from kimi_pipe.stages.sweep import main

if __name__ == "__main__":
    sys.exit(main())
