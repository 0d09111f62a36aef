"""`extract.backend=hf`: EAGLE-3 states from a transformers forward pass (CPU or GPU).

Captured per token:
* aux_hidden_state [L, 3H]: "output of layer" ids (default [1, N//2 - 1, N - 4]) taken from
  `output_hidden_states`, where hidden_states[i + 1] is what decoder layer i returns;
* hidden_state [L, H]: `final_state=pre_norm` (conf default): the input of the final norm (the
  last layer's output), with the norm's weight and eps in the manifest (`final_norm`) so that
  export computes the post-norm state exactly (kimi_pipe.store.conventions);
  `final_state=post_norm`: the base model's `last_hidden_state`, i.e. after the final norm.

Only the text decoder (`model.get_decoder()`) runs: the LM head's [L, vocab] logits are never
built. A checkpoint whose class is a wrapper around a text model (a vision-language model such
as Kimi K2.5: `KimiK25ForConditionalGeneration` around DeepSeek-V3) is loaded with its own
class (`AutoModelForImageTextToText`) and its text decoder runs alone, on token ids only.
Batches are right-padded with an attention mask; padding never changes the real rows of a
causal model because a real token never attends to a later position.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kimi_pipe.errors import ConfigError, MissingFile
from kimi_pipe.extraction.draft_config import capture_request, draft_config_paths, record_drafts
from kimi_pipe.extraction.job import ExtractJob
from kimi_pipe.extraction.layers import resolve_output_ids
from kimi_pipe.extraction.resolve import HFSuffixScorer
from kimi_pipe.store.conventions import POST_NORM, PRE_NORM, final_norm_spec, rms_norm
from kimi_pipe.store.hidden_store import DTYPES, torch_dtype
from kimi_pipe.store.local_model import LocalModelSpec, ensure_local_model


def resolve_model_path(job: ExtractJob) -> Path:
    """Weights directory: `extract.model_path`, else the model config's `hf_weights`, else its
    `local_model` (a GGUF in a pip package, converted once by `kimi_pipe.store.local_model`)."""
    path = job.get("model_path")
    if path is None:
        path = job.hf_weights
        local = (job.model or {}).get("local_model")
        if local is not None and (path is None or not (Path(path) / "config.json").exists()):
            spec = LocalModelSpec.from_cfg(local)
            path = ensure_local_model(spec)  # converts once, then cached
    if path is None:
        raise ConfigError(
            "extract.backend=hf needs the target model's transformers weights: set "
            "extract.model_path=DIR (a directory with config.json + weights) or "
            "model.hf_weights in conf/model/<model>.yaml"
        )
    path = Path(str(path)).expanduser()
    if not (path / "config.json").exists():
        raise MissingFile(
            f"{path / 'config.json'} not found: extract.model_path must be a transformers model "
            "directory (download the model's weights there, or for the demo model run "
            "`python -m kimi_pipe.store.local_model`)"
        )
    return path


def load_text_model(
    model_path: str | os.PathLike[str], dtype: str = "float32", trust_remote_code: bool = False
) -> Any:
    """The model with its LM head: a causal LM class, else (a checkpoint whose config is a
    wrapper that transformers maps to no causal LM class, such as a vision-language model) the
    wrapper's own image-text-to-text class, whose text decoder and head are the target's."""
    from transformers import (  # heavy import, only when used
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
    )

    try:
        config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    except ValueError:
        # A wrapper type this transformers does not know (Kimi K2.5 before transformers had
        # its classes): its text model alone, if transformers knows that one.
        wrapped = load_wrapped_text_model(model_path, dtype)
        if wrapped is None:
            raise
        return wrapped
    auto: Any = AutoModelForCausalLM
    if type(config) not in AutoModelForCausalLM._model_mapping and not (
        trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    ):
        if type(config) not in AutoModelForImageTextToText._model_mapping:
            raise ConfigError(
                f"{model_path}: transformers has no causal LM or image-text-to-text class for "
                f"{type(config).__name__}; set extract.trust_remote_code=true only for a model "
                "whose code you trust, or use extract=sglang"
            )
        auto = AutoModelForImageTextToText
    return auto.from_pretrained(
        str(model_path),
        config=config,
        dtype=torch_dtype(dtype),
        trust_remote_code=trust_remote_code,
    )


def load_wrapped_text_model(model_path: str | os.PathLike[str], dtype: str = "float32") -> Any:
    """The text model of a wrapper checkpoint, by transformers' own class for it: config.json's
    `text_config.architectures[0]` (Kimi K2.5: `DeepseekV3ForCausalLM`), its weights read from
    the checkpoint's names less the wrapper's prefix (the one before `model.embed_tokens.weight`,
    e.g. `language_model.`). None when the checkpoint is not such a wrapper or transformers has
    no such class. The wrapper's other parts (a vision tower) are not loaded."""
    import transformers  # heavy import, only when used

    path = Path(model_path)
    raw = json.loads((path / "config.json").read_text())
    text = raw.get("text_config")
    archs = text.get("architectures") if isinstance(text, dict) else None
    cls = getattr(transformers, str(archs[0]), None) if archs else None
    if cls is None or not hasattr(cls, "config_class"):
        return None
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = list(json.loads(index.read_text())["weight_map"])
    else:
        from safetensors import safe_open  # with torch

        names = []
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                names.extend(f.keys())
    embed = "model.embed_tokens.weight"
    prefixes = {n[: -len(embed)] for n in names if n.endswith(embed)}
    if len(prefixes) != 1:
        return None
    prefix = prefixes.pop()
    config = cls.config_class.from_dict({k: v for k, v in text.items() if k != "model_type"})
    return cls.from_pretrained(
        str(path),
        config=config,
        dtype=torch_dtype(dtype),
        key_mapping={f"^{re.escape(prefix)}": ""} if prefix else None,
    )


