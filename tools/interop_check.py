"""Load kimi_pipe exports with each trainer's OWN data-loading code and check them by numbers.

Runs in the interop environment (tools/interop.sh builds it: specforge, speculators,
nvidia-modelopt from PyPI), never imports kimi_pipe: it is an independent check of the files.

    python -m tools.interop_check --exports DIR --records RUN/records.jsonl --model MODEL_DIR

For every export directory under --exports (each holds export_summary.json):

* loader: SpecForge `OfflineManifestReader` + `load_feature_file` + its EAGLE-3 normaliser and
  collator; speculators `ArrowDataset` (file backend); ModelOpt `OfflineSupervisedDataset`
  (answer_only_loss=True) + `EagleOfflineDataCollator`; tokens: speculators' pre-tokenized
  pass-through and SpecForge's `prepare_prompt_tasks`.
* ids and loss mask equal the records (after the trainer's own documented change: SpecForge's
  normaliser zeroes the last position);
* the teacher state (what the trainer feeds its LM head: SpecForge `target`, ModelOpt
  `base_model_hidden_states`, speculators `verifier_norm(verifier_last_hidden_states)`) has
  rms(h / norm.weight) about 1, and lm_head(h) argmax equals the next token on >= 99% of the
  generated positions (the records were generated greedily by this model);
* the aux states equal a transformers forward at the layers the trainer is told
  (relative error within bf16 storage rounding), and differ from the neighbouring layers.

Prints one table and writes interop.json beside the exports. Exit 1 if an export that is meant
to pass fails, or a deliberately wrong one (name starting with "wrong-") passes.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

ARGMAX_MIN = 0.99
RMS_TOL = 0.02  # |rms(h / w) - 1| for a post-norm state (eps makes it slightly below 1)
# An aux value matches the reference when within bf16 storage rounding (8 significant bits:
# 2^-9 relative, doubled for float32 batch-vs-single noise) plus a floor of 1e-3 x the token's
# RMS for values near zero. A max-abs/max ratio would not do: massive activations that persist
# across layers make neighbouring layers look alike by that measure.
AUX_REL = 2.0**-8
AUX_FLOOR = 1e-3
AUX_MATCH_MIN = 0.999  # fraction of values that must match
# fp8 (e4m3: 3 mantissa bits) states, in the files or in the store they were converted from:
# each value within half an fp8 step (2^-4 relative) plus the bf16 rounding of the dequantized
# value. Its rounding moves the LM head's argmax on near-ties: 97.3 % = next token on the demo's
# 1,573 answer positions with an fp8 final state against 99.8 % from bf16 (docs/export.md), so
# the teacher check is >= 95 % there; a wrong norm or layer still fails it by far (14.5 %).
# An fp8 store that kept the teacher (final_rounding argmax_kept) is held to bf16's floor.
AUX_REL_FP8 = 2.0**-4 + 2.0**-8
ARGMAX_MIN_FP8 = 0.95


def load_records(path: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out[str(rec["id"])] = rec
    return out


class Target:
    """The target model in float32: reference states, final norm, LM head."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        # A vision wrapper around a text model (Kimi K2.5's, which transformers maps to no
        # causal-LM class) loads with its own class; its text decoder and head are the target.
        config = AutoConfig.from_pretrained(str(model_dir))
        causal = type(config) in AutoModelForCausalLM._model_mapping
        auto: Any = AutoModelForCausalLM if causal else AutoModelForImageTextToText
        self.model = auto.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()
        self.decoder = self.model.get_decoder()
        self.norm = self.decoder.norm
        self.norm_weight = self.norm.weight.detach().float()
        self.head = self.model.get_output_embeddings().weight.detach().float()
        self._cache: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}

    @torch.inference_mode()
    def hidden_states(self, ids: list[int]) -> tuple[torch.Tensor, ...]:
        """transformers' hidden_states: index i is the input of layer i (0 = embeddings)."""
        key = tuple(ids)
        if key not in self._cache:
            out = self.decoder(input_ids=torch.tensor([ids]), output_hidden_states=True)
            self._cache[key] = tuple(h[0].float() for h in out.hidden_states)
        return self._cache[key]

    @torch.inference_mode()
    def apply_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h.float())


