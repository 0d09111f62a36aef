r"""Stage `reconstruct`: provider answers in, exact token records out.

    python -m kimi_pipe reconstruct model=kimi_k25 model.tokenizer.path=DIR \
        input=IN.jsonl output=OUT.jsonl

Input lines: {"id", "messages", "tools"?, "response", "request"?} (a line with the request,
as generate writes, gets generate's answer checks too). Output lines, same order:
{"id", "ok", "issues", "prompt_ids", "output_ids", "loss_mask",
 "completion_tokens_reported", "completion_tokens_reconstructed"}, plus "id_sources" and
 "logprobs" when the response carries `logprobs.content[]`: the engine's ids are then used and
 checked (kimi_pipe/core/logprobs.py; `validation.record_ids=reencoded` keeps canonical ids).
Beside the output, `OUT.jsonl.summary.json` counts the records that are ok without a note
(`exact`), ok with notes (`repaired`) and flagged (ok false), by code; the same counts are
printed ("31 ok (11 without a note, 20 with notes), 1 flagged").
Exit 0 once the file is processed (bad records are reported in their own line);
exit 2 with a message for a missing file, an unknown model or a bad tokenizer.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO, cast

from omegaconf import DictConfig, OmegaConf

from kimi_pipe.conformance.auto import is_plain_auto, recorded_profile
from kimi_pipe.core.answer_checks import answer_issues
from kimi_pipe.core.evidence import LADDER, evidence_of
from kimi_pipe.core.issue_codes import (
    ANSWER_CODES,
    BAD_SERVING_PROFILE,
    LOGPROB_ERRORS,
    MALFORMED_RECORD,
    Code,
)
from kimi_pipe.core.issue_codes import RECONSTRUCTION_ERRORS as ERRORS
from kimi_pipe.core.logprobs import LogprobPolicy
from kimi_pipe.core.models import Model, load_model
from kimi_pipe.core.record_builder import RecordBuilder, mark_flagged
from kimi_pipe.core.serving import UNKNOWN_PROFILE, ServingProfile, serving_profile
from kimi_pipe.core.token_record import TokenRecord
from kimi_pipe.errors import ConfigError, InputError, MissingFile
from kimi_pipe.stages.command import compose_command
from kimi_pipe.stages.help import HELP
from kimi_pipe.store import atomic
from kimi_pipe.store.layout import RECONSTRUCTED, RECORDS
from kimi_pipe.store.records import iter_records

MALFORMED = MALFORMED_RECORD
# Codes that make a record flagged: the reconstruction errors and the stage's own
# (BAD_SERVING_PROFILE: a stored `serving_profile` naming no conf/serving profile).
FLAG_CODES = ERRORS | ANSWER_CODES | LOGPROB_ERRORS | {MALFORMED, BAD_SERVING_PROFILE}
UTF8_BOM = b"\xef\xbb\xbf"
# A \uD800-\uDFFF escape: the only way a JSON line can carry a lone surrogate. Pairs (emoji
# written as two escapes) also match, so a hit is confirmed on the parsed value.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class BadLine(InputError):
    """An input line that cannot become a sample; the message says where and why."""


def parse_line(raw: bytes, where: str) -> dict[str, Any]:
    """One input line (bytes, no BOM) to a sample object, or BadLine naming the cause."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadLine(
            f"{where}: not UTF-8 (byte {exc.start} is {raw[exc.start : exc.start + 1]!r}); "
            "re-encode the file as UTF-8"
        ) from None
    try:
        sample = json.loads(text)
    except RecursionError:
        raise BadLine(f"{where}: JSON nested too deep to read") from None
    except ValueError as exc:
        raise BadLine(f"{where}: not JSON ({exc})") from None
    if not isinstance(sample, dict):
        raise BadLine(f"{where}: not a JSON object")
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(sample):
        # Not text any model or tokenizer produced: the provider saw something else (or
        # nothing), so no id sequence can be proven for it.
        raise BadLine(
            f"{where}: a \\uD800-\\uDFFF escape that is not half of a surrogate pair; "
            "fix the text that produced it"
        )
    return sample


