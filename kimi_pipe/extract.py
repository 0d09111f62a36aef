"""`python -m kimi_pipe.extract`: the extract stage, kimi_pipe/stages/extract.py."""

import sys

from kimi_pipe.stages.extract import main

if __name__ == "__main__":
    sys.exit(main())
