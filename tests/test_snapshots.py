"""Golden token-id snapshots of every recorded case (review diffs like code).

Update with `make snapshots`; a stale or unused snapshot fails the suite."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import TAIL_KEPT, load_or_skip, read_cases
from snapshot_format import TokenSnapshot, render_snapshot

from kimi_pipe.core.reconstruction import reconstruct

# (model config, fixture corpus): adding a model family adds a line here and its snapshots.
CORPORA = [
    ("kimi_k25", "kimi_k25_responses.jsonl"),
    ("qwen3_5", "qwen3_5_responses.jsonl"),
    # Real server responses (tests/fixtures/server_shapes), one per issue-9 code, unknown profile.
    ("kimi_k25", "kimi_k25_server_shapes.jsonl"),
]
PARAMS = [
    pytest.param(model, case, id=f"{model}-{case['id']}")
    for model, corpus in CORPORA
    for case in read_cases(corpus)
]


@pytest.fixture
def snapshot(snapshot: Any) -> Any:
    return snapshot.use_extension(TokenSnapshot)


@pytest.mark.parametrize(("model_name", "case"), PARAMS)
def test_golden_ids(model_name: str, case: dict[str, Any], snapshot: Any) -> None:
    model = load_or_skip(model_name)
    result = reconstruct(
        model, case["messages"], case.get("tools"), case["response"], serving=TAIL_KEPT
    )
    assert render_snapshot(model, case, result) == snapshot


def test_no_stale_snapshots() -> None:
    """Every snapshot file belongs to a case that still exists (syrupy's own unused check
    does not see files when a subset of tests is selected, so this one always runs)."""
    from snapshot_format import SNAPSHOT_ROOT

    expected = {f"test_golden_ids[{p.id}].txt" for p in PARAMS}
    present = {p.name for p in (SNAPSHOT_ROOT / "test_snapshots").glob("*.txt")}
    assert present - expected == set(), "stale snapshots: delete them or run `make snapshots`"
    assert expected - present == set(), "missing snapshots: run `make snapshots` and review"
