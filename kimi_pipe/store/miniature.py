"""A miniature of a real checkpoint: its config.json structure and tensor names, its depth, a
tiny width, random weights; made here from a spec, nothing downloaded.

The spec is data (`conf/miniature/<name>.yaml`): the real config as published, what the
miniature shrinks, what it drops, every tensor's checkpoint name and shape (expressions over the
shrunk config), how values are drawn and which shard holds what. This module knows no model:
it evaluates the spec and writes a transformers-style directory (`config.json`, sharded
safetensors, `model.safetensors.index.json`, `miniature.json` with the spec's digest and the
weights' sha256). Every tensor's values come from its own generator, seeded by the spec's seed
and the tensor's name, so the same spec gives the same bytes whatever the order.

    python -m kimi_pipe.store.miniature kimi_k25 OUT_DIR
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import operator
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kimi_pipe.config import CONF_DIR
from kimi_pipe.errors import EXIT_USER_ERROR, ConfigError
from kimi_pipe.store import atomic

MARKER = "miniature.json"  # written last: its presence means the directory is whole
SPEC_DIR = CONF_DIR / "miniature"

_OPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}


def load_spec(name_or_path: str | Path, variant: str | None = None) -> dict[str, Any]:
    """The spec as a plain dict: `conf/miniature/<name>.yaml`, or a path to a YAML file; with
    `variant`, that entry of its `variants` merged over its `shrink` (and into its name)."""
    path = Path(name_or_path)
    if not path.suffix:
        path = SPEC_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in SPEC_DIR.glob("*.yaml"))
        raise ConfigError(f"no miniature spec {str(name_or_path)!r}; known: {known}")
    spec = yaml.safe_load(path.read_text(encoding="utf-8"))  # plain YAML: anchors, no interpolation
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: a miniature spec is a mapping")
    for key in ("name", "seed", "dtype", "config", "tensors", "init"):
        if key not in spec:
            raise ConfigError(f"{path}: the miniature spec needs `{key}`")
    out = {str(k): v for k, v in spec.items()}
    variants = out.pop("variants", None) or {}
    if variant is not None:
        if variant not in variants:
            raise ConfigError(f"{path}: no variant {variant!r}; known: {sorted(variants)}")
        out["shrink"] = _merge(copy.deepcopy(out.get("shrink") or {}), variants[variant])
        out["name"] = f"{out['name']}-{variant}"
    return out


def spec_digest(spec: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def miniature_config(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The real config with the spec's `shrink` merged in and its `drop` keys removed."""
    config = _merge(copy.deepcopy(dict(spec["config"])), spec.get("shrink") or {})
    for dotted in spec.get("drop") or []:
        *parents, last = str(dotted).split(".")
        node: Any = config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return config


def evaluate(expr: int | str, names: Mapping[str, Mapping[str, Any]]) -> int:
    """An integer expression over `text.*`/`vision.*` fields: + - * // on ints, nothing else."""
    if isinstance(expr, int):
        return expr

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in names
        ):
            value = names[node.value.id].get(node.attr)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{expr!r}: {node.value.id}.{node.attr} is not an integer")
            return value
        raise ConfigError(f"shape expression {expr!r}: only integers, fields and + - * //")

    return walk(ast.parse(str(expr), mode="eval"))


