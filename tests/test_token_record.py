"""The typed token record (kimi_pipe.core.token_record): the keys every writer puts in a
record are the keys the type declares, with the declared kinds, and reading back checks the
ids before anyone trusts them. The JSON itself is locked by snapshots and
tests/test_reconstruct_cli.py; this locks the type to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_type_hints

import pytest

import kimi_pipe as kp
from kimi_pipe.core.token_record import TokenIds, TokenRecord, record_problem
from kimi_pipe.stages.reconstruct import run

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DECLARED = TokenRecord.__required_keys__ | TokenRecord.__optional_keys__


def test_the_contract_keys_are_required_and_typed() -> None:
    assert TokenRecord.__required_keys__ == TokenIds.__required_keys__ == {
        "ok", "issues", "prompt_ids", "output_ids", "loss_mask",
        "completion_tokens_reported", "completion_tokens_reconstructed",
    }  # fmt: skip
    hints = get_type_hints(TokenIds)
    assert hints["prompt_ids"] == list[int] and hints["completion_tokens_reported"] == int | None
    assert kp.TokenRecord is TokenRecord and "TokenRecord" in kp.__all__


@pytest.mark.kimi
def test_every_key_reconstruct_writes_is_declared(kimi: Any, tmp_path: Path) -> None:
    target = tmp_path / "out.jsonl"
    run(kimi, FIXTURES / "kimi_k25_responses.jsonl", target)
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(records) == 24
    for record in records:
        assert set(record) <= DECLARED, set(record) - DECLARED
        assert TokenRecord.__required_keys__ <= set(record)
        assert isinstance(record["ok"], bool) and isinstance(record["issues"], list)
        assert all(isinstance(i, int) for i in record["prompt_ids"] + record["output_ids"])
        reported = record["completion_tokens_reported"]
        assert reported is None or isinstance(reported, int)
        if record["output_ids"]:
            assert record_problem(record) is None
    # The one-option candidate sets and the open ones carry the declared shape.
    sets = [r["candidates"] for r in records if "candidates" in r]
    assert sets, "the sample holds flagged records with candidate sets"
    for candidates in sets:
        keys = {"closed", "why_open", "classes", "diverge_at", "options"}
        # A closed set names what it was proven against (issue 30); an open one whose doubts
        # all lie after the reasoning's text, the ids every reading shares (issue 40).
        extra = {"proven_against"} if candidates["closed"] else set()
        if not candidates["closed"] and "shared_by_unlisted" in candidates:
            extra = {"shared_by_unlisted"}
        if not candidates["closed"] and "gaps" in candidates:
            # A bounded open set: its readings short of the bill (core/gaps.py).
            extra |= {"gaps"}
            for gap in candidates["gaps"]:
                assert set(gap) == {"output_ids", "start", "open_end", "section_start", "label"}
        assert set(candidates) == keys | extra
        for option in candidates["options"]:
            # `points`: a set that would list more options than the target scores has its
            # arguments' edges as choice points (core/candidates.py).
            assert {"output_ids", "loss_mask", "label"} <= set(option)
            assert set(option) <= {"output_ids", "loss_mask", "label", "points"}


def test_generate_error_records_are_declared() -> None:
    from kimi_pipe.generation.outcomes import _error_record
    from kimi_pipe.providers.errors import ErrorInfo
    from kimi_pipe.store.prompt_datasets import Prompt

    prompt = Prompt("p0", [{"role": "user", "content": "hi"}], None)
    error = ErrorInfo("bad_request", 400, "no", "fail")
    record = _error_record(prompt, {"model": "m"}, error, 1)
    assert set(record) <= DECLARED and TokenRecord.__required_keys__ <= set(record)
    assert record_problem(record) == "no_ids"


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ([1, 2], "not_an_object"),
        ({"prompt_ids": [1], "output_ids": [2], "loss_mask": [0, 1]}, "no_id"),
        ({"id": "a", "prompt_ids": [1], "output_ids": "2", "loss_mask": [0, 1]}, "no_ids"),
        ({"id": "a", "prompt_ids": [], "output_ids": [], "loss_mask": []}, "no_ids"),
        ({"id": "a", "prompt_ids": [1], "output_ids": [2], "loss_mask": [1]}, "loss_mask_length"),
        ({"id": "a", "prompt_ids": [1], "output_ids": [-2], "loss_mask": [0, 1]}, "bad_token_id"),
        ({"id": "a", "prompt_ids": [1], "output_ids": [2], "loss_mask": [0, 1]}, None),
    ],
)
def test_reading_back_checks_the_ids(record: Any, problem: str | None) -> None:
    assert record_problem(record) == problem
