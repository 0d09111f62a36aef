"""The reconstruct stage on hostile input files (#10 F9, BOM) and its summary (#9 item 6):
every line gets a record, the batch goes on, exit 0, no traceback, and the counts a user
sees (exact / repaired / flagged, by code) match the records written."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import TAIL_KEPT, TAIL_KEPT_OVERRIDES

from kimi_pipe.core.models import Model
from kimi_pipe.core.reconstruction import ERRORS
from kimi_pipe.stages.reconstruct import run

REPO = Path(__file__).resolve().parent.parent
GOOD = {
    "id": "good",
    "messages": [{"role": "user", "content": "Hi"}],
    "response": {
        "choices": [
            {"message": {"content": "Hello!", "reasoning": "Greet back."}, "finish_reason": "stop"}
        ],
        "usage": {"completion_tokens": 8},  # Greet back.</think>Hello!<|im_end|>
    },
}


def _line(sample: dict[str, Any]) -> bytes:
    return json.dumps(sample).encode() + b"\n"


def _with_content(sample_id: str, content: str) -> dict[str, Any]:
    return {**GOOD, "id": sample_id, "messages": [{"role": "user", "content": content}]}


def _hostile_file(path: Path) -> list[str | None]:
    """Writes the file; returns the expected ids in output order (None: malformed)."""
    lines = [
        b"\xef\xbb\xbf" + _line(GOOD),  # a BOM before the first record
        b"[" * 200_000 + b"]" * 200_000 + b"\n",  # nested 200,000 deep
        b'{"id": "latin1", "messages": [{"role": "user", "content": "caf\xe9"}]}\n',
        _line(_with_content("lone", "x")).replace(b'"x"', b'"a\\ud800b"'),
        _line(_with_content("pair", "x")).replace(b'"x"', b'"smile \\ud83d\\ude00"'),
        _line(_with_content("escaped_backslash", "x")).replace(b'"x"', b'"\\\\ud800"'),
        b'{"id": "deep_inside", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
        _line({**GOOD, "id": "last"}),
    ]
    path.write_bytes(b"".join(lines))
    return ["good", None, None, None, "pair", "escaped_backslash", None, "last"]


@pytest.mark.kimi
def test_hostile_lines_are_malformed_records_and_the_batch_goes_on(
    tmp_path: Path, kimi_dir: Path
) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out" / "out.jsonl"
    expected_ids = _hostile_file(source)
    done = subprocess.run(
        [sys.executable, "-m", "kimi_pipe", "reconstruct", "model=kimi_k25"]
        + [f"model.tokenizer.path={kimi_dir}", f"input={source}", f"output={target}"]
        + [*TAIL_KEPT_OVERRIDES],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    records = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in records] == expected_ids
    for record in records:
        if record["id"] is None:
            assert record["ok"] is False and record["issues"] == ["malformed_record"]
        else:
            assert "malformed_record" not in record["issues"], record
    assert records[0]["ok"] is True and records[0]["issues"] == []  # the BOM was not data
    # Each bad line is reported with its file and line number.
    for line_no, why in [(2, "nested too deep"), (3, "not UTF-8"), (4, "surrogate"), (7, "deep")]:
        assert f"{source}:{line_no}: " in done.stderr and why in done.stderr
    summary = json.loads((target.parent / "out.jsonl.summary.json").read_text(encoding="utf-8"))
    assert summary["flagged_by_code"]["malformed_record"] == 4
    assert summary["records"] == 8
    assert "4 flagged (ok false)" in done.stderr


@pytest.mark.kimi
def test_decoded_surrogate_pair_is_the_real_character(kimi: Model, tmp_path: Path) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(
        _line(_with_content("pair", "x")).replace(b'"x"', b'"smile \\ud83d\\ude00"')
        + _line(_with_content("direct", "smile \U0001f600"))
    )
    run(kimi, source, target, 0, serving=TAIL_KEPT)
    pair, direct = (json.loads(line) for line in target.read_text(encoding="utf-8").splitlines())
    assert pair["prompt_ids"] == direct["prompt_ids"] and pair["prompt_ids"]


@pytest.mark.kimi
def test_a_generate_record_is_checked_as_generate_checked_it(kimi: Model, tmp_path: Path) -> None:
    """Records of a generate run carry the request: reconstructing them again checks the
    answer as generate did (model asked and named, finish), so a filtered answer or one
    that names no model does not come back `ok` from the stored answer alone."""
    request = {"model": "openrouter/moonshotai/kimi-k2.5", "extra_body": {}}
    named = {**GOOD["response"], "model": "moonshotai/kimi-k2.5-0127"}
    filtered = {**named, "choices": [{**named["choices"][0], "finish_reason": "content_filter"}]}
    unnamed = GOOD["response"]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(
        b"".join(
            _line({**GOOD, "id": name, "request": request, "response": response})
            for name, response in [("named", named), ("filtered", filtered), ("unnamed", unnamed)]
        )
        + _line({**GOOD, "id": "no_request"})  # a file of answers alone: nothing was asked
    )
    counts = run(kimi, source, target, 0, serving=TAIL_KEPT)
    records = {r["id"]: r for r in map(json.loads, target.read_text(encoding="utf-8").splitlines())}
    assert records["named"]["ok"] and records["no_request"]["ok"]
    assert not records["filtered"]["ok"] and "content_filter" in records["filtered"]["issues"]
    assert not records["unnamed"]["ok"] and "model_unnamed" in records["unnamed"]["issues"]
    assert counts["flagged:content_filter"] == 1 and counts["flagged:model_unnamed"] == 1


def _category(issues: list[str]) -> str:
    if set(issues) & ERRORS:
        return "flagged"
    return "repaired" if issues else "exact"


@pytest.mark.kimi
def test_summary_counts_exact_repaired_flagged_by_code(
    kimi: Model, kimi_cases: list[dict[str, Any]], tmp_path: Path
) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "run" / "out.jsonl"
    keep = ("id", "messages", "tools", "response")
    lines = [json.dumps({k: c[k] for k in keep if k in c}) for c in kimi_cases]
    source.write_text("\n".join(lines + ["{not json"]) + "\n", encoding="utf-8")
    run(kimi, source, target, 0, serving=TAIL_KEPT)

    # Expected from the fixtures' own expectations, not from the stage's counting.
    expected = Counter(_category(c["expect"]["issues"]) for c in kimi_cases)
    expected["flagged"] += 1  # the bad line
    flagged_codes: Counter[str] = Counter(["malformed_record"])
    repaired_codes: Counter[str] = Counter()
    for case in kimi_cases:
        issues = case["expect"]["issues"]
        if _category(issues) == "flagged":
            flagged_codes.update(code for code in issues if code in ERRORS)
        elif issues:
            repaired_codes.update(issues)
    assert expected["exact"] > 0 and expected["repaired"] > 0 and expected["flagged"] > 1

    summary = json.loads((target.parent / "out.jsonl.summary.json").read_text(encoding="utf-8"))
    assert summary["records"] == len(kimi_cases) + 1
    assert {k: summary[k] for k in ("exact", "repaired", "flagged")} == {
        k: expected[k] for k in ("exact", "repaired", "flagged")
    }
    assert summary["flagged_by_code"] == dict(flagged_codes)
    assert summary["repaired_by_code"] == dict(repaired_codes)
    assert summary["input"] == str(source) and summary["output"] == str(target)


@pytest.mark.kimi
def test_main_prints_the_counts(
    kimi_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kimi_pipe.stages.reconstruct import main

    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(_line(GOOD) + b"{broken\n")
    assert (
        main(
            ["model=kimi_k25", f"model.tokenizer.path={kimi_dir}"]
            + [f"input={source}", f"output={target}", *TAIL_KEPT_OVERRIDES]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert f"reconstructed 2 records -> {target}: 1 ok (1 without a note, 0 with notes)" in err
    assert "1 flagged (ok false)" in err and "flagged by code:  malformed_record=1" in err
    assert f"{target}.summary.json" in err


def _deep_tool_schema(depth: int) -> bytes:
    """Valid JSON (under the reader's depth limit) whose tool schema is too deep to render."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    return json.dumps({**GOOD, "id": "deep_tools", "tools": tools}).encode()


# line -> the id its record keeps (None: the line could not be read at all)
HOSTILE: dict[str, tuple[bytes, str | None]] = {
    "nested_200000_deep": (b"[" * 200_000 + b"]" * 200_000, None),
    "invalid_utf8": (b'{"id": "x", "messages": [{"role": "user", "content": "caf\xe9"}]}', None),
    "lone_surrogate": (
        _line(_with_content("x", "x")).replace(b'"x"}]', b'"\\udc00"}]').strip(),
        None,
    ),
    "deep_messages": (b'{"id": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    "deep_tool_schema": (_deep_tool_schema(300), "deep_tools"),
}


@pytest.mark.kimi
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_each_hostile_line_alone(kimi: Model, tmp_path: Path, name: str) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    line, kept_id = HOSTILE[name]
    source.write_bytes(_line(GOOD) + line + b"\n" + _line({**GOOD, "id": "after"}))
    counts = run(kimi, source, target, 0, serving=TAIL_KEPT)
    records = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in records] == ["good", kept_id, "after"]
    assert records[1]["issues"] == ["malformed_record"] and records[1]["ok"] is False
    assert records[0]["ok"] and records[2]["ok"]
    assert counts["flagged"] == 1 and counts["exact"] == 2


@pytest.mark.kimi
def test_bom_before_the_first_line_is_accepted(kimi: Model, tmp_path: Path) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"\xef\xbb\xbf" + _line(GOOD))
    run(kimi, source, target, 0, serving=TAIL_KEPT)
    (record,) = (json.loads(line) for line in target.read_text(encoding="utf-8").splitlines())
    assert record["id"] == "good" and record["ok"] is True and record["issues"] == []
