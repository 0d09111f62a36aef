"""Generate's summary counts read from the index of ids (records.jsonl.ids), not the records.

The tally (generation/summary.py `tally_records`) equals what the summary counted before by
parsing every record (kept below as `parsed_summary`, with core/token_yield.py's
`token_yield`), over records of every shape a run writes, with records past the index, bad
lines, a torn tail and a rewritten file; and with a valid index the records are not parsed.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from kimi_pipe.core.evidence import DEFAULT_ACCEPT, LADDER, evidence_of
from kimi_pipe.core.token_yield import token_yield
from kimi_pipe.generation.summary import RecordTally, tally_records
from kimi_pipe.store.records import RecordWriter, iter_records, record_cost
from kimi_pipe.store.records_index import (
    IndexedRecordWriter,
    derivation,
    index_path,
    iter_digests,
    load_indexed,
)


def parsed_summary(path: Path, accept: tuple[str, ...]) -> dict[str, Any]:
    """The summary's record counts as generation/job.py computed them before the index."""
    counts: Counter[str] = Counter()
    flagged: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    providers: Counter[str] = Counter()
    spend = 0.0
    prompt_tokens = reported = rebuilt = 0
    for rec in iter_records(path):
        counts["records"] += 1
        spend += record_cost(rec)
        if rec.get("error"):
            failed[rec["error"].get("class", "unknown")] += 1
            continue
        counts["answered"] += 1
        counts["ok" if rec.get("ok") else "flagged"] += 1
        counts[f"evidence:{evidence_of(rec)}"] += 1
        flagged.update(rec.get("issues") or [])
        providers[str(rec.get("provider"))] += 1
        usage = rec.get("usage") or {}
        prompt_tokens += int(usage.get("prompt_tokens") or 0)
        if isinstance(rec.get("completion_tokens_reported"), int):
            reported += rec["completion_tokens_reported"]
            rebuilt += int(rec.get("completion_tokens_reconstructed") or 0)
    return {
        "counts": dict(counts),
        "flagged": dict(flagged),
        "failed": dict(failed),
        "providers": dict(providers),
        "spend": round(spend, 12),
        "tokens": (prompt_tokens, reported, rebuilt),
        "yield": token_yield(iter_records(path), accept, price_out_per_token=2e-6, spend_usd=1.5),
    }


def from_tally(tally: RecordTally, accept: tuple[str, ...]) -> dict[str, Any]:
    return {
        "counts": {k: v for k, v in tally.counts.items() if v},
        "flagged": dict(tally.flagged),
        "failed": dict(tally.failed),
        "providers": dict(tally.providers),
        "spend": round(tally.spend, 12),
        "tokens": (tally.prompt_tokens, tally.reported, tally.rebuilt),
        "yield": tally.token_yield(accept, price_out_per_token=2e-6, spend_usd=1.5),
    }


def record(i: int) -> dict[str, Any]:
    """Records of every shape the summary tells apart."""
    kind = i % 9
    rec: dict[str, Any] = {"id": f"s{i:04d}", "cost": 0.001 * (i % 5), "provider": f"p{i % 3}"}
    if kind == 0:
        return rec | {"error": {"class": "RateLimitError"}}
    if kind == 1:
        return rec | {"error": {"message": "no class"}}
    out = list(range(10 + i % 7))
    rec |= {
        "ok": kind in (2, 3, 4),
        "issues": [] if kind in (2, 3) else ["billing_drift", f"issue{i % 2}"],
        "output_ids": out,
        "usage": {"prompt_tokens": 20 + i, "completion_tokens": len(out) + 1},
        "completion_tokens_reported": len(out) + (i % 2),
        "completion_tokens_reconstructed": len(out),
    }
    if kind == 3:
        rec["logprobs"] = {"coverage": "whole"}
        rec["id_sources"] = [[0, len(out), "confirmed"]]
    elif kind == 5:
        rec |= {"evidence": "prefix_proven", "prefix": {"prefix_tokens": 4}}
    elif kind == 6:
        rec |= {"evidence": "target_resolved", "completion_tokens_reported": None}
    elif kind == 7:
        rec |= {"issues": ["partial_character"], "evidence": "text_proven", "usage": None}
    elif kind == 8:
        rec |= {"evidence": "unresolved", "output_ids": []}
    return rec


def records() -> list[dict[str, Any]]:
    recs = [record(i) for i in range(60)]
    recs.append({**record(12), "cost": 0.002})  # an id answered twice: the later one counts
    recs.append({**record(14), "id": None})  # answers without an id all count
    recs.append({**record(15), "id": None})
    recs.append({**record(16), "id": 7})  # an id that is not a string
    recs.append({**record(17), "id": 7})
    return recs


def write(path: Path, recs: list[dict[str, Any]]) -> None:
    with IndexedRecordWriter(path) as w:
        for rec in recs:
            w.append(rec)


def same(path: Path) -> None:
    for accept in (DEFAULT_ACCEPT, ("engine_ids",), tuple(LADDER)):
        assert from_tally(tally_records(path), accept) == parsed_summary(path, accept)


