"""The target's LM head read from its checkpoint (for a backend whose engine hides it).

An fp8 store keeps the teacher's argmax with the head (kimi_pipe.store.teacher_rounding). The
`hf` backend has the head in memory; an engine such as SGLang shards it across ranks, so the
head is read from the safetensors files: the tensor named `*lm_head.weight`, or, when the
config ties the embeddings, `*embed_tokens.weight`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kimi_pipe.errors import ConfigError, MissingFile


def _tied(config: dict[str, object]) -> bool:
    text = config.get("text_config")
    sections = [text, config] if isinstance(text, dict) else [config]
    return any(bool(s.get("tie_word_embeddings")) for s in sections)


def _weight_files(model_dir: Path) -> dict[str, str]:
    """tensor name -> file name, from the index or the single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise MissingFile(
            f"{model_dir} has neither model.safetensors.index.json nor model.safetensors: "
            "the LM head cannot be read (set extract.final_fp8_rounding=nearest to store fp8 "
            "without it)"
        )
    with safe_open(str(single), framework="pt") as f:
        return {name: single.name for name in f.keys()}  # noqa: SIM118 (not iterable)


def head_tensor_name(names: list[str], tied: bool) -> str:
    """The one tensor that is the LM head; a clear error when there is none or several."""
    for suffix in ("lm_head.weight", "embed_tokens.weight") if tied else ("lm_head.weight",):
        found = [n for n in names if n == suffix or n.endswith("." + suffix)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise ConfigError(f"several LM-head tensors in the checkpoint: {sorted(found)}")
    raise ConfigError(
        "no LM-head tensor (lm_head.weight, or embed_tokens.weight with tied embeddings) in the "
        "checkpoint; set extract.final_fp8_rounding=nearest"
    )


def read_output_head(model_dir: str | Path, device: str = "cpu") -> torch.Tensor:
    """The LM head [vocab, H] in float32 on `device`."""
    path = Path(model_dir)
    config_path = path / "config.json"
    if not config_path.exists():
        raise MissingFile(f"{config_path} not found: the target's checkpoint directory")
    files = _weight_files(path)
    name = head_tensor_name(sorted(files), _tied(json.loads(config_path.read_text())))
    with safe_open(str(path / files[name]), framework="pt") as f:
        return f.get_tensor(name).to(device=device, dtype=torch.float32)