class Tally:
    def __init__(self, fp8: bool = False, teacher_kept: bool = True) -> None:
        self.fp8 = fp8  # fp8 rounding somewhere between the capture and these files
        # The final state reads as the plain store's teacher (bf16, or fp8 that kept it).
        self.teacher_kept = teacher_kept
        self.samples = 0
        self.ids_ok = 0
        self.mask_ok = 0
        self.rms: list[float] = []
        self.rms_raw: list[float] = []
        self.argmax_hits = 0
        self.argmax_total = 0
        self.aux_match = 0
        self.aux_total = 0
        self.neighbour_match = 0
        self.neighbour_total = 0

    def result(self, post_norm_claimed: bool) -> dict[str, Any]:
        mean_rms = sum(self.rms) / len(self.rms) if self.rms else None
        argmax = self.argmax_hits / self.argmax_total if self.argmax_total else None
        out: dict[str, Any] = {
            "samples": self.samples,
            "ids_equal_records": f"{self.ids_ok}/{self.samples}",
            "loss_mask_equal_records": f"{self.mask_ok}/{self.samples}",
            "teacher_rms_h_over_w": mean_rms,
            "argmax_next_token": argmax,
            "argmax_positions": self.argmax_total,
        }
        if self.rms_raw:
            out["stored_rms_h_over_w"] = sum(self.rms_raw) / len(self.rms_raw)
        floor = ARGMAX_MIN if self.teacher_kept else ARGMAX_MIN_FP8
        checks = {
            "ids": self.ids_ok == self.samples > 0,
            "loss_mask": self.mask_ok == self.samples,
        }
        if mean_rms is not None:
            aux = self.aux_match / self.aux_total if self.aux_total else 0.0
            out["aux_values_matching_forward"] = aux
            out["aux_values_matching_neighbour_layers"] = (
                self.neighbour_match / self.neighbour_total if self.neighbour_total else None
            )
            checks["rms"] = (not post_norm_claimed) or abs(mean_rms - 1) <= RMS_TOL
            checks["argmax"] = argmax is not None and argmax >= floor
            checks["aux_layers"] = aux >= AUX_MATCH_MIN
        out["checks"] = checks
        out["pass"] = all(checks.values())
        if self.fp8:
            out["tolerances"] = f"fp8: aux rel {AUX_REL_FP8}, argmax >= {floor}"
        return out


def rms_over_weight(h: torch.Tensor, w: torch.Tensor) -> float:
    return float((h.float() / w).pow(2).mean(-1).sqrt().mean())


def check_states(
    tally: Tally,
    target: Target,
    ids: list[int],
    record_mask: list[int],
    teacher: torch.Tensor,
    aux: torch.Tensor,
    capture_ids: list[int],
) -> None:
    """teacher [L, H] as the LM head sees it; aux [L, k*H]; capture_ids: input-of-layer ids."""
    teacher = teacher.float()
    tally.rms.append(rms_over_weight(teacher, target.norm_weight))
    pred = (teacher @ target.head.T).argmax(-1)
    # Position t predicts token t + 1; only generated tokens are the model's own argmax.
    for t in range(len(ids) - 1):
        if record_mask[t + 1] == 1:
            tally.argmax_total += 1
            tally.argmax_hits += int(int(pred[t]) == ids[t + 1])
    ref = target.hidden_states(ids)
    hidden = teacher.shape[-1]
    for k, layer in enumerate(capture_ids):
        block = aux[:, k * hidden : (k + 1) * hidden].float()
        hits, n = matching(block, ref[layer], tally.fp8)
        tally.aux_match += hits
        tally.aux_total += n
        for other in (layer - 1, layer + 1):
            if 0 <= other < len(ref):
                hits, n = matching(block, ref[other], tally.fp8)
                tally.neighbour_match += hits
                tally.neighbour_total += n


