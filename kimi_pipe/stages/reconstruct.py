"""Stage `reconstruct`: provider answers in, exact token records out.

    python -m kimi_pipe.reconstruct model=kimi_k25 model.tokenizer.path=DIR \
        input=IN.jsonl output=OUT.jsonl

Input lines: {"id", "messages", "tools"?, "response"}. Output lines, same order:
{"id", "ok", "issues", "prompt_ids", "output_ids", "loss_mask",
 "completion_tokens_reported", "completion_tokens_reconstructed"}.
Exit 0 once the file is processed (bad records are reported in their own line);
exit 2 with a message for a missing file, an unknown model or a bad tokenizer.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from kimi_pipe.core.models import Model, load_model
from kimi_pipe.core.reconstruction import reconstruct
from kimi_pipe.core.serving import ServingProfile, serving_profile


def reconstruct_line(
    model: Model, line: str, line_no: int, tolerance: int, serving: ServingProfile | None = None
) -> dict[str, Any]:
    """One input line to one output record; never raises on bad data."""
    try:
        sample = json.loads(line)
        if not isinstance(sample, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        return _bad_record(None, "malformed_record", f"line {line_no}: {exc}")
    sample_id = sample.get("id", f"line-{line_no}")
    messages = sample.get("messages")
    if not isinstance(messages, list):
        return _bad_record(sample_id, "bad_prompt", "messages must be a list")
    result = reconstruct(
        model,
        messages,
        sample.get("tools"),
        sample.get("response"),
        billing_tolerance=tolerance,
        serving=serving,
    )
    return {"id": sample_id, **result.to_record()}


def _bad_record(sample_id: Any, code: str, why: str) -> dict[str, Any]:
    print(f"warning: {why}", file=sys.stderr)
    return {
        "id": sample_id,
        "ok": False,
        "issues": [code],
        "prompt_ids": [],
        "output_ids": [],
        "loss_mask": [],
        "completion_tokens_reported": None,
        "completion_tokens_reconstructed": 0,
    }


def _lines(handle: TextIO) -> Iterator[tuple[int, str]]:
    for line_no, line in enumerate(handle, 1):
        if line.strip():
            yield line_no, line


def run(
    model: Model, source: Path, target: Path, tolerance: int, serving: ServingProfile | None = None
) -> Counter[str]:
    counts: Counter[str] = Counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".partial")
    with source.open(encoding="utf-8") as src, tmp.open("w", encoding="utf-8") as dst:
        for line_no, line in _lines(src):
            record = reconstruct_line(model, line, line_no, tolerance, serving)
            dst.write(json.dumps(record, ensure_ascii=False) + "\n")
            counts["records"] += 1
            counts["ok" if record["ok"] else "not_ok"] += 1
            counts.update(f"issue:{code}" for code in record["issues"])
    tmp.replace(target)  # the output appears whole or not at all
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    from hydra.errors import HydraException

    from kimi_pipe.config import compose
    from kimi_pipe.core.tokenizers import TokenizerNotFound

    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = compose(overrides)
    except HydraException as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not cfg.input or not cfg.output:
        print("error: give input=IN.jsonl and output=OUT.jsonl", file=sys.stderr)
        return 2
    source = Path(cfg.input)
    if not source.is_file():
        print(f"error: input file {source} not found", file=sys.stderr)
        return 2
    try:
        model = load_model(cfg.model)
    except (TokenizerNotFound, ValueError) as exc:
        print(f"error: cannot load model {cfg.model.name!r}: {exc}", file=sys.stderr)
        return 2
    try:
        serving = serving_profile(cfg)
    except ValueError as exc:
        print(f"error: conf/serving: {exc}", file=sys.stderr)
        return 2
    tolerance = int(cfg.validation.billing_tolerance)
    counts = run(model, source, Path(cfg.output), tolerance, serving)
    issues = ", ".join(f"{k[6:]}={v}" for k, v in sorted(counts.items()) if k.startswith("issue:"))
    print(
        f"reconstructed {counts['records']} records: {counts['ok']} ok, "
        f"{counts['not_ok']} not ok" + (f" ({issues})" if issues else "") + f" -> {cfg.output}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
