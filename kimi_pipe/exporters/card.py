"""The dataset card (README.md) of an export: what the files hold, how to train, how to serve.

Shared by every format; each exporter supplies its own layout and training sections
(`Exporter.card_layout` / `card_training`), so this file never branches on the format.
"""

from __future__ import annotations

import json
from typing import Any

from kimi_pipe.core.evidence import POSTERIOR_SAMPLED
from kimi_pipe.core.token_yield import yield_line
from kimi_pipe.exporters.base import Exporter


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _ids(ids: list[int]) -> str:
    return " ".join(str(i) for i in ids)


def _audit_lines(audit: dict[str, Any]) -> list[str]:
    """The audit's own figures, top-level scalars and one level of dicts, as table rows."""
    rows: list[str] = []
    for key, value in audit.items():
        if isinstance(value, dict) and all(not isinstance(v, (dict, list)) for v in value.values()):
            for k2, v2 in value.items():
                rows.append(f"| {key}.{k2} | {_fmt(v2)} |")
        elif not isinstance(value, (dict, list)):
            rows.append(f"| {key} | {_fmt(value)} |")
    return rows


def _serving(c: dict[str, Any], num_layers: int) -> list[str]:
    output_ids = c["output_layer_ids"]
    engines = c["drafter_config_ids"]
    is_default = output_ids == [1, num_layers // 2 - 1, num_layers - 4]
    sglang_or = []
    if output_ids and output_ids[0] == 1:
        sglang_or.append(f"{output_ids} (SGLang adds 1 when the first id is 1)")
    vllm_or = []
    if is_default:
        sglang_or.append("none (its default is these layers)")
        vllm_or.append("none (its default [2, N//2, N-3] is these layers)")
    vllm_or.append(f"never {output_ids}: vLLM would read them off by one")
    return [
        "A drafter trained on these states reads the auxiliary layers "
        f'{output_ids} ("output of layer") = {c["capture_layer_ids"]} (input of layer).',
        "What its config's `eagle_aux_hidden_state_layer_ids` must name:",
        "",
        "| engine | name these ids | or |",
        "| --- | --- | --- |",
        f"| SGLang | {_fmt(engines['sglang'])} | {'; '.join(sglang_or) or '-'} |",
        f"| vLLM | {_fmt(engines['vllm'])} | {'; '.join(vllm_or)} |",
    ]


def _files_lines(summary: dict[str, Any]) -> list[str]:
    """The export's own description (`files` in export_summary.json) and each conversion from
    the store (`converted`); the store's own manifest follows under "Hidden states"."""
    f = summary["files"]
    lines = ["| property | in these files |", "| --- | --- |"]
    for key in ("files", "final_state", "layer_convention", "layer_ids", "dtype", "scale_layout"):
        lines.append(f"| {key} | {_fmt(f.get(key)) if f.get(key) is not None else '-'} |")
    lines.append(f"| compression | {f.get('compression') or 'none'} |")
    for name, (shape, dtype) in (
        (k, v) for k, v in (f.get("tensors") or {}).items() if isinstance(v, list)
    ):
        lines.append(f"| tensor `{name}` | [{shape}] {dtype} |")
    converted = summary.get("converted") or {}
    lines += ["", "Converted from the store (`converted`):" if converted else "Nothing converted:"]
    if not converted:
        lines.append("the files hold the store's tensors as stored.")
    for key, change in converted.items():
        lines.append(f"- {key}: {_fmt(change['from'])} -> {_fmt(change['to'])} ({change['how']})")
    return lines


def _policy_rows(policy: dict[str, Any] | None) -> list[str]:
    """The export policy (`export.accept`) and the samples per evidence rung."""
    if not policy:
        return []
    rows = [f"| export policy (`export.accept`) | {', '.join(policy['accept'])} |"]
    rows += [
        f"| exported, evidence `{rung}` | {n} |"
        for rung, n in policy.get("exported_by_evidence", {}).items()
    ]
    rows += [
        f"| left out by the policy, evidence `{rung}` | {n} |"
        for rung, n in policy.get("excluded_by_evidence", {}).items()
    ]
    loss = policy.get("exported_loss_tokens_by_evidence", {})
    rows += [
        f"| exported tokens (loss tokens), evidence `{rung}` | {n} ({loss.get(rung, 0)}) |"
        for rung, n in policy.get("exported_tokens_by_evidence", {}).items()
    ]
    return rows


def _mode_lines(modes: dict[str, Any] | None) -> list[str]:
    """Samples per model mode (the generate run's `model.mode`, e.g. thinking / instant)."""
    if not modes or set(modes) == {"unknown"}:
        return []
    return [
        "",
        "| model mode (generate run's `model.mode`) | samples | tokens | stores |",
        "| --- | --- | --- | --- |",
        *[
            f"| {mode} | {m['samples']} | {m['tokens']} | {m['stores']} |"
            for mode, m in sorted(modes.items())
        ],
    ]


def _drawn_lines(policy: dict[str, Any] | None) -> list[str]:
    """A warning at the top of the card when some samples hold ids DRAWN from the target's
    posterior (`posterior_sampled`, opt-in: resolve.posterior_sampled and export.accept)."""
    n = (policy or {}).get("exported_by_evidence", {}).get(POSTERIOR_SAMPLED, 0)
    if not n:
        return []
    tokens = (policy or {}).get("exported_tokens_by_evidence", {}).get(POSTERIOR_SAMPLED, 0)
    return [
        "",
        f"**{n} samples ({tokens} tokens) hold ids DRAWN, not bought** (evidence "
        f"`{POSTERIOR_SAMPLED}`, accepted because `export.accept` names it): the target left "
        "their closed candidate set unresolved and one option was drawn from its posterior "
        "under the request's sampling (seeded; the record's `posterior_sample` says which, at "
        "what posterior). They are distributed as the target's answers, but none is the answer "
        'that was bought. Their rows in `export_index.jsonl` carry `"drawn": true`.',
    ]


def _yield_lines(block: dict[str, Any] | None) -> list[str]:
    """A source run's yield in tokens and dollars (core/token_yield.py)."""
    if not block:
        return []

    rungs = ", ".join(f"{r} {n}" for r, n in block["exact_by_rung"].items() if n)
    return [
        f"Yield under `{', '.join(block['accept'])}`: {yield_line(block)}. Exact output tokens "
        f"per rung: {rungs or 'none'} (a `prefix_proven` answer counts its proven prefix only; "
        "drawn ids are never exact).",
        "",
    ]


def dataset_card(summary: dict[str, Any], exporter: Exporter) -> str:
    m = summary["source_manifest"]
    c = summary["conventions"]
    t = summary["tokens"]
    n = summary["samples"]
    fmt = summary["format"]
    lines = [
        f"# EAGLE-3 training data ({exporter.title})",
        "",
        f"Made by `python -m kimi_pipe export format={fmt}` (kimi_pipe).",
        *_drawn_lines(summary.get("policy")),
        *exporter.card_layout(summary),
        "`export_index.jsonl` maps every sample to its source store and sample id.",
        "",
        "## Train",
        "",
        *exporter.card_training(summary),
        "",
        "## Serve",
        "",
        *_serving(c, int(m["num_layers"])),
        "",
        "## Counts",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| samples | {n} |",
        f"| tokens | {t['total']} |",
        f"| loss tokens (loss_mask = 1) | {t['loss']} |",
        f"| mean / max length | {t['total'] / n if n else 0:.1f} / {t['max_len']} |",
        f"| skipped (NaN/inf states) | {summary['counts']['skipped_non_finite']} |",
        f"| shuffle seed | {summary['seed']} |",
        *_policy_rows(summary.get("policy")),
        "",
        "| source store | samples | tokens |",
        "| --- | --- | --- |",
        *[f"| `{s['store']}` | {s['samples']} | {s['tokens']} |" for s in summary["per_store"]],
        *_mode_lines(summary.get("modes")),
        "",
        "## What these files hold",
        "",
        *_files_lines(summary),
        "",
        "## Hidden states in the source store (`source_manifest`)",
        "",
        f"- target model: `{m['model']}` ({m['num_layers']} layers, hidden size "
        f"{m['hidden_size']}), captured with the `{m['backend']}` backend, stored as "
        + (
            f"{_fmt(m['store_dtype'])} ({m.get('scale_layout')}), read as {m['dtype']}"
            if m.get("store_dtype")
            else str(m["dtype"])
        ),
        f"- auxiliary layers: stored as {m['layer_ids']} ({m['layer_convention']}: "
        f'{m["layer_convention_doc"]}) = "output of layer" '
        f"{c.get('output_layer_ids_stored', c['output_layer_ids'])}, concatenated in that order"
        + (
            f"; these files hold {c['output_layer_ids']} ({c['layer_selection']['source']})"
            if c.get("layer_selection")
            else ""
        ),
        f"- final state in the store: {m['final_state']} ({m['final_state_doc']})",
    ]
    if m.get("final_rounding"):
        lines.append(f"- fp8 final state's rounding: {m['final_rounding']}")
    if c["final_state_written"]:
        how = {
            "as_is": "as stored",
            "apply_norm": "computed at export from the stored pre-norm state with the final norm "
            f"recorded in the manifest ({_fmt(m.get('final_norm'))}), in float32, then cast to "
            f"{m['dtype']}",
        }[c["final_state_conversion"]]
        lines.append(f"- final state in these files: {c['final_state_written']}, {how}")
    lines += ["", "## Loss mask", "", f"{m['loss_mask']}.", "", "## Fidelity and billing", ""]
    for source in summary["sources"]:
        for run in source["runs"]:
            lines += [f"### `{run['run']}`", ""]
            audit = run.get("audit")
            if audit:
                lines += ["Fidelity audit (`audit.json`: engine ids vs reconstructed ids):", ""]
                lines += ["| figure | value |", "| --- | --- |", *_audit_lines(audit), ""]
            else:
                lines += ["No fidelity audit (`audit.json`) in this run.", ""]
            lines += _yield_lines(run.get("yield"))
            drift = run.get("billing_drift_exported")
            if drift:
                lines += [
                    "Billing drift of the exported samples (reconstructed vs provider-reported "
                    "completion tokens):",
                    "",
                    "| figure | value |",
                    "| --- | --- |",
                    *[f"| {k} | {_fmt(v)} |" for k, v in drift.items()],
                    "",
                ]
            if run.get("billing_drift_run"):
                lines += [
                    f"Whole run (`summary.json`): billing_drift {_fmt(run['billing_drift_run'])}, "
                    f"tokens {_fmt(run.get('tokens_run'))}.",
                    "",
                ]
            if not drift and not run.get("billing_drift_run"):
                lines += ["No billing figures (no usage in the records, no summary.json).", ""]
    return "\n".join(lines).rstrip() + "\n"