class HFBackend:
    """Holds the model; `forward` returns (aux [L, 3H], final [L, H]) per sequence."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        dtype: str = "float32",
        store_dtype: str | None = None,
        device: str = "cpu",
        layer_ids: list[int] | None = None,
        model_cfg: Mapping[str, Any] | None = None,
        trust_remote_code: bool = False,
        model_name: str | None = None,
        final_state: str = POST_NORM,
    ) -> None:
        self.device = torch.device(device)
        self.model = load_text_model(model_path, dtype, trust_remote_code).to(self.device)
        self.model.eval()
        # The text decoder alone: skips the LM head (Kimi's vocab is 163840 wide) and, in a
        # wrapper, the vision tower (get_decoder() is the base model of a plain causal LM).
        self.decoder = self.model.get_decoder()
        config = self.model.config.get_text_config()
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.layer_ids = resolve_output_ids(layer_ids, self.num_layers, model_cfg)
        self.pad_id = 0  # any valid id: padded positions are masked out and cut off
        if final_state not in (PRE_NORM, POST_NORM):
            raise ValueError(
                f"extract.final_state must be pre_norm or post_norm, not {final_state!r}"
            )
        self.final_state = final_state
        extra: dict[str, Any] = {"compute_dtype": dtype, "model_path": str(model_path)}
        self._pre_norm: torch.Tensor | None = None
        if final_state == PRE_NORM:
            norm = self._final_norm()
            eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
            extra["final_norm"] = final_norm_spec(norm.weight, float(eps), "norm")  # type: ignore[arg-type]
            # The norm's input is the last layer's output: keep it as the final state.
            norm.register_forward_pre_hook(self._keep_pre_norm)
        self.store_fields: dict[str, Any] = {
            "model": model_name or Path(model_path).name,
            "num_layers": self.num_layers,
            "layer_ids": self.layer_ids,
            "hidden_size": self.hidden_size,
            "dtype": store_dtype or dtype,
            "layer_convention": "output_of_layer",
            "final_state": final_state,
            "extra": extra,
        }

    def _final_norm(self) -> torch.nn.Module:
        """The decoder's final norm, which must be an RMSNorm (weight + eps) to be stored."""
        norm = getattr(self.decoder, "norm", None)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        weight = getattr(norm, "weight", None)
        if norm is None or eps is None or not isinstance(weight, torch.Tensor):
            raise ValueError(
                f"extract.final_state=pre_norm: {type(self.decoder).__name__} has no final "
                "RMSNorm at `.norm` (weight + eps) to record; use extract.final_state=post_norm"
            )
        # Export recomputes the norm from (weight, eps): prove on random rows that the formula
        # is this module's (a Gemma-style (1 + weight) norm, a LayerNorm ... would not be).
        probe = torch.randn(4, weight.numel(), generator=torch.Generator().manual_seed(0))
        spec = final_norm_spec(weight, float(eps), "norm")
        with torch.no_grad():
            expected = norm(probe.to(weight.device, weight.dtype)).float().cpu()
        if not torch.allclose(
            rms_norm(probe.to(weight.dtype), spec), expected, rtol=1e-2, atol=1e-3
        ):
            raise ValueError(
                f"extract.final_state=pre_norm: the final norm {type(norm).__name__} is not "
                "x * rsqrt(mean(x^2) + eps) * weight, so export could not recompute it; use "
                "extract.final_state=post_norm"
            )
        return norm

    def _keep_pre_norm(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self._pre_norm = args[0]

    @torch.inference_mode()
    def forward(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        lengths = [len(seq) for seq in batch]
        longest = max(lengths)
        ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        out = self.decoder(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            # Ask only for the layers we keep: index i + 1 is the output of layer i.
            output_hidden_states=[i + 1 for i in self.layer_ids],
            use_cache=False,
        )
        aux = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        final = out.last_hidden_state
        if self.final_state == PRE_NORM:
            if self._pre_norm is None:
                raise RuntimeError("the final norm did not run; cannot take its input")
            final, self._pre_norm = self._pre_norm, None
        return [
            (aux[row, :n].float().cpu(), final[row, :n].float().cpu())
            for row, n in enumerate(lengths)
        ]

    def output_head(self) -> torch.Tensor:
        """The LM head's weight [vocab, H] in float32: the teacher the fp8 store keeps."""
        head = self.model.get_output_embeddings()
        if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
            raise ConfigError(
                f"{type(self.model).__name__} has no output embeddings to keep the teacher "
                "with; set extract.final_fp8_rounding=nearest"
            )
        return head.weight.detach().float()

    def suffix_scorer(self) -> HFSuffixScorer:
        """Target resolution's scorer on the same weights (extraction.resolve)."""
        return HFSuffixScorer(self.model, str(self.store_fields["model"]), self.device)

    def close(self) -> None:
        del self.model, self.decoder
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class HFSettings:
    """What conf/extract/hf.yaml says about this backend, typed once from the job (the capture
    loop's keys, such as batch_tokens, are the job's; a backend of your own reads its keys from
    `job.settings`)."""

    device: str = "cpu"  # a torch device: cpu | cuda | cuda:N (`auto` is resolved by from_job)
    dtype: str = "float32"  # compute dtype
    store_dtype: str | None = None  # None: the compute dtype
    threads: int | None = None  # torch CPU threads; None: torch's default
    trust_remote_code: bool = False
    final_state: str = POST_NORM
    layer_ids: tuple[int, ...] | None = None
    draft_config: tuple[str, ...] = ()  # the drafters' config files (draft_config.py)
    draft_engine: str = "sglang"

    def __post_init__(self) -> None:
        if self.final_state not in (PRE_NORM, POST_NORM):
            raise ConfigError(
                f"extract.final_state must be {PRE_NORM} or {POST_NORM}, not {self.final_state!r}"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"extract.dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        try:
            torch.device(self.device)
        except RuntimeError:
            raise ConfigError(
                f"extract.device must be cpu, cuda, cuda:N or auto, not {self.device!r}"
            ) from None
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"extract.threads must be >= 1 or null, not {self.threads}")

    @classmethod
    def from_job(cls, job: ExtractJob) -> HFSettings:
        device = str(job.get("device") or "cpu")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        trust = job.get("trust_remote_code", False)
        if not isinstance(trust, bool):
            raise ConfigError(f"extract.trust_remote_code must be true or false, not {trust!r}")
        store = job.get("store_dtype")
        return cls(
            device=device,
            dtype=str(job.get("dtype", "float32")),
            store_dtype=None if store is None else str(store),
            threads=_int_or_none(job, "threads") or None,  # 0 meant the default, as null
            trust_remote_code=trust,
            final_state=str(job.get("final_state") or POST_NORM),
            layer_ids=_ints_or_none(job.get("layer_ids")),
            draft_config=tuple(draft_config_paths(job.get("draft_config"))),
            draft_engine=str(job.get("draft_engine") or "sglang"),
        )


def _int_or_none(job: ExtractJob, key: str) -> int | None:
    value = job.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit():
        raise ConfigError(f"extract.{key} must be a whole number or null, not {value!r}")
    return int(value)


def _ints_or_none(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(f"extract.layer_ids must be a list of layer numbers, not {value!r}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ConfigError(f"extract.layer_ids must be a list of layer numbers, not {value!r}")
    return tuple(value)


def open_backend(job: ExtractJob) -> HFBackend:
    """Build the backend from the job's `extract.*` settings (see conf/extract/hf.yaml)."""
    settings = HFSettings.from_job(job)
    layer_ids, drafts = capture_request(
        settings.layer_ids, list(settings.draft_config), settings.draft_engine
    )
    if settings.threads:
        torch.set_num_threads(settings.threads)
    backend = HFBackend(
        resolve_model_path(job),
        dtype=settings.dtype,
        store_dtype=settings.store_dtype,
        device=settings.device,
        layer_ids=list(layer_ids) if layer_ids is not None else None,
        model_cfg=job.model,
        trust_remote_code=settings.trust_remote_code,
        model_name=job.model_name,
        final_state=settings.final_state,
    )
    record_drafts(backend.store_fields, drafts, backend.num_layers)
    return backend
