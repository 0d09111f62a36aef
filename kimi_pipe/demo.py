"""`python -m kimi_pipe.demo`: the demo stage, kimi_pipe/pipeline/demo.py."""

import sys

from kimi_pipe.pipeline.demo import main

if __name__ == "__main__":
    sys.exit(main())