def tensor_shapes(spec: Mapping[str, Any]) -> dict[str, tuple[list[int], str | None, float | None]]:
    """Every tensor of the miniature: name -> (shape, dtype or None, std or None)."""
    config = miniature_config(spec)
    text = config.get("text_config") or {}
    vision = config.get("vision_config") or {}
    names = {"text": text, "vision": vision}
    n_layers = int(text["num_hidden_layers"])
    n_dense = int(text.get("first_k_dense_replace") or 0)
    layer_sets = {
        "all": range(n_layers),
        "dense": range(min(n_dense, n_layers)),
        "moe": range(n_dense, n_layers),
    }
    out: dict[str, tuple[list[int], str | None, float | None]] = {}
    for entry in spec["tensors"]:
        shape = [evaluate(e, names) for e in entry["shape"]]
        layers: Sequence[int | None] = [None]
        if "layers" in entry:
            layers = list(layer_sets[str(entry["layers"])])
        blocks: Sequence[int | None] = [None]
        if entry.get("blocks"):
            blocks = list(range(int(vision["vt_num_hidden_layers"])))
        experts: Sequence[int | None] = [None]
        if "{expert}" in entry["name"]:
            experts = list(range(int(text["n_routed_experts"])))
        for layer in layers:
            for block in blocks:
                for expert in experts:
                    name = str(entry["name"]).format(layer=layer, block=block, expert=expert)
                    if name in out:
                        raise ConfigError(f"tensor {name} is listed twice in the spec")
                    out[name] = (shape, entry.get("dtype"), entry.get("std"))
    return out


def _first(rules: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    for rule in rules:
        if re.search(str(rule["match"]), name):
            return rule
    raise ConfigError(f"no rule of the spec matches tensor {name}")


def build(spec: Mapping[str, Any], out: Path) -> Path:
    """Write the miniature into `out` (made or emptied of a previous build); returns `out`."""
    import torch  # optional dependency: only building weights needs it
    from safetensors.torch import save_file  # optional dependency, with torch

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    config = miniature_config(spec)
    shapes = tensor_shapes(spec)
    n_shards = int(spec.get("shards") or 1)
    shard_rules = spec.get("shard_of") or [{"match": ".", "shard": 1}]
    parts: dict[int, dict[str, Any]] = {i: {} for i in range(1, n_shards + 1)}
    default_dtype = getattr(torch, str(spec["dtype"]))
    for name, (shape, dtype, std) in shapes.items():
        rule = _first(spec["init"], name)
        seed = int.from_bytes(hashlib.sha256(f"{spec['seed']}:{name}".encode()).digest()[:8], "big")
        gen = torch.Generator().manual_seed(seed)
        scale = float(std if std is not None else rule.get("std", 0.02))
        values = torch.randn(shape, generator=gen) * scale + float(rule.get("mean", 0.0))
        shard = int(_first(shard_rules, name)["shard"])
        if not 1 <= shard <= n_shards:
            raise ConfigError(f"tensor {name}: shard {shard} outside 1..{n_shards}")
        parts[shard][name] = values.to(getattr(torch, dtype) if dtype else default_dtype)
    weight_map: dict[str, str] = {}
    total = 0
    files: dict[str, str] = {}
    for shard, tensors in parts.items():
        file = f"model-{shard:05d}-of-{n_shards:06d}.safetensors"
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        files[file] = _sha256(out / file)
        for name, t in tensors.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic.write_text(out / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
    atomic.write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    marker = {
        "name": spec["name"],
        "spec_sha256": spec_digest(spec),
        "tensors": len(shapes),
        "bytes": total,
        "files": files,
    }
    atomic.write_text(out / MARKER, json.dumps(marker, indent=2) + "\n")
    return out


def is_built(spec: Mapping[str, Any], out: Path) -> bool:
    """`out` holds a whole build of this very spec."""
    try:
        marker = json.loads((Path(out) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool(marker.get("spec_sha256") == spec_digest(spec))


def ensure(spec: Mapping[str, Any], out: Path) -> Path:
    """Build unless `out` already holds this spec's build."""
    return Path(out) if is_built(spec, out) else build(spec, out)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kimi_pipe.store.miniature", description=__doc__
    )
    parser.add_argument("spec", help="a name in conf/miniature/ (e.g. kimi_k25) or a YAML path")
    parser.add_argument("out", type=Path, help="directory to write (config.json, weights)")
    parser.add_argument("--variant", default=None, help="an entry of the spec's `variants`")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.spec, args.variant)
        out = ensure(spec, args.out)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    marker = json.loads((out / MARKER).read_text())
    print(f"{out}: {marker['name']}, {marker['tensors']} tensors, {marker['bytes']:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
