"""The dataset card (README.md) of an export: what the files hold, how to train, how to serve."""

from __future__ import annotations

import json
from typing import Any

TITLES = {
    "specforge": "SpecForge offline layout",
    "speculators": "speculators (vLLM) offline layout",
    "modelopt": "NVIDIA ModelOpt offline dumps",
    "tokens": "pre-tokenized rows for online training",
}


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


def _layout(summary: dict[str, Any]) -> list[str]:
    m, c, fmt = summary["manifest"], summary["conventions"], summary["format"]
    h, aux_h, dtype = m["hidden_size"], m["aux_hidden_size"], m["dtype"]
    if fmt == "specforge":
        return [
            "Every `rows_*/data_*.ckpt` is a `torch.save` dict with `input_ids` [L] int64,",
            f"`loss_mask` [L] int64, `hidden_state` [1, L, {h}] (post-norm) and `aux_hidden_state`",
            f"[1, L, {aux_h}] ({dtype}). SpecForge's offline reader walks the directory for",
            "`*.ckpt` (`data.hidden_states_path`).",
        ]
    if fmt == "speculators":
        k = len(c["output_layer_ids"])
        return [
            "This directory is a `datasets` dataset (`load_from_disk`): rows `input_ids`,",
            "`loss_mask`, `seq_len`, in the shuffled order. Row i's states are",
            f"`hidden_states/hs_i.safetensors`: `hidden_states` [L, {k + 1}, {h}] ({dtype}; the",
            f"{k} auxiliary states, then the final state PRE-norm: speculators applies the",
            "verifier's norm itself) and `token_ids` [L] int64, equal to row i's `input_ids`.",
        ]
    if fmt == "modelopt":
        return [
            "Every `{i}.pt` is a `torch.save` dict read by ModelOpt's `OfflineSupervisedDataset`:",
            f"`input_ids` [L] int64, `hidden_states` [L, {h}] (post-norm), `aux_hidden_states`",
            f"[L, {aux_h}] ({dtype}), `loss_mask` [L] int64 and `hidden_states_prenorm` = False.",
        ]
    return [
        "`tokens.jsonl`: one JSON object a line, `input_ids`, `loss_mask` (same length) and `id`.",
        "No hidden states: the trainer's online path computes them with the target model.",
    ]


def _training(summary: dict[str, Any]) -> list[str]:
    c, fmt, out = summary["conventions"], summary["format"], summary["output"]
    model = summary.get("target_model_path") or "TARGET_MODEL_DIR"
    longest = summary["tokens"]["max_len"]
    capture = c["capture_layer_ids"]
    output_ids = c["output_layer_ids"]
    if fmt == "specforge":
        lines = [
            "SpecForge 0.2.x (`pip install specforge`):",
            "",
            "```bash",
            f"specforge train --config {out}/specforge_train.yaml",
            "```",
            "",
            "`specforge_train.yaml` (written beside the data) sets `data.hidden_states_path` to",
            f"this directory, `data.max_length` = {summary.get('max_length')} (the longest",
            f"sample is {longest} tokens; SpecForge's default 2048 cuts longer samples silently),",
            f"`model.target_model_path`, `model.aux_hidden_state_layer_ids` = {output_ids}",
            '("output of layer" ids, SpecForge\'s convention) and the lm_head / embedding keys',
            f"({summary.get('weight_keys_source')}: {_fmt(summary.get('weight_keys'))}).",
            "Its normaliser sets the last loss-mask position to 0; features are not cast, so",
            "keep the store in the training dtype (bf16).",
        ]
        return lines
    if fmt == "speculators":
        return [
            "speculators (`pip install speculators`), offline (states already here):",
            "",
            "```bash",
            f"speculators train --verifier-name-or-path {model} --data-path {out} \\",
            f"    --speculator-type eagle3 --target-layer-ids {_ids(capture)} \\",
            f"    --on-missing raise --total-seq-len {max(longest, 1)}",
            "```",
            "",
            f'`--target-layer-ids` are input-of-layer ids ({capture} = "output of layer"',
            f"{output_ids} + 1). `--train-data-ratio` (default 0.9) takes the first 90 % of the",
            "rows for training and the rest for validation; the rows are already shuffled.",
        ]
    if fmt == "modelopt":
        return [
            "NVIDIA ModelOpt (`pip install nvidia-modelopt`), its `examples/speculative_decoding`",
            "recipe `modelopt_recipes/general/speculative_decoding/eagle3.yaml` with",
            f"`model.model_name_or_path={model} data.offline_data_path={out}",
            f"training.answer_only_loss=true training.training_seq_len={max(longest, 1)}`.",
            "",
            "Loss mask: ModelOpt's offline dataset ignores the stored `loss_mask` and trains on",
            "every token (all ones) unless `training.answer_only_loss=true`, which reads it.",
            'Aux layers: ModelOpt\'s default is "output of layer" [1, N//2-1, N-4]; these files',
            f"hold {output_ids}; if they differ, set",
            f"`eagle.eagle_architecture_config.eagle_aux_hidden_state_layer_ids={output_ids}`.",
        ]
    return [
        "speculators: `speculators prepare-data --model "
        f"{model} --data {out}/tokens.jsonl --output DIR` keeps these ids and masks (its",
        "pre-tokenized pass-through: no chat template, no render endpoint), then",
        f"`speculators train ... --target-layer-ids {_ids(capture)}` generates the states",
        "through vLLM.",
        "",
        "SpecForge: `data.prompts_path: " + f"{out}/tokens.jsonl` (its pre-tokenized online path:",
        "records with `input_ids` + `loss_mask` are used as they are, never re-tokenized; it",
        "needs an SGLang capture server, `deployment.mode: disaggregated`). Set",
        f"`data.max_length` >= {longest}: it cuts longer rows silently.",
    ]


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
    return rows


def dataset_card(summary: dict[str, Any]) -> str:
    m = summary["manifest"]
    c = summary["conventions"]
    t = summary["tokens"]
    n = summary["samples"]
    fmt = summary["format"]
    lines = [
        f"# EAGLE-3 training data ({TITLES[fmt]})",
        "",
        f"Made by `python -m kimi_pipe.export format={fmt}` (kimi_pipe).",
        *_layout(summary),
        "`export_index.jsonl` maps every sample to its source store and sample id.",
        "",
        "## Train",
        "",
        *_training(summary),
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
        "",
        "## Hidden states",
        "",
        f"- target model: `{m['model']}` ({m['num_layers']} layers, hidden size "
        f"{m['hidden_size']}), captured with the `{m['backend']}` backend, stored as {m['dtype']}",
        f"- auxiliary layers: stored as {m['layer_ids']} ({m['layer_convention']}: "
        f'{m["layer_convention_doc"]}) = "output of layer" {c["output_layer_ids"]}, '
        "concatenated in that order",
        f"- final state in the store: {m['final_state']} ({m['final_state_doc']})",
    ]
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
