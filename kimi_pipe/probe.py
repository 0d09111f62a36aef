"""`python -m kimi_pipe.probe`: the probe stage, kimi_pipe/stages/probe.py."""

import sys

from kimi_pipe.stages.probe import main

if __name__ == "__main__":
    sys.exit(main())