def matching(got: torch.Tensor, ref: torch.Tensor, fp8: bool = False) -> tuple[int, int]:
    """Values of `got` equal to `ref` within bf16 (or fp8) rounding (see AUX_REL, AUX_FLOOR)."""
    token_rms = ref.pow(2).mean(-1, keepdim=True).sqrt()
    rel = AUX_REL_FP8 if fp8 else AUX_REL
    ok = (got - ref).abs() <= rel * ref.abs() + AUX_FLOOR * token_rms
    return int(ok.sum()), ok.numel()


def is_fp8(summary: dict) -> bool:
    """The export's own description: fp8 files, or converted from an fp8 store."""
    stored = (summary.get("source_manifest") or {}).get("store_dtype") or {}
    return summary["files"]["dtype"] == "float8_e4m3fn" or "fp8_e4m3" in stored.values()


def teacher_kept(summary: dict) -> bool:
    """The files' final state reads as the plain store's teacher: not quantized at export,
    and in the store either not fp8 or fp8 rounded to keep the argmax (final_rounding)."""
    if summary["files"]["dtype"] == "float8_e4m3fn":
        return False
    source = summary.get("source_manifest") or {}
    final = (source.get("store_dtype") or {}).get("hidden_state")
    return final != "fp8_e4m3" or "argmax_kept" in str(source.get("final_rounding") or "")


def tally_for(summary: dict) -> Tally:
    return Tally(is_fp8(summary), teacher_kept(summary))


def compare(tally: Tally, got_ids: list[int], got_mask: list[int], want: dict[str, Any]) -> None:
    ids = want["prompt_ids"] + want["output_ids"]
    tally.samples += 1
    tally.ids_ok += int(got_ids == ids)
    tally.mask_ok += int(got_mask == want["mask"])


# --------------------------------------------------------------------------- per trainer


def check_specforge(out: Path, summary: dict, records: dict, target: Target) -> dict[str, Any]:
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.config.schema import load_config
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    cfg = load_config(str(out / "specforge_train.yaml"))  # SpecForge's own schema validation
    max_len = cfg.data.max_length
    layers = [i + 1 for i in cfg.model.aux_hidden_state_layer_ids]  # output ids -> input ids
    by_file = {str((out / r["file"]).resolve()): r for r in _index(out)}
    tally, batch = tally_for(summary), []
    for ref in OfflineManifestReader(cfg.data.hidden_states_path, max_len=max_len).read():
        path = ref.feature_store_uri.removeprefix("file://")
        sample = normalize_offline_sample(load_feature_file(path), max_len=max_len)
        batch.append(sample)
        rec = records[by_file[path]["id"]]
        want_mask = list(rec["loss_mask"])
        want_mask[-1] = 0  # SpecForge's normaliser zeroes the last position
        ids = sample["input_ids"][0].tolist()
        compare(tally, ids, sample["loss_mask"][0].tolist(), {**rec, "mask": want_mask})
        check_states(
            tally,
            target,
            ids,
            rec["loss_mask"],
            sample["target"][0],
            sample["hidden_state"][0],
            layers,
        )
    collated = DataCollatorWithPadding()(batch)  # its training batches build from these
    result = tally.result(post_norm_claimed=True)
    result["loader"] = "OfflineManifestReader + normalize_offline_sample + DataCollatorWithPadding"
    result["collated_shapes"] = {k: list(v.shape) for k, v in collated.items() if v is not None}
    result["config"] = {
        "data.max_length": max_len,
        "aux_hidden_state_layer_ids": cfg.model.aux_hidden_state_layer_ids,
        "lm_head_key": cfg.model.lm_head_key,
        "embedding_key": cfg.model.embedding_key,
    }
    return result


