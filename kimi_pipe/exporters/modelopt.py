"""NVIDIA ModelOpt's offline dumps: `{i}.pt` read by its `OfflineSupervisedDataset`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kimi_pipe.exporters.base import ExportContext, Exporter, save_torch
from kimi_pipe.store.conventions import POST_NORM


def modelopt_path(output: Path, index: int) -> Path:
    return output / f"{index}.pt"


class ModelOptExporter(Exporter):
    name = "modelopt"
    title = "NVIDIA ModelOpt offline dumps"
    # lm_head(hidden_states) unless the dump says hidden_states_prenorm
    final_state = POST_NORM

    def sample_path(self, output: Path, index: int) -> Path:
        return modelopt_path(output, index)

    def write_sample(self, output: Path, index: int, sample: dict[str, torch.Tensor]) -> None:
        save_torch(
            self.sample_path(output, index),
            {
                "input_ids": sample["input_ids"].to(torch.int64).clone(),
                "hidden_states": sample["hidden_state"].clone(),
                "aux_hidden_states": sample["aux_hidden_state"].clone(),
                # Read only with answer_only_loss=True; otherwise ModelOpt trains on every token.
                "loss_mask": sample["loss_mask"].to(torch.int64).clone(),
                # ModelOpt re-applies the final norm when this is True; the state is post-norm.
                "hidden_states_prenorm": False,
            },
        )

    def files(self, ctx: ExportContext) -> dict[str, Any]:
        h = ctx.manifest["hidden_size"]
        aux_h = ctx.manifest["aux_hidden_size"]
        dtype = ctx.manifest["dtype"]
        return {
            "files": "{i}.pt",
            "compression": None,
            "tensors": {
                "input_ids": ["L", "int64"],
                "hidden_states": [f"L, {h}", dtype],
                "aux_hidden_states": [f"L, {aux_h}", dtype],
                "loss_mask": ["L", "int64"],
            },
            # ModelOpt re-applies the final norm when this flag is True.
            "flags": {"hidden_states_prenorm": False},
            **self.states_description(ctx, dtype),
        }

    def card_layout(self, summary: dict[str, Any]) -> list[str]:
        f = summary["files"]
        t = f["tensors"]
        return [
            "Every `{i}.pt` is a `torch.save` dict read by ModelOpt's `OfflineSupervisedDataset`:",
            f"`input_ids` [L] int64, `hidden_states` [{t['hidden_states'][0]}] (post-norm),",
            f"`aux_hidden_states` [{t['aux_hidden_states'][0]}] ({f['dtype']}), `loss_mask` [L]",
            "int64 and `hidden_states_prenorm` = False.",
        ]

    def card_training(self, summary: dict[str, Any]) -> list[str]:
        out = summary["output"]
        model = summary.get("target_model_path") or "TARGET_MODEL_DIR"
        longest = summary["tokens"]["max_len"]
        output_ids = summary["conventions"]["output_layer_ids"]
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
