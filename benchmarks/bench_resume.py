"""Generate's resume over large records: the index of ids against the full parse, same run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_resume.py [--gb 1] [--dir DIR] [--json OUT]

Writes about `--gb` GB of synthetic records and their index (generate's shape: ids, token
id lists, text, usage, cost; about 4 KB a record, 1 in 20 an error record), then times in
the same process:

* full: `records.parse_resume_index` (what every resume did: parse every record);
* index build (--time-build): `records_index.rebuild` (once, when a run without an index is
  first opened);
* indexed: `records_index.load_indexed` (the resume now: the index plus the records past it);
* writer open: `IndexedRecordWriter(path)` (the generate writer's start: checks the index);
* summary, parsed: the record counts and yield of summary.json as generate computed them
  before the index held digests (every record parsed; `parsed_summary` below);
* summary, indexed: `generation.summary.tally_records` (the digests of the index plus the
  records past it) and its yield, in a forked child, with the child's peak resident memory.

`--no-parsed-summary` skips the old summary: at 10 GB it holds every answered record for its
yield and was killed by the OOM killer here (20 GB resident, 23 GB machine).

Both resume reads are checked equal, and both summaries. The page cache is warm for both
(the file was just written), so `full` is the parse, not the disk. No assertion: figures
for docs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import resource
import shutil
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from kimi_pipe.core.evidence import DEFAULT_ACCEPT, evidence_of
from kimi_pipe.core.token_yield import token_yield
from kimi_pipe.generation.summary import tally_records
from kimi_pipe.store.records import iter_records, parse_resume_index, record_cost
from kimi_pipe.store.records_index import (
    IndexedRecordWriter,
    _entry,
    _header,
    _header_line,
    _line,
    index_path,
    load_indexed,
    rebuild,
)


def parsed_summary(path: Path) -> dict[str, Any]:
    """summary.json's record counts and yield as generate computed them before: every record
    parsed (generation/job.py before the digests; tests/test_summary_index.py holds the same
    reference)."""
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
        "spend": round(spend, 6),
        "tokens": (prompt_tokens, reported, rebuilt),
        "yield": token_yield(iter_records(path), DEFAULT_ACCEPT, price_out_per_token=2e-6),
    }


def indexed_summary(path: Path) -> dict[str, Any]:
    tally = tally_records(path)
    return {
        "counts": {k: v for k, v in tally.counts.items() if v},
        "flagged": dict(tally.flagged),
        "failed": dict(tally.failed),
        "providers": dict(tally.providers),
        "spend": round(tally.spend, 6),
        "tokens": (tally.prompt_tokens, tally.reported, tally.rebuilt),
        "yield": tally.token_yield(DEFAULT_ACCEPT, price_out_per_token=2e-6),
    }


def summary_peak(path: Path) -> tuple[dict[str, Any], float, int]:
    """The indexed summary, its seconds and this process's peak resident memory (KiB)."""
    summary, seconds = timed(indexed_summary, path)
    return summary, seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def synthetic(i: int, rng: random.Random) -> dict[str, Any]:
    if i % 20 == 19:
        return {"id": f"B5-{i:09d}", "error": {"class": "RateLimitError"}, "cost": 0.0}
    n_prompt, n_out = rng.randint(150, 400), rng.randint(150, 450)
    flagged = i % 7 == 3  # some answers flagged, as a run has them
    return {
        "id": f"B5-{i:09d}",
        "ok": not flagged,
        "issues": ["billing_drift"] if flagged else [],
        "completion_tokens_reported": n_out,
        "completion_tokens_reconstructed": n_out + flagged,
        "prompt_ids": [rng.randrange(163840) for _ in range(n_prompt)],
        "output_ids": [rng.randrange(163840) for _ in range(n_out)],
        "text": "x" * rng.randint(200, 800),
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out},
        "cost": round(rng.random() * 1e-3, 8),
        "provider": "synthetic",
    }


def write_records(path: Path, target_bytes: int) -> int:
    """Write records and their index lines until the file holds `target_bytes`: the bytes
    `IndexedRecordWriter` writes (tests/test_records_index.py tests the writer), without
    its json.dumps per record, which would take most of an hour at 10 GB here. A block of
    distinct records is reused with fresh ids."""
    rng = random.Random(0)
    block = [synthetic(i, rng) for i in range(2000)]
    lines = [json.dumps(r, separators=(",", ":")) for r in block]
    written = n = 0
    with open(path, "wb") as fh, open(index_path(path), "wb") as ih:
        ih.write(_header_line(_header(path)))
        while written < target_bytes:
            for rec, line in zip(block, lines, strict=True):
                data = (line.replace(rec["id"], f"B5-{n:09d}", 1) + "\n").encode()
                fh.write(data)
                written += len(data)
                ih.write(_line(_entry({**rec, "id": f"B5-{n:09d}"}, written)))
                n += 1
                if written >= target_bytes:
                    break
    return n


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--time-build", action="store_true", help="also time a full index rebuild")
    ap.add_argument(
        "--no-parsed-summary",
        action="store_true",
        help="skip the old summary (every record parsed): at 10 GB it needs more memory than "
        "this machine has, since its yield holds every answered record",
    )
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_resume_", dir=args.dir))
    try:
        path = root / "records.jsonl"
        records, write_s = timed(write_records, path, int(args.gb * 1e9))
        full, full_s = timed(parse_resume_index, path)
        fast, fast_s = timed(load_indexed, path)
        build_s = timed(rebuild, path)[1] if args.time_build else None
        assert fast == full, "the indexed resume differs from the full parse"
        writer, open_s = timed(IndexedRecordWriter, path)
        writer.close()
        # The summary from the index in a child forked before the parent holds anything big,
        # so that its peak resident memory is the summary's own (plus the interpreter).
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
            new_summary, new_summary_s, new_summary_rss = pool.submit(summary_peak, path).result()
        if args.no_parsed_summary:
            old_summary_s = None
        else:
            old_summary, old_summary_s = timed(parsed_summary, path)
            assert new_summary == old_summary, "the indexed summary differs from the full parse"
        report = {
            "records": records,
            "records_bytes": path.stat().st_size,
            "index_bytes": index_path(path).stat().st_size,
            "write_s": round(write_s, 2),
            "full_parse_s": round(full_s, 3),
            "index_build_s": round(build_s, 3) if build_s is not None else None,
            "indexed_resume_s": round(fast_s, 3),
            "writer_open_s": round(open_s, 3),
            "speedup_full_over_indexed": round(full_s / fast_s, 1),
            "summary_parsed_s": round(old_summary_s, 3) if old_summary_s else None,
            "summary_indexed_s": round(new_summary_s, 3),
            "summary_indexed_peak_rss_mb": round(new_summary_rss / 1024, 1),
            "summary_speedup": round(old_summary_s / new_summary_s, 1) if old_summary_s else None,
            "ids": len(full.ids),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
