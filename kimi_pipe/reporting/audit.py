"""The audit's engine: reconstructed ids set beside the ids an engine really produced
(`truth`), each difference located and classified. The command is kimi_pipe/stages/audit.py,
whose docstring says where truth comes from and what is written.

Why about 550 lines: the truth sources, the comparison and the summary of one command's
records change together whenever a truth source is added.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kimi_pipe.config import typed_settings
from kimi_pipe.core.id_compare import (  # noqa: F401  (re-exported: the audit's vocabulary)
    BILLING_ISSUE,
    FFFD,
    MISMATCH_CLASSES,
    Comparison,
    classify,
    json_spans,
)
from kimi_pipe.core.issue_codes import Code
from kimi_pipe.core.models import load_model
from kimi_pipe.errors import InputError
from kimi_pipe.store import atomic
from kimi_pipe.store.layout import AUDIT_JSON, RECORDS
from kimi_pipe.store.records import RecordWriter, iter_records

log = logging.getLogger("kimi_pipe.audit")

TRUTH_FILE = "audit_truth.jsonl"
AUDIT_MD = "audit.md"


class AuditError(InputError, RuntimeError):
    """A start-up problem (missing file, bad setting) with a message for the user."""


# ---------------------------------------------------------------------------------------
# Truth ids from engine replies


@dataclass(frozen=True)
class TruthIds:
    output_ids: list[int]
    prompt_ids: list[int] | None = None
    source: str = ""


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(type(v) is int for v in value):  # bool is not an id
        return list(value)
    return None


def _extra(obj: Mapping[str, Any], key: str) -> Any:
    """A key of `obj`, or of its `provider_specific_fields` (where LiteLLM moves extras)."""
    if key in obj:
        return obj[key]
    extra = obj.get("provider_specific_fields")
    return extra.get(key) if isinstance(extra, Mapping) else None


def truth_from_reply(reply: Any) -> TruthIds | None:
    """Token ids out of an engine reply; None when it carries none.

    SGLang `/generate`: `{"text", "output_ids", "meta_info"}`. OpenAI-compatible with
    `return_token_ids`: `choices[0].token_ids` (chat and completions), `prompt_token_ids` at
    the top level (chat) or in the choice (completions).
    """
    if not isinstance(reply, Mapping):
        return None
    output = _int_list(reply.get("output_ids"))
    if output is not None:
        meta_info = reply.get("meta_info")
        meta: Mapping[str, Any] = meta_info if isinstance(meta_info, Mapping) else {}
        prompt = _int_list(reply.get("input_ids")) or _int_list(meta.get("input_ids"))
        return TruthIds(output, prompt, "sglang_generate")
    choices = reply.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        choice = choices[0]
        raw_message = choice.get("message")
        message: Mapping[str, Any] = raw_message if isinstance(raw_message, Mapping) else {}
        output = _int_list(_extra(choice, "token_ids")) or _int_list(_extra(message, "token_ids"))
        if output is not None:
            prompt = _int_list(_extra(reply, "prompt_token_ids")) or _int_list(
                _extra(choice, "prompt_token_ids")
            )
            return TruthIds(output, prompt, "return_token_ids")
    return None


# ---------------------------------------------------------------------------------------
# Comparison (pure)


# ---------------------------------------------------------------------------------------
# Truth sources


@dataclass
class AuditSettings:
    truth: str = "hf_greedy"  # hf_greedy | replies | response
    run_dir: str | None = None
    records: str | None = None
    replies: str | None = None
    output_dir: str | None = None
    model_path: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    max_new_tokens: int = 256  # hf_greedy, when a record does not say what it asked for
    limit: int | None = None
    examples: int = 8  # mismatches shown in audit.md
    end_markers: list[str] = field(default_factory=list)  # extra end-of-turn marker names

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any] | None) -> AuditSettings:
        """Typed from the `audit` node: an unknown key or a value of the wrong kind is a
        ConfigError naming `audit.KEY`."""

        settings = typed_settings(dict(cfg or {}), cls, "audit")
        if settings.truth not in ("hf_greedy", "replies", "response"):
            raise AuditError(f"audit.truth={settings.truth!r}: use hf_greedy, replies or response")
        return settings


def requested_max_tokens(record: Mapping[str, Any]) -> int | None:
    request = record.get("request")
    if isinstance(request, Mapping):
        for key in ("max_completion_tokens", "max_tokens", "max_new_tokens"):
            if isinstance(request.get(key), int):
                return int(request[key])
    return None


class HFGreedyTruth:
    """Greedy generation with transformers, as `transformers serve` does at temperature 0:
    the prompt is the tokenizer's own chat template over the record's messages. A model
    directory without a chat template (a miniature target, weights without tokenizer files)
    generates from the record's own prompt ids: its output is audited, its prompt is not."""

    def __init__(self, model_dir: Path, device: str, dtype: str, threads: int | None) -> None:
        import torch  # optional dep

        from kimi_pipe.extraction.hf_backend import load_text_model  # transformers: heavy

        if threads:
            torch.set_num_threads(int(threads))
        if not (model_dir / "config.json").is_file():
            raise AuditError(
                f"{model_dir} is not a model directory; set audit.model_path (for the demo "
                "model run `python -m kimi_pipe.store.local_model`)"
            )
        self.model_dir = model_dir
        self.tokenizer = _chat_tokenizer(model_dir)
        # The model's own class, or a wrapper's (Kimi K2.5's vision wrapper) as extraction
        # loads it; never remote code.
        self.model = load_text_model(model_dir, dtype).to(device)
        self.model.eval()
        self._torch = torch

    def __call__(self, record: Mapping[str, Any], max_new_tokens: int) -> TruthIds:
        if self.tokenizer is not None:
            inputs = self.tokenizer.apply_chat_template(
                record["messages"],
                tools=record.get("tools") or None,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
            ).to(self.model.device)  # type: ignore[union-attr]
        else:
            ids = record.get("prompt_ids")
            if not isinstance(ids, list) or not ids:
                raise AuditError(
                    f"{self.model_dir} has no chat template and the record no prompt_ids"
                )
            tensor = self._torch.tensor([ids], device=self.model.device)
            inputs = {"input_ids": tensor, "attention_mask": self._torch.ones_like(tensor)}
        config = copy.deepcopy(self.model.generation_config)
        config.do_sample = False  # what temperature=0 means to the server
        config.max_new_tokens = max_new_tokens
        with self._torch.inference_mode():
            out = self.model.generate(**inputs, generation_config=config)
        n = inputs["input_ids"].shape[-1]
        return TruthIds(
            output_ids=out[0, n:].tolist(),
            prompt_ids=inputs["input_ids"][0].tolist() if self.tokenizer is not None else None,
            source="hf_greedy" if self.tokenizer is not None else "hf_greedy_record_prompt",
        )


