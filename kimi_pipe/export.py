"""`python -m kimi_pipe.export`: the export stage, kimi_pipe/stages/export.py."""

import sys

from kimi_pipe.stages.export import main

if __name__ == "__main__":
    sys.exit(main())
