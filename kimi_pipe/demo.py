"""`python -m kimi_pipe.demo`: the demo stage, kimi_pipe/stages/demo.py."""

import sys

from kimi_pipe.stages.demo import main

if __name__ == "__main__":
    sys.exit(main())
