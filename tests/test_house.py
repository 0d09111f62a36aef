"""Beside the import-direction test (test_layout.py): stages are thin and independent, and no
import circle exists even counting the imports inside functions.

A stage module is one the stage table names (kimi_pipe/pipeline/registry.py). It may import
engines (generation, conformance, extraction, reporting, store, ...) and the stages' shared
command-line helper, never another stage: what two stages share lives in an engine below them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
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


# --- one home per fact: issue codes and exit statuses -------------------------------------

# Literals equal to a code, left where they are, with why.
CODE_SPELLINGS_ELSEWHERE = {
    # error kinds of a failed attempt (providers/errors.py), spelled like the record code
    ("kimi_pipe.providers.calls", "malformed_response"),
    ("kimi_pipe.providers.calls", "no_usage"),  # a billing flag of the attempt
    # the setting resolve.posterior_sampled, named like the rung it turns on: its description
    ("kimi_pipe.stages.settings_help", "posterior_sampled"),
}


def all_codes() -> set[str]:
    from kimi_pipe.core import issue_codes

    codes: set[str] = set()
    for name, value in vars(issue_codes).items():
        if not name.isupper():
            continue
        if isinstance(value, str):
            codes.add(value)
        elif isinstance(value, frozenset | dict):
            codes.update(value)
    return codes


def test_every_issue_code_is_spelled_only_in_issue_codes() -> None:
    """A module-level constant, set or table holding a code's spelling outside
    core/issue_codes.py is a second home for it (TARGET_UNRESOLVED was defined twice)."""
    import ast

    codes = all_codes()
    assert {"target_resolved", "target_unresolved", "billing_mismatch", "split_ambiguous"} <= codes
    found = []
    for name, path in modules().items():
        if name == "kimi_pipe.core.issue_codes":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, ast.Assign | ast.AnnAssign):
                continue
            for leaf in ast.walk(node):
                if (
                    isinstance(leaf, ast.Constant)
                    and leaf.value in codes
                    and (name, leaf.value) not in CODE_SPELLINGS_ELSEWHERE
                ):
                    found.append(f"{name}:{node.lineno} {leaf.value!r}")
    assert not found, "codes defined outside core/issue_codes.py: " + "; ".join(found)


def test_each_code_has_one_definition() -> None:
    """The old names (`resolve.TARGET_UNRESOLVED`, `reconstruction.ERRORS`, ...) are the same
    objects as issue_codes' (one definition, imported), not copies."""
    from kimi_pipe.core import candidates, evidence, issue_codes, prefix, reconstruction
    from kimi_pipe.extraction import split_check

    assert evidence.TARGET_RESOLVED is issue_codes.TARGET_RESOLVED
    assert prefix.TARGET_UNRESOLVED is issue_codes.TARGET_UNRESOLVED
    assert reconstruction.ERRORS is issue_codes.RECONSTRUCTION_ERRORS
    assert reconstruction.NOTES is issue_codes.RECONSTRUCTION_NOTES
    assert candidates.CLASS_OF_CODE is issue_codes.CLASS_OF_CODE
    assert split_check.SPLIT_AMBIGUOUS is issue_codes.SPLIT_AMBIGUOUS
    # Errors and notes never share a code: a code either makes `ok` false or it does not.
    errors = issue_codes.RECONSTRUCTION_ERRORS | issue_codes.LOGPROB_ERRORS
    notes = issue_codes.RECONSTRUCTION_NOTES | issue_codes.LOGPROB_NOTES
    assert not errors & notes


