"""`python -m kimi_pipe.report`: the report stage, kimi_pipe/stages/report.py."""

import sys

from kimi_pipe.stages.report import main

if __name__ == "__main__":
    sys.exit(main())
