"""`python -m kimi_pipe.audit`: the audit stage, kimi_pipe/stages/audit.py."""

import sys

from kimi_pipe.stages.audit import main

if __name__ == "__main__":
    sys.exit(main())