def test_exit_statuses_live_in_errors() -> None:
    """Every exit status is a name in kimi_pipe/errors.py, once: no other module defines an
    EXIT_ constant or returns / exits with a bare number other than 0."""
    import ast

    from kimi_pipe import errors

    statuses = {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    assert len(statuses) == len([k for k in vars(errors) if k.startswith("EXIT_")])  # one name each
    found = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if name != "kimi_pipe.errors" and isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.startswith("EXIT_"):
                        found.append(f"{name}:{node.lineno} defines {target.id}")
            if name.endswith((".main", "__main__")) or not isinstance(node, ast.FunctionDef):
                continue
            if node.name != "main" and not node.name.endswith("_task"):
                continue
            for leaf in ast.walk(node):
                value = getattr(leaf, "value", None) if isinstance(leaf, ast.Return) else None
                if isinstance(value, ast.Constant) and type(value.value) is int and value.value:
                    found.append(f"{name}:{leaf.lineno} returns {value.value}")
    assert not found, "exit statuses outside errors.py: " + "; ".join(found)


# --- one plug-in mechanism ------------------------------------------------------------------


def test_every_plugin_entry_resolves() -> None:
    """Every registered stage, exporter, backend and account resolves through the one
    resolver (kimi_pipe/plugins.py) to code of the right shape."""
    import inspect

    from omegaconf import OmegaConf

    from kimi_pipe.config import CONF_DIR
    from kimi_pipe.exporters.base import Exporter
    from kimi_pipe.plugins import ACCOUNTS, BACKENDS, load_target

    for entry in STAGE_TABLE:
        module = load_target(entry.module, kind="stage")
        assert callable(module.main), entry.name
        if entry.in_pipelines:
            assert callable(module.run_stage), entry.name
    formats = sorted((CONF_DIR / "export").glob("*.yaml"))
    assert len(formats) >= 4
    for path in formats:
        target = OmegaConf.load(path).exporter
        cls = load_target(target, kind="exporter", within="kimi_pipe.exporters")
        assert inspect.isclass(cls) and issubclass(cls, Exporter), path.name
    for name, target in BACKENDS.items():
        open_backend = load_target(target, kind="backend")
        assert callable(open_backend) and "job" in inspect.signature(open_backend).parameters, name
    for path in sorted((CONF_DIR / "extract").glob("*.yaml")):
        backend = OmegaConf.load(path).get("backend")
        assert backend is None or backend in BACKENDS, path.name
    for name, target in ACCOUNTS.items():
        cls = load_target(target, kind="account")
        assert inspect.isclass(cls) and callable(cls.listed_prices), name
    for path in sorted((CONF_DIR / "provider").glob("*.yaml")):
        account = OmegaConf.load(path).get("account")
        assert account is None or account in ACCOUNTS, path.name


def test_the_resolver_reads_both_spellings_and_names_what_is_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kimi_pipe.errors import ConfigError
    from kimi_pipe.plugins import BACKENDS, load_target, resolve_plugin
    from kimi_pipe.stages import command

    assert load_target("kimi_pipe.stages.command:report") is command.report
    assert load_target("kimi_pipe.stages.command.report") is command.report  # Hydra's _target_
    assert load_target("kimi_pipe.stages.command") is command
    with pytest.raises(ConfigError, match="backend 'kimi_pipe.nowhere:x': no module"):
        load_target("kimi_pipe.nowhere:x", kind="backend")
    with pytest.raises(ConfigError, match="has no 'nothing'"):
        load_target("kimi_pipe.stages.command:nothing")
    with pytest.raises(ConfigError, match="is not in kimi_pipe.exporters"):
        load_target("os:system", kind="exporter", within="kimi_pipe.exporters")
    with pytest.raises(ConfigError, match="is not in kimi_pipe.exporters"):
        load_target("os.path", kind="exporter", within="kimi_pipe.exporters")  # not imported
    with pytest.raises(
        ConfigError, match=r"unknown extract.backend 'vllm': one of \['hf', 'sglang'\]"
    ):
        resolve_plugin("extract.backend", "vllm", BACKENDS)
    # A dependency the named module lacks is not the entry's fault: it propagates as itself
    # (the `kimi-pipe` command turns it into "install the extra").
    (tmp_path / "plugin_with_missing_dep.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        load_target("plugin_with_missing_dep:open_backend", kind="backend")


# --- imports inside functions ---------------------------------------------------------------


def function_level_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, imported module, the source line) of every import inside a function."""
    import ast

    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    found = []
    for func in ast.walk(ast.parse(text)):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.append((node.lineno, node.module, lines[node.lineno - 1]))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    found.append((node.lineno, alias.name, lines[node.lineno - 1]))
    return sorted(set(found))


def test_every_function_level_import_of_the_package_says_why() -> None:
    """An import of a kimi_pipe module inside a function hides an edge of the import graph:
    it stays only where it must (the lazy public API, an optional dependency it brings, a
    circle it cuts), and its line says which."""
    missing = []
    for name, path in sorted(modules().items()):
        if name == "kimi_pipe":
            continue  # kimi_pipe/__init__.py: the lazy public API, said in its docstring
        for line, target, source in function_level_imports(path):
            if target.startswith("kimi_pipe") and "#" not in source:
                missing.append(f"{name}:{line} {source.strip()}")
    assert not missing, "say why each stays inside its function: " + "; ".join(missing)


# --- the config ends at the stages' doors (issue 42) ---------------------------------------

# Below kimi_pipe/stages/ and kimi_pipe/pipeline/ (and config.py, which composes), modules read
# typed job objects and plain values only: kimi_pipe/stages/jobs/ makes them from the config.
DOORS = ("kimi_pipe/stages/", "kimi_pipe/pipeline/", "kimi_pipe/config.py")
NOT_YET: set[str] = set()


def imports_omegaconf(path: Path) -> bool:
    """`path` imports omegaconf (at any depth: inside functions too)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "omegaconf":
            return True
        if isinstance(node, ast.Import) and any(
            a.name.split(".")[0] == "omegaconf" for a in node.names
        ):
            return True
    return False


def test_nothing_below_the_stages_doors_imports_omegaconf() -> None:
    root = Path(__file__).resolve().parent.parent
    files = [
        str(p.relative_to(root))
        for p in sorted((root / "kimi_pipe").rglob("*.py"))
        if not str(p.relative_to(root)).startswith(DOORS)
    ]
    assert len(files) > 100  # the package is where this test thinks it is
    found = [f for f in files if f not in NOT_YET and imports_omegaconf(root / f)]
    assert not found, "import omegaconf below the stages' doors: " + ", ".join(found)


def test_the_command_side_uses_hydra_public_api_and_passes_argv() -> None:
    """Issue 42, the command layer: no module imports `hydra._internal`; the `kimi-pipe`
    command hands a stage its arguments (no sys.argv swap); every issue code is a member of
    the StrEnum, equal to its string."""
    import ast

    from kimi_pipe.core import issue_codes

    internal = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                targets = [node.module or ""]
            internal += [f"{name} imports {t}" for t in targets if t.startswith("hydra._internal")]
    assert not internal, internal
    cli = ast.parse(modules()["kimi_pipe.cli"].read_text(encoding="utf-8"))
    swaps = [
        node.lineno
        for node in ast.walk(cli)
        if isinstance(node, ast.Assign) and any("sys.argv" in ast.unparse(t) for t in node.targets)
    ]
    assert not swaps, f"kimi_pipe/cli.py sets sys.argv at lines {swaps}"
    for name, value in vars(issue_codes).items():
        if name.isupper() and isinstance(value, str):
            assert isinstance(value, issue_codes.Code) and value == value.value, name
            assert repr(value) == repr(value.value) and f"{value}" == value.value, name


# --- `Generator` by composition: every attribute set in `__init__` (issue 42) --------------

# The modules `Generator` (generation/buying.py) and its parts are defined in.
GENERATOR_PARTS = ("buying", "dispatch", "outcomes", "spending", "summary")


def self_attributes(fn: ast.AST) -> set[str]:
    """The names `fn` assigns as `self.X` (`=`, `+=`, annotated, in tuples, in closures)."""
    found: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for e in ast.walk(target):
                if (
                    isinstance(e, ast.Attribute)
                    and isinstance(e.ctx, ast.Store)
                    and isinstance(e.value, ast.Name)
                    and e.value.id == "self"
                ):
                    found.add(e.attr)
    return found


def set_outside_init(cls: ast.ClassDef) -> dict[str, list[str]]:
    """Attributes a method other than `__init__` assigns that `__init__` does not (a
    dataclass's fields are its `__init__`'s): {attribute: [methods]}."""
    in_init: set[str] = set()
    if any("dataclass" in ast.unparse(d) for d in cls.decorator_list):
        in_init |= {
            n.target.id
            for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
    elsewhere: dict[str, list[str]] = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if fn.name == "__init__":
            in_init |= self_attributes(fn)
            continue
        for name in self_attributes(fn):
            elsewhere.setdefault(name, []).append(fn.name)
    return {k: v for k, v in sorted(elsewhere.items()) if k not in in_init}


def test_the_attribute_walk_sees_an_attribute_first_set_in_run() -> None:
    source = """
class Part:
    def __init__(self):
        self.a, self.b = 1, 2
    def run(self):
        self.a += 1
        self.c: int = 3
        def inner():
            self.d = 4
"""
    cls = ast.parse(source).body[0]
    assert isinstance(cls, ast.ClassDef)
    assert set_outside_init(cls) == {"c": ["run"], "d": ["run"]}


def test_generator_and_its_parts_set_every_attribute_in_init() -> None:
    root = Path(__file__).resolve().parent.parent / "kimi_pipe" / "generation"
    classes = {
        f"{mod}.{node.name}": node
        for mod in GENERATOR_PARTS
        for node in ast.parse((root / f"{mod}.py").read_text(encoding="utf-8")).body
        if isinstance(node, ast.ClassDef)
    }
    assert {"buying.Generator", "dispatch.Dispatch", "outcomes.Outcomes", "spending.Spending"} <= (
        set(classes)
    )
    # By composition: no part is a base of another (no mixins sharing one `self`).
    names = {key.split(".")[1] for key in classes}
    mixins = [
        f"{key}({ast.unparse(b)})"
        for key, cls in classes.items()
        for b in cls.bases
        if ast.unparse(b) in names
    ]
    assert not mixins, "parts inherited, not held: " + ", ".join(mixins)
    late = {key: found for key, cls in classes.items() if (found := set_outside_init(cls))}
    assert not late, f"attributes first set outside __init__: {late}"