def _has_lone_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def reconstruct_line(
    model: Model | RecordBuilder,
    line: str | bytes,
    line_no: int,
    tolerance: int = 0,
    source: str = "input",
    policy: LogprobPolicy | None = None,
    serving: ServingProfile | None = None,
) -> TokenRecord:
    """One input line to one output record; never raises on bad data. `model`: a
    RecordBuilder (the one reconstruction entry), or a Model with the settings beside it."""
    builder = (
        model
        if isinstance(model, RecordBuilder)
        else RecordBuilder(model, serving or UNKNOWN_PROFILE, tolerance, policy or LogprobPolicy())
    )
    raw = line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line
    where = f"{source}:{line_no}"
    try:
        sample = parse_line(raw, where)
    except BadLine as exc:
        return _bad_record(None, MALFORMED, str(exc))
    sample_id = sample.get("id", f"line-{line_no}")
    messages = sample.get("messages")
    if not isinstance(messages, list):
        return _bad_record(sample_id, Code.BAD_PROMPT, f"{where}: messages must be a list")
    recorded = None
    if is_plain_auto(builder.serving):
        # serving=auto over a stored run: the profile generate fitted for this record's
        # provider (serving=NAME overrides it); a record that names none: nothing declared.
        try:
            recorded = recorded_profile(sample)
        except ConfigError as exc:
            return _bad_record(sample_id, BAD_SERVING_PROFILE, f"{where}: {exc}")
        if recorded is not None:
            builder = replace(builder, serving=recorded)
    try:
        record = builder.build(
            messages, sample.get("tools"), sample.get("response"), sample.get("request")
        )
    except RecursionError:
        return _bad_record(sample_id, MALFORMED, f"{where}: nested too deep to reconstruct")
    request, response = sample.get("request"), sample.get("response")
    if (
        isinstance(request, dict)
        and isinstance(request.get("model"), str)
        and isinstance(response, dict)
        and response.get("choices")
    ):
        # A generate run's record: its answer checked as generate checked it (the model
        # asked and named, the route, the finish), or those flags would be lost here.
        record = mark_flagged(record, answer_issues(response, request["model"], request))
    out: TokenRecord = {"id": sample_id, **record}
    if recorded is not None:
        out |= {"serving_profile": sample["serving_profile"],
                "serving_probe": sample.get("serving_probe")}  # fmt: skip
    return out


def _bad_record(sample_id: Any, code: str, why: str) -> TokenRecord:
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
        "evidence": Code.UNRESOLVED,
        "sampling": None,
    }


def _lines(handle: BinaryIO) -> Iterator[tuple[int, bytes]]:
    for line_no, raw in enumerate(handle, 1):
        if line_no == 1 and raw.startswith(UTF8_BOM):
            raw = raw[len(UTF8_BOM) :]  # editors on Windows write one; it is not data
        if raw.strip():
            yield line_no, raw


def summary_path(target: Path) -> Path:
    return target.with_name(target.name + ".summary.json")


def run(
    model: Model | RecordBuilder,
    source: Path,
    target: Path,
    tolerance: int = 0,
    policy: LogprobPolicy | None = None,
    serving: ServingProfile | None = None,
) -> Counter[str]:
    """Reconstruct every line of `source` into `target` and write the summary beside it.

    Returns counts: records, ok, not_ok, exact, repaired, flagged, `issue:CODE`,
    `flagged:CODE` (flagging codes of flagged records), `repaired:CODE` (notes of ok ones),
    `evidence:RUNG` (the ladder) and `candidates:closed` / `candidates:open`.
    """
    builder = (
        model
        if isinstance(model, RecordBuilder)
        else RecordBuilder(model, serving or UNKNOWN_PROFILE, tolerance, policy or LogprobPolicy())
    )
    counts: Counter[str] = Counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    # The output appears whole or not at all.
    with (
        atomic.atomic_path(target, suffix=".partial") as tmp,
        source.open("rb") as src,
        atomic.open_new(tmp) as dst,
    ):
        for line_no, line in _lines(src):
            record = reconstruct_line(builder, line, line_no, source=str(source))
            dst.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
            count_record(counts, record)
    write_summary(summary_path(target), source, target, counts)
    return counts


def count_record(counts: Counter[str], record: TokenRecord) -> None:
    issues = list(record["issues"])
    counts["records"] += 1
    counts["ok" if record["ok"] else "not_ok"] += 1
    counts.update(f"issue:{code}" for code in issues)
    if not record["ok"]:
        counts["flagged"] += 1
        counts.update(f"flagged:{code}" for code in issues if code in FLAG_CODES)
    elif issues:
        counts["repaired"] += 1
        counts.update(f"repaired:{code}" for code in issues)
    else:
        counts["exact"] += 1
    counts[f"evidence:{record.get('evidence') or evidence_of(record)}"] += 1
    if isinstance(record.get("candidates"), dict):
        closed = record["candidates"].get("closed")
        counts["candidates:closed" if closed else "candidates:open"] += 1


def _by(counts: Counter[str], prefix: str) -> dict[str, int]:
    return {k[len(prefix) :]: v for k, v in sorted(counts.items()) if k.startswith(prefix)}