def _chat_tokenizer(model_dir: Path) -> Any:
    """The directory's tokenizer when it has a chat template, else None (logged)."""
    from transformers import AutoTokenizer  # optional dep

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as exc:
        log.warning(
            "%s: no tokenizer (%s); the records' prompt ids are the prompts", model_dir, exc
        )
        return None
    if not getattr(tokenizer, "chat_template", None):
        log.warning("%s: no chat template; the records' prompt ids are the prompts", model_dir)
        return None
    return tokenizer


def load_replies(path: Path) -> dict[str, TruthIds]:
    """`{"id", "reply"}` lines, or replies with their own `id`; lines without ids are counted."""
    if not path.is_file():
        raise AuditError(f"audit.replies={path}: file not found (JSONL of engine replies)")
    out: dict[str, TruthIds] = {}
    unusable = 0
    for line in iter_records(path):
        rid = line.get("id")
        truth = truth_from_reply(line.get("reply", line))
        if rid is None or truth is None:
            unusable += 1
            continue
        out[str(rid)] = truth
    if unusable:
        log.warning("%s: %d lines without an id or token ids were skipped", path, unusable)
    return out


# ---------------------------------------------------------------------------------------
# The stage


@dataclass
class SampleRow:
    id: str
    exact: bool
    output_exact: bool
    prompt_exact: bool | None  # None: the truth has no prompt ids
    output_class: str | None
    prompt_class: str | None
    first_diff: int | None
    truth_len: int
    recon_len: int
    reconstruction_ok: bool
    issues: list[str]
    detail: str
    context: dict[str, str] | None = None  # pieces around the first difference

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _context(
    truth: Sequence[int], recon: Sequence[int], at: int, piece: Callable[[int], str]
) -> dict[str, str]:
    def show(token: int) -> str:
        text = piece(token)
        return f"#{token}" if FFFD in text else text  # a lone byte token: show its id

    lo = max(0, at - 3)
    return {
        "truth": " | ".join(show(i) for i in truth[lo : at + 4]),
        "reconstructed": " | ".join(show(i) for i in recon[lo : at + 4]),
    }