def check_speculators(out: Path, summary: dict, records: dict, target: Target) -> dict[str, Any]:
    import argparse

    from hs_connectors import HiddenStatesBackend
    from speculators.train.config import TrainConfig
    from speculators.train.data import ArrowDataset

    layers = summary["conventions"]["capture_layer_ids"]  # --target-layer-ids, as the card says
    index = _index(out)
    longest = summary["tokens"]["max_len"]
    # The card's `speculators train` command, parsed by speculators' own TrainConfig; its
    # --hidden-states-backend picks the transfer that reads the files (fp8: FP8Transfer).
    train = TrainConfig.resolve(card_command(out, "speculators train"))
    args = argparse.Namespace(**train.flatten())
    backend = HiddenStatesBackend.registry[args.hidden_states_backend]
    transfer = backend.from_train_args(args, str(out))
    ds = ArrowDataset(
        max_len=longest,
        datapath=str(out),
        transfer=transfer,
        on_missing="raise",
        train_ratio=1.0,
    )
    tally = tally_for(summary)
    for i in range(len(ds)):
        item = ds[i]
        rec = records[index[i]["id"]]
        ids = item["input_ids"].tolist()
        compare(
            tally,
            ids,
            [int(v) for v in item["loss_mask"].tolist()],
            {**rec, "mask": rec["loss_mask"]},
        )
        raw = item["verifier_last_hidden_states"]
        tally.rms_raw.append(rms_over_weight(raw, target.norm_weight))
        # speculators' trainer: verifier_norm(verifier_last_hidden_states) -> lm_head.
        check_states(
            tally,
            target,
            ids,
            rec["loss_mask"],
            target.apply_norm(raw),
            item["hidden_states"],
            layers,
        )
    result = tally.result(post_norm_claimed=True)
    result["loader"] = (
        f"speculators.train.data.ArrowDataset ({type(transfer).__name__}, on_missing=raise)"
    )
    result["card_command_resolves_to"] = {
        "hidden_states_backend": args.hidden_states_backend,
        "target_layer_ids": train.draft.target_layer_ids,
        "data_path": train.data.data_path,
        "on_missing": train.generation.on_missing,
        "total_seq_len": train.data.total_seq_len,
    }
    result["checks"]["card_command"] = (
        train.draft.target_layer_ids == layers
        and Path(train.data.data_path) == out
        and train.generation.on_missing == "raise"
        and train.data.total_seq_len >= longest
    )
    result["pass"] = all(result["checks"].values())
    return result


def card_command(out: Path, prefix: str) -> list[str]:
    """The arguments of the card's shell command starting with `prefix` (continuations joined)."""
    import shlex

    text = (out / "README.md").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if line.startswith(prefix):
            return shlex.split(line)[len(prefix.split()) :]
    raise ValueError(f"no `{prefix}` command in {out / 'README.md'}")


def check_modelopt(out: Path, summary: dict, records: dict, target: Target) -> dict[str, Any]:
    from modelopt.torch.speculative.eagle.utils import (
        EagleOfflineDataCollator,
        OfflineSupervisedDataset,
    )
    from modelopt.torch.speculative.plugins.hf_training_args import (
        DataArguments,
        TrainingArguments,
    )

    layers = [i + 1 for i in summary["conventions"]["output_layer_ids"]]
    index = _index(out)
    files = [str(out / r["file"]) for r in index]
    ds = OfflineSupervisedDataset(files, answer_only_loss=True)
    plain = OfflineSupervisedDataset(files, answer_only_loss=False)
    tally, batch = tally_for(summary), []
    ones = 0
    for i in range(len(ds)):
        item = ds[i]
        batch.append(item)
        rec = records[index[i]["id"]]
        ids = item["input_ids"].tolist()
        compare(tally, ids, item["loss_mask"].tolist(), {**rec, "mask": rec["loss_mask"]})
        ones += int(bool((plain[i]["loss_mask"] == 1).all()))
        assert item["base_hidden_prenorm"] is False
        check_states(
            tally,
            target,
            ids,
            rec["loss_mask"],
            item["base_model_hidden_states"],
            item["aux_hidden_states"],
            layers,
        )
    collated = EagleOfflineDataCollator(train_len=summary["tokens"]["max_len"])(batch)
    result = tally.result(post_norm_claimed=True)
    # The card's recipe overrides, through ModelOpt's own argument models.
    data_args = DataArguments(offline_data_path=str(out))
    train_args = TrainingArguments(
        answer_only_loss=True, training_seq_len=summary["tokens"]["max_len"]
    )
    result["checks"]["recipe_args"] = data_args.mode == "offline" and train_args.answer_only_loss
    result["pass"] = all(result["checks"].values())
    result["loader"] = "OfflineSupervisedDataset(answer_only_loss=True) + EagleOfflineDataCollator"
    result["answer_only_loss_false_gives_all_ones"] = f"{ones}/{len(ds)}"
    result["collated_keys"] = sorted(collated)
    return result


