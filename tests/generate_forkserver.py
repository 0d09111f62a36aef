"""A fork server for kill loops: pays the seconds of imports (LiteLLM, tokenizers) once,
then forks one real `generate` process per command, which a test can `kill -9`.

Each child runs the same code path as `python -m kimi_pipe generate` after Hydra has
composed the config (`generate(compose(overrides), out)`), in its own process: a kill is a
real kill (open files, sockets and requests in flight die with it).

Protocol on stdin/stdout, one line each:
    run <json: {"overrides": [...], "out": DIR, "log": FILE}>  ->  pid <PID>
    wait <PID>                                    ->  status <exit status or -signal>
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kimi_pipe.config import compose
    from kimi_pipe.providers.calls import get_litellm
    from kimi_pipe.stages.generate import generate

    get_litellm()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "run":
            job = json.loads(arg)
            pid = os.fork()
            if pid == 0:  # the child: one generate run, then exit without cleanup
                log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                try:
                    status, _ = generate(compose(job["overrides"]), Path(job["out"]))
                except BaseException:  # noqa: BLE001 - any crash is a failed run
                    import traceback

                    traceback.print_exc()
                    status = 99
                os._exit(status)
            print(f"pid {pid}", flush=True)
        elif cmd == "wait":
            _, raw = os.waitpid(int(arg), 0)
            status = -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
            print(f"status {status}", flush=True)


if __name__ == "__main__":
    main()
