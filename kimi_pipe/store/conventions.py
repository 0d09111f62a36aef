"""What a store's final state is, and the one exact conversion between conventions.

A store keeps the last layer's output either after the final norm (`post_norm`, what SpecForge
and ModelOpt train on: their teacher is a bare `lm_head`) or before it (`pre_norm`, what
speculators trains on: its trainer applies the verifier's norm itself). Post-norm cannot be
turned back into pre-norm (the norm drops each row's scale), but pre-norm becomes post-norm
when the store also keeps the final norm's weight and eps (manifest key `final_norm`). So a
`pre_norm` store with `final_norm` serves every trainer at no extra disk per token; a
`post_norm` store serves only the post-norm trainers, and an export that needs pre-norm from it
is refused.

`final_norm` (JSON, in the manifest)::

    {"type": "rms_norm", "eps": 1e-05, "weight": [H floats], "module": "model.norm"}

`rms_norm` is x * rsqrt(mean(x^2) + eps) * weight, computed in float32 like transformers'
Llama / DeepSeek-V3 RMSNorm.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kimi_pipe.errors import ConfigError, StoreError

POST_NORM = "post_norm"
PRE_NORM = "pre_norm"
FINAL_NORM_TYPES = ("rms_norm",)


class ConventionError(StoreError, ValueError):
    """The store cannot be exported in the convention a trainer needs."""


def final_norm_spec(weight: torch.Tensor, eps: float, module: str) -> dict[str, Any]:
    """The manifest's `final_norm` entry for an RMSNorm with this weight and eps.

    The weight is kept as float32 values: JSON floats round-trip a float32 (or bf16) exactly.
    """
    return {
        "type": "rms_norm",
        "eps": float(eps),
        "weight": [float(v) for v in weight.detach().float().cpu().reshape(-1).tolist()],
        "module": module,
    }


def _check_norm_spec(spec: Mapping[str, Any], hidden_size: int | None) -> None:
    if spec.get("type") not in FINAL_NORM_TYPES:
        raise ConventionError(
            f"final_norm type {spec.get('type')!r} is not supported (known: {FINAL_NORM_TYPES})"
        )
    weight = spec.get("weight")
    if not isinstance(weight, list) or not isinstance(spec.get("eps"), (int, float)):
        raise ConventionError("final_norm needs a 'weight' list and a numeric 'eps'")
    if hidden_size is not None and len(weight) != hidden_size:
        raise ConventionError(
            f"final_norm weight has {len(weight)} values, the store's hidden size is {hidden_size}"
        )


def rms_norm(pre: torch.Tensor, spec: Mapping[str, Any]) -> torch.Tensor:
    """Apply the stored final norm to pre-norm states; float32 result."""
    _check_norm_spec(spec, int(pre.shape[-1]))
    weight = torch.tensor(spec["weight"], dtype=torch.float32)
    x = pre.float()
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + float(spec["eps"])))


def final_state_conversion(manifest: Mapping[str, Any], want: str) -> str:
    """How to get `want` from this store: "as_is" or "apply_norm"; else ConventionError.

    Called before anything is written, so an impossible export fails at once.
    """
    have = manifest.get("final_state")
    if want not in (PRE_NORM, POST_NORM):
        raise ConfigError(f"unknown final state {want!r}")
    if have == want:
        return "as_is"
    if have == PRE_NORM and want == POST_NORM:
        spec = manifest.get("final_norm")
        if not spec:
            raise ConventionError(
                "the store holds the pre-norm final state without the final norm's weight "
                "(manifest key final_norm), and this trainer needs the post-norm state. "
                "Re-extract with extract.final_state=pre_norm on the current code (it records "
                "the norm), or with extract.final_state=post_norm."
            )
        _check_norm_spec(spec, manifest.get("hidden_size"))
        return "apply_norm"
    if have == POST_NORM and want == PRE_NORM:
        raise ConventionError(
            "the store holds the post-norm final state and this trainer needs the pre-norm one "
            "(it applies the norm itself); post-norm cannot be undone. Re-extract with "
            "extract.final_state=pre_norm (python -m kimi_pipe extract)."
        )
    raise ConventionError(
        f"unknown final_state {have!r} in the store manifest; expected 'pre_norm' or 'post_norm'"
    )


def final_state_as(manifest: Mapping[str, Any], final: torch.Tensor, want: str) -> torch.Tensor:
    """The store's final state [L, H] in convention `want`, in the store's dtype."""
    if final_state_conversion(manifest, want) == "as_is":
        return final
    return rms_norm(final, manifest["final_norm"]).to(final.dtype)
