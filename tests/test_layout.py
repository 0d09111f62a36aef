"""The house: subpackages import downwards only and no module imports itself round a cycle.

Layers, lowest first: errors, config, progress -> core -> store -> providers / extraction ->
reporting / conformance -> generation -> stages -> pipeline -> cli. A module may import its
own layer or lower ones (imports inside functions included), never a higher one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kimi_pipe"
LAYERS = {
    "errors": 0,
    "config": 0,
    "progress": 0,
    "plugins": 0,  # the one plug-in resolver (dotted targets), used by every layer above
    "core": 1,
    "store": 2,
    "providers": 3,
    "extraction": 3,
    "reporting": 4,
    "conformance": 4,  # probe batteries, checks, profile fitting, serving=auto
    "exporters": 4,  # the export engine and one file per trainer format
    "generation": 4.5,  # the generate job and the probes bought through it: under the stages
    "stages": 5,
    "pipeline": 6,
    "cli": 7,
}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports_of(path: Path, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kimi_pipe"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kimi_pipe"))
    return found


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_module_sits_in_a_layer_or_is_an_alias() -> None:
    for name, path in modules().items():
        if name == "kimi_pipe" or layer(name) is not None:
            continue
        # The one alias: `python -m kimi_pipe <stage>` -> kimi_pipe.cli main() (issue 32: no
        # `kimi_pipe.<stage>` alias modules beside it).
        assert name == "kimi_pipe.__main__", f"{name} sits in no layer"
        body = path.read_text(encoding="utf-8")
        assert len(body.splitlines()) <= 10 and "import main" in body, f"{name} is not thin"


@pytest.mark.parametrize("name", sorted(n for n in modules() if layer(n) is not None))
def test_imports_point_down(name: str) -> None:
    known = modules()
    mine = layer(name)
    assert mine is not None
    for target in imports_of(known[name], top_level_only=False):
        if target not in known:
            continue  # `from kimi_pipe.x import function`: the module entry covers it
        theirs = layer(target)
        assert theirs is not None and theirs <= mine, f"{name} imports upwards: {target}"


def test_no_import_cycles_at_module_level() -> None:
    known = modules()
    graph = {
        name: {t for t in imports_of(path, top_level_only=True) if t in known and t != name}
        for name, path in known.items()
    }
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt] if nxt in stack else [node, nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_public_api_lists_what_it_exports() -> None:
    """`import kimi_pipe` names the scripting surface (issue 18) and loads none of it yet."""
    import subprocess
    import sys

    import kimi_pipe

    assert sorted(kimi_pipe.__all__) == sorted(["__version__", *kimi_pipe._EXPORTS])
    for name in kimi_pipe._EXPORTS:
        assert getattr(kimi_pipe, name) is not None, name
    assert (PACKAGE / "py.typed").is_file()
    light = subprocess.run(
        [sys.executable, "-c", "import sys, kimi_pipe; print(sorted(m for m in "
         "('torch', 'litellm', 'transformers') if m in sys.modules))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert light.stdout.strip() == "[]"
