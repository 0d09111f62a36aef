"""`python -m kimi_pipe.reconstruct`: the reconstruct stage, kimi_pipe/stages/reconstruct.py."""

import sys

from kimi_pipe.stages.reconstruct import main

if __name__ == "__main__":
    sys.exit(main())
