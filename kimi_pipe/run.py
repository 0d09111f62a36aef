"""`python -m kimi_pipe.run pipeline=NAME`: the generic runner, kimi_pipe/pipeline/runner.py."""

import sys

from kimi_pipe.pipeline.runner import main

if __name__ == "__main__":
    sys.exit(main())