def check_tokens(out: Path, summary: dict, records: dict, target: Target) -> dict[str, Any]:
    from datasets import load_dataset
    from specforge.data.prompt_builder import prepare_prompt_tasks
    from speculators.data_generation.preprocessing import build_speculator_training_dataset

    path = out / "tokens.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    longest = summary["tokens"]["max_len"]
    raw = load_dataset("json", data_files=str(path), split="train")
    spec = build_speculator_training_dataset(raw, processor=None, max_length=longest, num_proc=1)
    sf = prepare_prompt_tasks(
        path,
        None,  # no tokenizer: pre-tokenized rows never reach it
        chat_template=None,
        max_length=longest,
        is_preformatted=False,
        train_only_last_turn=False,
        cache_dir=None,
        cache_key=None,
        num_proc=None,
    )
    result: dict[str, Any] = {"samples": len(rows)}
    for name, got in (
        (
            "speculators prepare_data pass-through",
            [(r["input_ids"].tolist(), r["loss_mask"].tolist()) for r in spec],
        ),
        (
            "SpecForge prepare_prompt_tasks",
            [(t["payload"]["input_ids"], t["payload"]["loss_mask"]) for t in sf],
        ),
    ):
        tally = Tally()
        for (ids, mask), row in zip(got, rows, strict=True):
            rec = records[row["id"]]
            compare(tally, ids, mask, {**rec, "mask": rec["loss_mask"]})
        result[name] = tally.result(post_norm_claimed=False)
    result["checks"] = {k: v["pass"] for k, v in result.items() if isinstance(v, dict)}
    result["pass"] = all(result["checks"].values())
    return result


CHECKS = {
    "specforge": check_specforge,
    "speculators": check_speculators,
    "modelopt": check_modelopt,
    "tokens": check_tokens,
}


def _index(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "export_index.jsonl").read_text().splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exports", type=Path, required=True)
    ap.add_argument("--records", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    records = load_records(args.records)
    target = Target(args.model)
    results: dict[str, Any] = {}
    failed: list[str] = []
    for out in sorted(p.parent for p in args.exports.glob("*/export_summary.json")):
        summary = json.loads((out / "export_summary.json").read_text())
        fmt = summary["format"]
        try:
            res = CHECKS[fmt](out, summary, records, target)
        except Exception as exc:  # noqa: BLE001 - a loader failure is a result, reported
            res = {"pass": False, "error": f"{type(exc).__name__}: {exc}"}
        res["format"] = fmt
        results[out.name] = res
        wrong = out.name.startswith("wrong-")
        verdict = (
            ("CAUGHT" if not res["pass"] else "MISSED")
            if wrong
            else ("PASS" if res["pass"] else "FAIL")
        )
        res["verdict"] = verdict
        if verdict in ("FAIL", "MISSED"):
            failed.append(out.name)
        print(f"{out.name:28s} {fmt:12s} {verdict}")
        print(
            json.dumps({k: v for k, v in res.items() if k not in ("format", "verdict")}, indent=2)
        )
    (args.exports / "interop.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\ninterop: {len(results)} exports checked; failed: {failed or 'none'}")
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
