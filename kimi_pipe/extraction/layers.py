"""EAGLE-3 layer ids: the one place that states how the conventions map onto each other.

Three names for the same captured tensor (N = number of decoder layers, 0-based layers):

* "output of layer" id ``i`` (SpecForge, ModelOpt, our manifests): what decoder layer ``i``
  returns (hidden + residual).
* SGLang capture id ``i + 1``: SGLang's ``set_eagle3_layers_to_capture`` records
  ``hidden_states + residual`` at the *input* of layer ``i + 1``, which is the same tensor.
* transformers ``output_hidden_states`` index ``i + 1`` (index 0 is the embeddings).

So capture id == hidden_states index == output-of-layer id + 1. For Kimi K2.5 (N = 61) the
default output-of-layer ids ``[1, 29, 57]`` are SGLang capture ids ``[2, 30, 58]``.
The output of the last layer (i = N - 1) has no "input of layer N" and is not capturable as
an auxiliary state: the final state is taken after the last norm instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kimi_pipe.store.hidden_store import default_layer_ids

# The single statement of the mapping: SGLang captures at the input of the next layer.
CAPTURE_OFFSET = 1


def output_to_capture_ids(output_ids: Sequence[int]) -> list[int]:
    """ "Output of layer" ids -> SGLang capture ids (input of the next layer)."""
    return [int(i) + CAPTURE_OFFSET for i in output_ids]


def capture_to_output_ids(capture_ids: Sequence[int]) -> list[int]:
    """SGLang capture ids -> "output of layer" ids."""
    return [int(i) - CAPTURE_OFFSET for i in capture_ids]


def validate_output_ids(output_ids: Sequence[int], num_layers: int) -> list[int]:
    """Check ids are distinct, ascending and capturable in a model of `num_layers` layers."""
    ids = [int(i) for i in output_ids]
    if not ids:
        raise ValueError("layer_ids is empty; EAGLE-3 needs the low, middle and high layer")
    if ids != sorted(set(ids)):
        raise ValueError(f"layer_ids {ids} must be distinct and ascending")
    last = num_layers - 1 - CAPTURE_OFFSET
    bad = [i for i in ids if i < 0 or i > last]
    if bad:
        raise ValueError(
            f"layer_ids {bad} out of range for a {num_layers}-layer model: "
            f"'output of layer' ids must be in 0..{last} (layer {num_layers - 1}'s output "
            "is the final state, stored after the last norm)"
        )
    return ids


def resolve_output_ids(
    configured: Sequence[int] | None,
    num_layers: int,
    model_cfg: Mapping[str, Any] | None = None,
) -> list[int]:
    """Pick the layer ids: extract config, else the model config's `eagle3.layer_ids`,
    else the default rule [1, N//2 - 1, N - 4]. All are "output of layer" ids."""
    ids: Sequence[int] | None = configured
    if ids is None and model_cfg is not None:
        eagle3 = model_cfg.get("eagle3") or {}
        ids = eagle3.get("layer_ids")
    if ids is None:
        ids = default_layer_ids(num_layers)
    return validate_output_ids(list(ids), num_layers)
