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
an auxiliary state: the final state is the last layer's output before (pre_norm) or after
(post_norm) the final norm, as the store's manifest says.

What a drafter config's `eagle_aux_hidden_state_layer_ids` means depends on the serving engine:

* SGLang (since PR 25454): ids whose first element is 1 are "output of layer" ids and get + 1;
  any other list is taken as capture (input of layer) ids as given.
* vLLM (and speculators' `--target-layer-ids`): the ids are capture (input of layer) ids, as
  given; vLLM's default is ``[2, N//2, N - 3]``.

So for Kimi K2.5 (output ids ``[1, 29, 57]``) a config naming ``[1, 29, 57]`` is right in
SGLang and off by one in vLLM; naming the capture ids ``[2, 30, 58]`` is right in both (SGLang
leaves a list not starting with 1 alone); naming none uses each engine's default, also right.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kimi_pipe.errors import ConfigError
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
        raise ConfigError("layer_ids is empty; EAGLE-3 needs the low, middle and high layer")
    if ids != sorted(set(ids)):
        raise ConfigError(f"layer_ids {ids} must be distinct and ascending")
    last = num_layers - 1 - CAPTURE_OFFSET
    bad = [i for i in ids if i < 0 or i > last]
    if bad:
        raise ConfigError(
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


# --------------------------------------------------------------------------- serving engines

ENGINES = ("sglang", "vllm")


def sglang_config_to_capture_ids(config_ids: Sequence[int]) -> list[int]:
    """What SGLang captures for a drafter config's ids: + 1 only when the first id is 1."""
    ids = [int(i) for i in config_ids]
    if ids and ids[0] == 1:
        return [i + CAPTURE_OFFSET for i in ids]
    return ids


def vllm_config_to_capture_ids(config_ids: Sequence[int]) -> list[int]:
    """What vLLM captures for a drafter config's ids: the ids as given (input of layer)."""
    return [int(i) for i in config_ids]


def engine_capture_ids(config_ids: Sequence[int], engine: str) -> list[int]:
    """Capture (input of layer) ids an engine uses for the ids a drafter config names."""
    if engine == "sglang":
        return sglang_config_to_capture_ids(config_ids)
    if engine == "vllm":
        return vllm_config_to_capture_ids(config_ids)
    raise ConfigError(f"unknown serving engine {engine!r}; choose one of {list(ENGINES)}")


def drafter_config_ids(output_ids: Sequence[int], engine: str) -> list[int]:
    """The ids a drafter config must name so `engine` captures the outputs of `output_ids`."""
    want = output_to_capture_ids(output_ids)
    # Capture ids are right for both engines unless they start with 1 (SGLang would add 1).
    if engine == "sglang" and want and want[0] == 1:
        raise ConfigError(
            f"SGLang cannot be told to capture the output of layer 0 ({list(output_ids)}): "
            "a config list starting with 1 is read as 'output of layer' ids"
        )
    if engine not in ENGINES:
        raise ConfigError(f"unknown serving engine {engine!r}; choose one of {list(ENGINES)}")
    return want


def manifest_output_ids(manifest: Mapping[str, Any]) -> list[int]:
    """A store's aux layer ids in the "output of layer" convention, whatever it recorded."""
    ids = [int(i) for i in manifest["layer_ids"]]
    convention = manifest.get("layer_convention")
    if convention == "output_of_layer":
        return ids
    if convention == "input_of_layer":
        out = capture_to_output_ids(ids)
        if min(out, default=0) < 0:
            raise ConfigError(
                f"layer_ids {ids} (input_of_layer) include layer 0's input, the embeddings: "
                "no EAGLE-3 trainer names that as an auxiliary layer"
            )
        return out
    raise ConfigError(
        f"unknown layer_convention {convention!r} in the store manifest; expected "
        "'output_of_layer' or 'input_of_layer' (re-extract with python -m kimi_pipe extract)"
    )
