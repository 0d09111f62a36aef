"""Beside the import-direction test (test_layout.py): stages are thin and independent, and no
import circle exists even counting the imports inside functions.

A stage module is one the stage table names (kimi_pipe/pipeline/registry.py). It may import
engines (generation, conformance, extraction, reporting, store, ...) and the stages' shared
command-line helper, never another stage: what two stages share lives in an engine below them.
"""

from __future__ import annotations

from test_layout import imports_of, modules

from kimi_pipe.pipeline.registry import STAGE_TABLE

SHARED = {"kimi_pipe.stages", "kimi_pipe.stages.command"}  # not stages: their common helpers


def stage_modules() -> set[str]:
    known = modules()
    # `demo` and `run` are commands over the runner (kimi_pipe.pipeline), not stages.
    return {
        e.module
        for e in STAGE_TABLE
        if e.module.startswith("kimi_pipe.stages.") and e.module in known and e.module not in SHARED
    }


def module_of(target: str, known: dict[str, object]) -> str | None:
    """`kimi_pipe.a.b.name` -> the module it names (`kimi_pipe.a.b`), None outside the package."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def test_the_stage_table_names_modules_that_exist() -> None:
    assert len(stage_modules()) >= 9


def test_no_stage_imports_another_stage() -> None:
    known = modules()
    stages = stage_modules()
    found = []
    for name in sorted(stages):
        for target in imports_of(known[name], top_level_only=False):
            other = module_of(target, known)
            if other in stages and other != name:
                found.append(f"{name} imports {other}")
    assert not found, "stages import stages (move what they share into an engine): " + "; ".join(
        sorted(set(found))
    )


def test_no_import_circle_counting_imports_inside_functions() -> None:
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = {module_of(t, known) for t in imports_of(path, top_level_only=False)}
        # A package's __init__ is not an edge: `from kimi_pipe.x import y` names module x.y.
        graph[name] = {t for t in targets if t and t != name and t != "kimi_pipe"}
    state: dict[str, int] = {}
    circles: list[str] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1 and nxt in stack:
                circles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles: " + " | ".join(circles)
