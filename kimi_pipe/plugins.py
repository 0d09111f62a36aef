"""One plug-in mechanism: a dotted target names the code, one entry names the target.

Every extension point of the package (a pipeline stage, an export format, an extraction
backend, a provider's account endpoints) is one file plus one entry, and every entry is a
target string resolved here:

- `package.module:attr` (the entry-point spelling) or `package.module.attr` (Hydra's
  `_target_` spelling): the attribute of that module;
- `package.module`: the module itself (a stage's module).

Where the entries live:

- stage: `kimi_pipe/stages/<name>.py`; a `StageEntry` line in `pipeline/registry.py`
  (its module), or `module:Class` in a pipeline's `stages:`;
- exporter: `kimi_pipe/exporters/<name>.py`; `exporter: kimi_pipe.exporters.<name>.<Class>`
  in `conf/export/<name>.yaml`;
- backend: `kimi_pipe/extraction/<name>_backend.py` (or a package, as `sglang/`); a line in
  `BACKENDS` below (`extract.backend=<name>`), or a target as `extract.backend`;
- account: `kimi_pipe/providers/<name>_account.py`; a line in `ACCOUNTS` below
  (`provider.account=<name>`), or a target as `provider.account`.

A name is looked up in its table; a string with a `:` is a target of your own. Both fail
as one `ConfigError` naming the kind, the name and what is known (`tests/test_house.py`
resolves every entry). This module imports nothing of the package but its error tree.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from kimi_pipe.errors import ConfigError

# Extraction backends: `extract.backend=<name>` -> a function open_backend(job) -> Backend.
BACKENDS: dict[str, str] = {
    "hf": "kimi_pipe.extraction.hf_backend:open_backend",
    "sglang": "kimi_pipe.extraction.sglang:open_backend",
}

# Provider account endpoints: `provider.account=<name>` -> a class Account(settings).
ACCOUNTS: dict[str, str] = {
    "openrouter": "kimi_pipe.providers.account:OpenRouterAccount",
}


def split_target(target: str) -> tuple[str, str | None]:
    """`a.b:c` -> ("a.b", "c"); `a.b` -> ("a.b", None) (a module, or Hydra's `a.b` = attr)."""
    module, sep, attr = target.partition(":")
    if sep:
        return module, attr
    return target, None


def load_target(target: str, *, kind: str = "plug-in", within: str | None = None) -> Any:
    """The object `target` names (see the module docstring). `within`: a package prefix the
    module must sit in (an entry a config may give must not import arbitrary code)."""
    if not isinstance(target, str) or not target.strip():
        raise ConfigError(f"{kind}: expected a target `package.module:attr`, got {target!r}")
    module_name, attr = split_target(target.strip())
    if within is not None and not (module_name + ".").startswith(within.rstrip(".") + "."):
        # Checked before anything is imported: importing a module runs its code.
        raise ConfigError(f"{kind} {target!r} is not in {within} (only its own code is loaded)")
    if attr is None:
        loaded = _import(module_name, kind, target, quiet=True)
        if loaded is not None:
            return loaded
        module_name, _, attr = module_name.rpartition(".")  # Hydra's `_target_` spelling
        if not module_name:
            raise ConfigError(f"{kind} {target!r}: no module {target!r}")
    module = _import(module_name, kind, target, quiet=False)
    assert module is not None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{kind} {target!r}: module {module_name} has no {attr!r}") from None


def _import(name: str, kind: str, target: str, *, quiet: bool) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        # Only the named module missing is the entry's fault; a dependency it imports that is
        # missing (torch, sglang) propagates as it is, so the caller can name the extra.
        if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
            raise
        if quiet:
            return None
        raise ConfigError(f"{kind} {target!r}: no module {name!r}") from None


def resolve_plugin(kind: str, name: str, table: Mapping[str, str]) -> Any:
    """A registered plug-in by name, or a target of your own (`package.module:attr`)."""
    if name in table:
        return load_target(table[name], kind=kind)
    if ":" in name:
        return load_target(name, kind=kind)
    raise ConfigError(
        f"unknown {kind} {name!r}: one of {sorted(table)}, or your own as `package.module:attr`"
    )
