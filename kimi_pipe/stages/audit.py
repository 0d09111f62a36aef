r"""Stage `audit`: measured reconstruction fidelity against ids an engine really produced.

    python -m kimi_pipe audit model=smollm2 audit.run_dir=runs/demo/local
    python -m kimi_pipe audit model=M audit.records=R.jsonl audit.truth=replies \
        audit.replies=engine_replies.jsonl

For every token record, the ids the engine produced ("truth") are set beside the
reconstructed ids. Equal: exact. Different: the first difference is located and the
mismatch classified (`MISMATCH_CLASSES`). Where truth comes from (`audit.truth`):

* `hf_greedy`   greedy generation in-process with transformers and the same weights the
                engine served (the demo: `transformers serve` asked for temperature 0).
* `replies`     a JSONL of engine replies, `{"id", "reply"}` or the reply itself with an
                `id`: SGLang `/generate` (`output_ids` at the top level) or an
                OpenAI-compatible answer with `return_token_ids` (vLLM/SGLang:
                `choices[0].token_ids`, `prompt_token_ids`).
* `response`    the record's own `response`, when the provider was such an engine.

Outputs (next to the records unless `audit.output_dir`): `audit_truth.jsonl` (truth ids,
appended as they are made: a crash loses nothing, a rerun reuses them), `audit.json`
(summary and one row per sample) and `audit.md` (a short table).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.errors import MissingFile
from kimi_pipe.reporting.audit import run_audit
from kimi_pipe.stages.command import compose_command
from kimi_pipe.stages.help import HELP
from kimi_pipe.stages.jobs.audit import audit_job


def run_stage(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """The stage entry: audit the run's records (`audit.run_dir` = run_dir when given)."""
    # Same CPU thread count as the server: the greedy runs must see the same arithmetic.
    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    return run_audit(audit_job(values, run_dir, server_threads=True))


def main(argv: Sequence[str] | None = None) -> int:

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    def audit_stage(cfg: DictConfig) -> int:
        values = cast(
            dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        )
        try:
            summary = run_audit(audit_job(values))
        except FileNotFoundError as exc:  # a records file named by the user
            raise MissingFile(str(exc)) from None
        print(Path(summary["audit_md"]).read_text(encoding="utf-8"))
        print(f"audit: {summary['audit_json']}", file=sys.stderr)
        return 0

    return compose_command(audit_stage, argv, help=HELP["audit"])


if __name__ == "__main__":
    sys.exit(main())