def summary_data(source: Path, target: Path, counts: Counter[str]) -> dict[str, Any]:
    return {
        "input": str(source),
        "output": str(target),
        "records": counts["records"],
        "exact": counts["exact"],
        "repaired": counts["repaired"],
        "flagged": counts["flagged"],
        "evidence": {rung: counts[f"evidence:{rung}"] for rung in LADDER},
        "candidates": {"closed": counts["candidates:closed"], "open": counts["candidates:open"]},
        "flagged_by_code": _by(counts, "flagged:"),
        "repaired_by_code": _by(counts, "repaired:"),
        "issues": _by(counts, "issue:"),
    }


def write_summary(path: Path, source: Path, target: Path, counts: Counter[str]) -> None:
    atomic.write_json(path, summary_data(source, target, counts), suffix=".partial", indent=2)


def summary_lines(counts: Counter[str], target: Path) -> list[str]:
    def listed(prefix: str) -> str:
        return ", ".join(f"{code}={n}" for code, n in _by(counts, prefix).items()) or "-"

    return [
        # "ok" as generate's summary and the demo say it (ids proven); "exact" is the
        # audit's word for ids equal to an engine's own.
        f"reconstructed {counts['records']} records -> {target}: {counts['ok']} ok "
        f"({counts['exact']} without a note, {counts['repaired']} with notes), "
        f"{counts['flagged']} flagged (ok false)",
        "  evidence: "
        + ", ".join(f"{rung}={counts[f'evidence:{rung}']}" for rung in LADDER)
        + f" (flagged with a closed candidate set: {counts['candidates:closed']}, "
        f"open: {counts['candidates:open']})",
        f"  flagged by code:  {listed('flagged:')}",
        f"  notes of ok ones: {listed('repaired:')}",
        f"  summary: {summary_path(target)}",
    ]


def run_stage(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """The stage entry: `input` (default <run_dir>/records.jsonl) -> `output` (default
    <run_dir>/reconstructed.jsonl); the summary's counts."""
    # Converted once, here: below the door plain values (a mandatory one never given: ???).
    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    source = Path(values["input"]) if values.get("input") else None
    target = Path(values["output"]) if values.get("output") else None
    if run_dir is not None:
        source = source or Path(run_dir) / RECORDS
        target = target or Path(run_dir) / RECONSTRUCTED
    if source is None or target is None:
        raise ConfigError("give input=IN.jsonl and output=OUT.jsonl")
    if not source.is_file():
        raise MissingFile(
            f"input file {source} {'is a directory' if source.is_dir() else 'not found'}"
        )
    with source.open("rb") as lines:
        if not any(line.strip() for line in lines):
            # Nothing to prove, and an empty output is easily taken for a finished run.
            raise InputError(f"input file {source} is empty: no answers to reconstruct")
    try:
        model = load_model(values.get("model") or {})
    except (ConfigError, ValueError) as exc:
        name = (values.get("model") or {}).get("name")
        raise ConfigError(f"cannot load model {name!r}: {exc}") from None
    try:
        serving = serving_profile(values)
    except ValueError as exc:  # checked before any line is read
        raise ConfigError(f"conf/serving: {exc}") from None
    counts = run_configured(values, model, source, target, serving)
    print("\n".join(summary_lines(counts, target)), file=sys.stderr)
    summary = summary_data(source, target, counts)
    if run_dir is not None and source == Path(run_dir) / RECORDS:
        summary.update(compare_with_generate(source, target))
    return summary


def compare_with_generate(source: Path, target: Path) -> dict[str, int]:
    """How many reconstructed records carry the very ids generate wrote inline."""

    inline = {r["id"]: r for r in iter_records(source) if not r.get("error")}
    keys = ("prompt_ids", "output_ids", "loss_mask")
    same = differ = 0
    for rec in iter_records(target):
        ref = inline.get(rec.get("id"))
        if ref is None:
            continue
        if all(rec.get(k) == ref.get(k) for k in keys):
            same += 1
        else:
            differ += 1
    return {"same_as_generate": same, "differ_from_generate": differ}


def main(argv: Sequence[str] | None = None) -> int:

    return compose_command(run_stage, argv, help=HELP["reconstruct"])


def run_configured(
    cfg: Any, model: Model, source: Path, target: Path, serving: ServingProfile | None = None
) -> Counter[str]:
    """`run` with the settings the composed config gives: billing tolerance, logprob policy
    and serving profile (the CLI and the runner's reconstruct stage both use it)."""
    return run(RecordBuilder.from_config(cfg, model, serving), source, target)


if __name__ == "__main__":
    sys.exit(main())