def test_the_tally_from_the_index_equals_the_full_parse(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    write(path, records())
    same(path)
    tally = tally_records(path)
    assert tally.counts["records"] == 65 and sum(tally.failed.values()) == 14
    assert tally.failed["unknown"] == 7  # an error without a class
    y = tally.token_yield(DEFAULT_ACCEPT)
    assert 0 < y["exact_accepted"] < y["completion_tokens_bought"]
    assert y["exact_by_rung"]["prefix_proven"] > 0 and y["exact_by_rung"]["engine_ids"] > 0


def test_records_past_the_index_bad_lines_torn_tail_and_a_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    recs = records()
    write(path, recs[:40])
    # A writer killed between a record and its index line, a bad line, a torn last line.
    with RecordWriter(path) as w:
        for rec in recs[40:50]:
            w.append(rec)
    with open(path, "ab") as fh:
        fh.write(b"not json\n[1, 2]\n")
        fh.write(b'{"id": "s9999", "co')
    same(path)
    # A last line whole but without its newline counts, as a full read takes it.
    with open(path, "rb+") as fh:
        fh.truncate(path.stat().st_size - len(b'{"id": "s9999", "co'))
        fh.seek(0, os.SEEK_END)
        fh.write(b'{"id": "s9998", "cost": 0.25, "error": {"class": "Timeout"}}')
    same(path)
    assert tally_records(path).failed["Timeout"] == 1
    write(path, recs[50:])  # the next writer indexes what is past the index and goes on
    same(path)
    # Target resolution's rewrite (tmp + rename): the old index is not read through.
    text = path.read_text().replace('"evidence":"unresolved"', '"evidence":"target_resolved"')
    tmp = tmp_path / "records.jsonl.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)
    same(path)
    assert tally_records(path).counts["evidence:unresolved"] == 0


def test_a_valid_index_is_read_and_the_records_are_not_parsed(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    write(path, records())
    before = tally_records(path)
    # Every record's bytes overwritten in place (same inode, same length, newlines kept):
    # the tally still comes out whole, so it came from the index, not from the records.
    data = path.read_bytes()
    with open(path, "r+b") as fh:
        fh.write(bytes(b if b == 0x0A else 0x20 for b in data))
    assert list(iter_records(path)) == []
    after = tally_records(path)
    assert from_tally(after, DEFAULT_ACCEPT) == from_tally(before, DEFAULT_ACCEPT)
    # Without the index (or with a stale one) the file is what counts.
    index_path(path).unlink()
    assert list(iter_digests(path)) == []
    assert tally_records(path).counts["records"] == 0


def test_a_version_1_index_is_not_read_and_the_next_writer_rebuilds_it(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    write(path, records()[:20])
    side = index_path(path)
    lines = side.read_bytes().split(b"\n")
    old = [lines[0].replace(b'"version":2', b'"version":1')]
    old += [b"\t".join(line.split(b"\t")[:5]) for line in lines[1:-1]]
    side.write_bytes(b"\n".join(old) + b"\n")
    same(path)  # the whole file parsed
    write(path, records()[20:30])
    assert b'"version":2' in side.read_bytes().split(b"\n")[0]
    same(path)


def test_digests_derived_by_other_code_are_not_read_and_the_next_writer_rebuilds(
    tmp_path: Path,
) -> None:
    """A rung or token count derived by an older (or newer) release is not trusted: the
    header's fingerprint of the derivation differs, the summary parses the records, the
    resume still reads the index, and the next writer rebuilds it."""
    path = tmp_path / "records.jsonl"
    write(path, records()[:20])
    side = index_path(path)
    lines = side.read_bytes().split(b"\n")
    header = json.loads(lines[0])
    header["digest"] = "0" * 16
    head = json.dumps(header, separators=(",", ":")).encode()
    side.write_bytes(b"\n".join([head, *lines[1:]]))
    # Stale digests: wrong on purpose, they must not reach the summary.
    text = side.read_text().replace('"r":"text_proven"', '"r":"engine_ids"')
    side.write_text(text)
    same(path)
    assert load_indexed(path) is not None  # the resume does not read digests
    write(path, records()[20:25])
    assert json.loads(side.read_bytes().split(b"\n")[0])["digest"] == derivation()
    same(path)


def drawn(i: int, with_prefix: bool) -> dict[str, Any]:
    """A posterior_sampled record (core/posterior.py): ids drawn, not bought; with or without
    a proven prefix kept from before the draw."""
    rec = record(2 + 9 * i) | {"ok": False, "issues": ["target_unresolved"]}
    rec |= {"evidence": "posterior_sampled", "posterior_sample": {"option": 1}}
    if with_prefix:
        rec["prefix"] = {"prefix_tokens": 3}
    return rec


def test_drawn_records_count_as_the_full_parse_counts_them(tmp_path: Path) -> None:
    """A drawn record: its prefix is exact under the default policy, its drawn ids count as
    drawn (never exact) only where the policy names posterior_sampled."""
    path = tmp_path / "records.jsonl"
    write(path, [*records(), drawn(1, True), drawn(2, False), drawn(3, True)])
    same(path)
    for accept in (DEFAULT_ACCEPT, (*DEFAULT_ACCEPT, "posterior_sampled")):
        y = tally_records(path).token_yield(accept)
        assert y == token_yield(iter_records(path), accept)
    named = tally_records(path).token_yield((*DEFAULT_ACCEPT, "posterior_sampled"))
    assert named["drawn_accepted"] > 0
    assert tally_records(path).token_yield(DEFAULT_ACCEPT)["drawn_accepted"] == 0
