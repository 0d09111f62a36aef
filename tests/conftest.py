"""Shared fixtures. The real Kimi tokenizer is read from ../shared (or KIMI_TOKENIZER_DIR);
with KIMI_PIPE_STRICT=1 (set by .ci/run) a missing tokenizer fails instead of skipping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kimi_pipe.core.models import Model
from tests.support.cases import (
    FIXTURES,
    REPO,
    TAIL_KEPT,
    TAIL_KEPT_OVERRIDES,
    expected_output_ids,
    load_or_skip,
    model_config,
    read_cases,
)

# Tests import these from here (`from conftest import TAIL_KEPT`); they live in tests/support.
__all__ = [
    "FIXTURES",
    "REPO",
    "TAIL_KEPT",
    "TAIL_KEPT_OVERRIDES",
    "expected_output_ids",
    "load_or_skip",
    "model_config",
    "read_cases",
]

# The fake provider's fixtures (servers, prompts) live with the other fakes in tests/support.
pytest_plugins = ["tests.support.conftest_generate"]


@pytest.fixture(scope="session")
def kimi() -> Model:
    return load_or_skip("kimi_k25")


@pytest.fixture(scope="session")
def kimi_dir(kimi: Model) -> Path:
    from kimi_pipe.core.tokenizers import TokenizerSpec, resolve_tokenizer_dir

    return resolve_tokenizer_dir(TokenizerSpec.from_config(model_config("kimi_k25").tokenizer))


@pytest.fixture(scope="session")
def kimi_cases() -> list[dict[str, Any]]:
    return read_cases("kimi_k25_responses.jsonl")


@pytest.fixture(autouse=True)
def _probe_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: Any) -> None:
    """serving=auto caches probe verdicts under $XDG_CACHE_HOME: never the user's own
    cache from a test, and never one test's verdict for another's fake server."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))