def _records_path(s: AuditSettings) -> Path:
    if s.records:
        path = Path(s.records)
    elif s.run_dir:
        path = Path(s.run_dir) / RECORDS
    else:
        raise AuditError("give audit.run_dir=RUN_DIR (a generate run) or audit.records=FILE.jsonl")
    if not path.is_file():
        raise AuditError(f"{path}: records file not found (run the generate stage first)")
    return path


def latest_by_id(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per id, the last one (a resumed run may hold a sample twice; extract and
    report count the last too), in the file order of the surviving records."""
    by_id: dict[Any, dict[str, Any]] = {}
    for i, rec in enumerate(records):
        rid = rec.get("id", f"line-{i}")
        by_id.pop(rid, None)  # keep the file order of the surviving record
        by_id[rid] = rec
    return list(by_id.values())


def end_ids_of(model: Any, extra_markers: Sequence[str] = ()) -> frozenset[int]:
    """Ids of the markers in the model's output `end` template (plus configured extras)."""
    ids = {
        model.markers[value]
        for kind, value in model.format.output.end.parts
        if kind == "marker" and value in model.markers
    }
    for name in extra_markers:
        token = model.tokenizer.marker_id(name)
        if token is None:
            raise AuditError(f"audit.end_markers: {name!r} is not a token of this model")
        ids.add(token)
    return frozenset(ids)


def audit_records(
    records: Iterable[Mapping[str, Any]],
    truth_for: Callable[[Mapping[str, Any]], TruthIds | None],
    decode: Callable[[Sequence[int]], str],
    piece: Callable[[int], str],
    end_ids: frozenset[int],
    progress: Callable[[int, SampleRow | None, str], None] | None = None,
) -> tuple[list[SampleRow], Counter[str]]:
    """Compare every usable record with its truth; returns rows and skip counts by reason.
    A record that cannot be audited is counted and the batch goes on."""
    rows: list[SampleRow] = []
    skipped: Counter[str] = Counter()
    for n, rec in enumerate(records, 1):
        rid = str(rec.get("id"))
        if rec.get("error"):
            skipped[Code.PROVIDER_ERROR] += 1
            continue
        recon_out = rec.get("output_ids") or []
        if not recon_out:
            skipped["no_reconstructed_ids"] += 1
            continue
        try:
            truth = truth_for(rec)
        except Exception as exc:  # noqa: BLE001 - one bad sample must not stop the audit
            log.warning("%s: no truth ids: %s", rid, exc)
            skipped["truth_failed"] += 1
            if progress:
                progress(n, None, rid)
            continue
        if truth is None:
            skipped["no_truth"] += 1
            continue
        out_cmp = classify(truth.output_ids, recon_out, decode, end_ids)
        prompt_exact: bool | None = None
        prompt_class: str | None = None
        if truth.prompt_ids is not None:
            p_cmp = classify(truth.prompt_ids, rec.get("prompt_ids") or [], decode, ())
            prompt_exact, prompt_class = p_cmp.exact, p_cmp.klass
        row = SampleRow(
            id=rid,
            exact=out_cmp.exact and prompt_exact is not False,
            output_exact=out_cmp.exact,
            prompt_exact=prompt_exact,
            output_class=out_cmp.klass,
            prompt_class=prompt_class,
            first_diff=out_cmp.first_diff,
            truth_len=out_cmp.truth_len,
            recon_len=out_cmp.recon_len,
            reconstruction_ok=bool(rec.get("ok")),
            issues=list(rec.get("issues") or []),
            detail=out_cmp.detail,
        )
        if out_cmp.first_diff is not None:
            row.context = _context(truth.output_ids, recon_out, out_cmp.first_diff, piece)
        rows.append(row)
        if progress:
            progress(n, row, rid)
    return rows, skipped


def summarise(rows: Sequence[SampleRow], skipped: Mapping[str, int], truth: str) -> dict[str, Any]:
    n = len(rows)
    exact = sum(r.exact for r in rows)
    out_exact = sum(r.output_exact for r in rows)
    with_prompt = [r for r in rows if r.prompt_exact is not None]
    mismatches = [r for r in rows if not r.output_exact]
    # How well the reconstruction's own length check against usage predicts a mismatch.
    caught = sum(BILLING_ISSUE in r.issues for r in mismatches)
    false_alarms = sum(BILLING_ISSUE in r.issues for r in rows if r.output_exact)
    return {
        "truth": truth,
        "audited": n,
        "skipped": dict(skipped),
        "exact": exact,
        "exact_match_rate": exact / n if n else None,
        "output_exact": out_exact,
        "output_exact_rate": out_exact / n if n else None,
        "prompt_checked": len(with_prompt),
        "prompt_exact": sum(bool(r.prompt_exact) for r in with_prompt),
        "output_mismatch_classes": {
            k: sum(r.output_class == k for r in mismatches) for k in MISMATCH_CLASSES
        },
        "prompt_mismatch_classes": dict(
            Counter(r.prompt_class for r in with_prompt if r.prompt_class)
        ),
        "mismatches_caught_by_billing_check": caught,
        "exact_but_billing_mismatch": false_alarms,
        "reconstruction_issues": dict(Counter(i for r in rows for i in r.issues)),
        "tokens": {
            "truth": sum(r.truth_len for r in rows),
            "reconstructed": sum(r.recon_len for r in rows),
        },
    }


def format_table(summary: Mapping[str, Any], rows: Sequence[SampleRow], examples: int) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    lines = [
        f"# Fidelity audit (truth: {summary['truth']})",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| samples audited | {summary['audited']} |",
        f"| exact match (prompt + output ids) | {summary['exact']} "
        f"({pct(summary['exact_match_rate'])}) |",
        f"| output ids exact | {summary['output_exact']} ({pct(summary['output_exact_rate'])}) |",
        f"| prompt ids exact | {summary['prompt_exact']} of {summary['prompt_checked']} |",
        "| mismatches caught by the billing check | "
        f"{summary['mismatches_caught_by_billing_check']} |",
        f"| exact but billing mismatch | {summary['exact_but_billing_mismatch']} |",
        f"| tokens truth / reconstructed | {summary['tokens']['truth']} / "
        f"{summary['tokens']['reconstructed']} |",
    ]
    for reason, count in sorted(summary["skipped"].items()):
        lines.append(f"| skipped: {reason} | {count} |")
    lines += ["", "| output mismatch class | samples |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in summary["output_mismatch_classes"].items()]
    shown = [r for r in rows if not r.exact][:examples]
    if shown:
        lines += ["", "| id | class | first diff | truth | reconstructed |"]
        lines += ["| --- | --- | --- | --- | --- |"]
        for r in shown:
            ctx = r.context or {"truth": "", "reconstructed": ""}
            klass = r.output_class or f"prompt:{r.prompt_class}"
            lines.append(
                f"| {r.id} | {klass} | {r.first_diff} | {_cell(ctx['truth'])} "
                f"| {_cell(ctx['reconstructed'])} |"
            )
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return "`" + text.replace("|", "\\|").replace("\n", "\\n").replace("`", "'") + "`"


class TruthCache:
    """Truth ids already made (`audit_truth.jsonl`), keyed by (id, source key)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.known: dict[tuple[str, str], TruthIds] = {}
        for line in iter_records(path):
            ids = _int_list(line.get("output_ids"))
            if ids is None or not isinstance(line.get("key"), str):
                continue
            prompt = _int_list(line.get("prompt_ids"))
            self.known[(str(line.get("id")), line["key"])] = TruthIds(ids, prompt, line["key"])
        self._writer: RecordWriter | None = None

    def get(self, rid: str, key: str) -> TruthIds | None:
        return self.known.get((rid, key))

    def put(self, rid: str, key: str, truth: TruthIds, seconds: float) -> None:
        if self._writer is None:
            self._writer = RecordWriter(self.path)
        self._writer.append(
            {"id": rid, "key": key, "prompt_ids": truth.prompt_ids,
             "output_ids": truth.output_ids, "seconds": round(seconds, 3)}
        )  # fmt: skip
        self.known[(rid, key)] = truth

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


@dataclass(frozen=True)
class AuditJob:
    """What one audit runs on, built at the stage's door (kimi_pipe/stages/jobs/audit.py):
    the `audit` settings and the model group as plain values (`core.models.load_model`)."""

    settings: AuditSettings
    model: Mapping[str, Any]

    @property
    def model_name(self) -> str:
        return str(self.model.get("name"))

    @property
    def hf_weights(self) -> str | None:
        path = self.model.get("hf_weights")
        return str(path) if path else None


def _model_path(s: AuditSettings, hf_weights: str | None) -> Path:
    path = s.model_path or hf_weights
    if not path:
        raise AuditError("audit.truth=hf_greedy needs audit.model_path (or model.hf_weights)")
    return Path(str(path)).expanduser()


def run_audit(job: AuditJob) -> dict[str, Any]:
    """Audit the records named by `job.settings`; writes audit.json/audit.md, returns the
    summary."""

    s = job.settings
    records_path = _records_path(s)
    out_dir = Path(s.output_dir) if s.output_dir else records_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    model = load_model(job.model)
    end_ids = end_ids_of(model, s.end_markers)
    records = latest_by_id(iter_records(records_path))
    if s.limit is not None:
        records = records[: s.limit]
    cache = TruthCache(out_dir / TRUTH_FILE)
    truth_for = _truth_source(s, cache, job.hf_weights)
    started = time.monotonic()

    def progress(n: int, row: SampleRow | None, rid: str) -> None:
        state = "truth failed" if row is None else ("exact" if row.exact else row.output_class)
        print(f"[audit] {n}/{len(records)} {rid}: {state} ({time.monotonic() - started:.0f}s)",
              file=sys.stderr, flush=True)  # fmt: skip

    try:
        rows, skipped = audit_records(
            records, truth_for, model.tokenizer.decode, model.tokenizer.piece, end_ids, progress
        )
    finally:
        cache.close()
    if not rows and skipped.get("truth_failed"):
        # Nothing was audited and the cause is in the log only: not a result to report as 0.
        raise AuditError(
            f"no truth for any of {skipped['truth_failed']} records (audit.truth={s.truth}): "
            f"see the warnings above; audit.model_path={_model_path(s, job.hf_weights)}"
            if s.truth == "hf_greedy"
            else f"no truth for any of {skipped['truth_failed']} records (audit.truth={s.truth})"
        )
    summary = summarise(rows, skipped, s.truth)
    summary.update(
        records=str(records_path),
        truth_cache=str(out_dir / TRUTH_FILE),
        model=job.model_name,
        wall_s=round(time.monotonic() - started, 3),
    )
    # Summary keys at the top level (the export's dataset card reads them), rows under samples.
    _write_atomic(out_dir / AUDIT_JSON, json.dumps(
        {**summary, "samples": [r.to_json() for r in rows]}, indent=1, ensure_ascii=False
    ) + "\n")  # fmt: skip
    _write_atomic(out_dir / AUDIT_MD, format_table(summary, rows, s.examples))
    summary["audit_json"] = str(out_dir / AUDIT_JSON)
    summary["audit_md"] = str(out_dir / AUDIT_MD)
    return summary


def _truth_source(
    s: AuditSettings, cache: TruthCache, hf_weights: str | None
) -> Callable[[Mapping[str, Any]], TruthIds | None]:
    if s.truth == "response":
        return lambda rec: truth_from_reply(rec.get("response"))
    if s.truth == "replies":
        if not s.replies:
            raise AuditError("audit.truth=replies needs audit.replies=FILE.jsonl")
        replies = load_replies(Path(s.replies))
        return lambda rec: replies.get(str(rec.get("id")))
    engine: HFGreedyTruth | None = None
    model_dir = _model_path(s, hf_weights)

    def greedy(rec: Mapping[str, Any]) -> TruthIds | None:
        nonlocal engine
        if not isinstance(rec.get("messages"), list):
            return None
        max_new = requested_max_tokens(rec) or s.max_new_tokens
        # What the truth depends on: model, length, and the numerics (device, dtype, threads).
        key = (
            f"hf_greedy:{model_dir}:max_new_tokens={max_new}:device={s.device}"
            f":dtype={s.dtype}:threads={s.threads}"
        )
        rid = str(rec.get("id"))
        known = cache.get(rid, key)
        if known is not None:
            return known
        if engine is None:  # loaded only when some truth is not cached yet
            engine = HFGreedyTruth(model_dir, s.device, s.dtype, s.threads)
        t0 = time.monotonic()
        truth = engine(rec, max_new)
        cache.put(rid, key, truth, time.monotonic() - t0)
        return truth

    return greedy


def _write_atomic(path: Path, text: str) -> None:
    atomic.write_text(path, text, suffix=".partial")
