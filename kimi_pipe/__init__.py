"""kimi_pipe: exact, trainable token data from hosted LLM APIs.

What a script uses, from one place (the submodules stay importable for everything else):

    import kimi_pipe as kp

    model = kp.load_model(kp.compose(["model=kimi_k25"]).model)
    rec = kp.reconstruct(model, messages, tools, response)   # pure: ids, loss mask, issues
    rec.to_record()                                           # kp.TokenIds: the contract's keys
    for record in kp.iter_records("run/records.jsonl"): ...   # each a kp.TokenRecord (a dict)
    run = kp.run_pipeline(kp.compose(["pipeline=demo"]))      # a whole pipeline

Names load on first use, so `import kimi_pipe` stays light (no torch, no LiteLLM).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "compose": "kimi_pipe.config",
    "load_model": "kimi_pipe.core.models",
    "Model": "kimi_pipe.core.models",
    "reconstruct": "kimi_pipe.core.reconstruction",
    "Reconstruction": "kimi_pipe.core.reconstruction",
    "TokenIds": "kimi_pipe.core.token_record",
    "TokenRecord": "kimi_pipe.core.token_record",
    "ServingProfile": "kimi_pipe.core.serving",
    "serving_profile": "kimi_pipe.core.serving",
    "iter_records": "kimi_pipe.store.records",
    "RecordWriter": "kimi_pipe.store.records",
    "Stage": "kimi_pipe.pipeline.stage",
    "StageContext": "kimi_pipe.pipeline.stage",
    "run_pipeline": "kimi_pipe.pipeline.runner",
    "KimiPipeError": "kimi_pipe.errors",
    "ConfigError": "kimi_pipe.errors",
    "InputError": "kimi_pipe.errors",
    "ProviderError": "kimi_pipe.errors",
    "BudgetError": "kimi_pipe.errors",
    "StoreError": "kimi_pipe.errors",
}

__all__ = [
    "__version__",
    "BudgetError",
    "ConfigError",
    "InputError",
    "KimiPipeError",
    "Model",
    "ProviderError",
    "Reconstruction",
    "RecordWriter",
    "ServingProfile",
    "Stage",
    "StageContext",
    "StoreError",
    "TokenIds",
    "TokenRecord",
    "compose",
    "iter_records",
    "load_model",
    "reconstruct",
    "run_pipeline",
    "serving_profile",
]

if TYPE_CHECKING:
    from kimi_pipe.config import compose
    from kimi_pipe.core.models import Model, load_model
    from kimi_pipe.core.reconstruction import Reconstruction, reconstruct
    from kimi_pipe.core.serving import ServingProfile, serving_profile
    from kimi_pipe.core.token_record import TokenIds, TokenRecord
    from kimi_pipe.errors import (
        BudgetError,
        ConfigError,
        InputError,
        KimiPipeError,
        ProviderError,
        StoreError,
    )
    from kimi_pipe.pipeline.runner import run_pipeline
    from kimi_pipe.pipeline.stage import Stage, StageContext
    from kimi_pipe.store.records import RecordWriter, iter_records


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kimi_pipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
