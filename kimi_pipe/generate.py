"""`python -m kimi_pipe.generate`: the generate stage, kimi_pipe/stages/generate.py."""

import sys

from kimi_pipe.stages.generate import main

if __name__ == "__main__":
    sys.exit(main())
