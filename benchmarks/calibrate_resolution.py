"""Calibrate target resolution on a real model: does a posterior of p mean "wrong 1 - p"?

    .venv/bin/python -m benchmarks.calibrate_resolution --answers 500 --top-p 0.9 \
        --truths runs/calibration_truths.json --json docs/calibration_run500.json

1. Samples answers with the demo's SmolLM2 (transformers `generate`, temperature 1, the
   given top_p, top_k off); the sampled ids are the ground truth. They are cached
   (`--truths`) so that a second analysis does not sample again.
2. A stack changes what it returns the way Kimi's stacks do (docs: kimi-k25-format.md),
   keeping the billed completion_tokens: it splits the answer into a "reasoning" and a
   "content" at the first sentence end followed by whitespace (or returns it whole), strips
   the reasoning's trailing whitespace (vLLM strips the reasoning's) and the content's
   leading whitespace (a parser that trims around a marker). The text it hides is a
   whitespace string W between the two, at most one billed id beyond a space merged into the
   next word.
3. Candidates: every W of the form "", " ", t or t + " " (t: each whitespace token of the
   vocabulary) whose canonical encoding of reasoning + W + content has the billed length.
   Under "the split is canonical" the set is CLOSED for W worth at most one id (a whitespace
   run of one token, plus the single space a word token takes before it). One option proves
   the ids (`text_proven`); two or more go to `extraction.resolve` (pruned at the first id
   the sampler could not draw), scored with the same weights under the same sampling. The
   W of newlines and at most one space whose canonical ids miss the bill by 1 to 3 ids are
   kept with the record as readings (`short_readings`, `long_readings`), as
   core/candidates.py keeps newline tails: a non-canonical split of one may fit the bill.
4. Every usable record then goes through the split check (`extraction.split_check`, as the
   extract stage runs it): its ids are confirmed as a split the sampler could draw, or
   replaced by the split the target prefers (also a split of a kept near reading), or
   flagged.
   A set the target leaves unresolved keeps its proven prefix (`core/prefix.py`: the ids
   every option and near reading shares) where the target's prefix check confirms it
   (`extraction.prefix_check`, as the extract stage runs it after resolution), unless
   `--no-prefix-check`. The tokens of each rung that reach training are counted against
   the tokens bought (issue 33), and every kept prefix is compared with the truth.
5. Prints the shares (text-proven, target-resolved, unresolved), every usable record whose
   ids are not the sampled ones (silent: must be 0), resolved-wrong against the count the
   posteriors predict (sum of 1 - posterior over resolved records), the posteriors in bins,
   and the forward work (tokens) and time of resolution and the split check next to a plain
   extraction forward over the same answers.

Parallel, on a budget: `--part K/N` runs every N-th pair of answers and writes its raw
tallies (`--json`); `--merge PART.json ...` reports them as one run. With `--max-minutes`
a part starts no answer past that time (its JSON says where it stopped, `next_index`;
`--from-index` goes on from there in another run), and the report covers answers 0..M-1, M
the first answer no merged part did. `--records-out` writes every final record (JSON lines).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent

from kimi_pipe.config import compose  # noqa: E402
from kimi_pipe.core.candidates import NO_OPTION_FITS, READING_DISTANCE  # noqa: E402
from kimi_pipe.core.models import load_model  # noqa: E402
from kimi_pipe.core.prefix import training_ids, with_prefix  # noqa: E402
from kimi_pipe.core.prompt_render import prompt_ids  # noqa: E402
from kimi_pipe.extraction.hf_backend import HFBackend, resolve_model_path  # noqa: E402
from kimi_pipe.extraction.prefix_check import check_prefix, checkable_prefix  # noqa: E402
from kimi_pipe.extraction.resolve import (  # noqa: E402
    HFSuffixScorer,
    ResolveSettings,
    score_record,
)
from kimi_pipe.extraction.split_check import (  # noqa: E402
    check_record,
    checkable,
    vocabulary_of,
)
from kimi_pipe.stages.jobs.extract import extract_job  # noqa: E402

TOPICS = [
    "the sea", "a cat", "rain", "Paris", "music", "bread", "a river", "winter", "the moon",
    "trees", "coffee", "a bicycle", "chess", "the sun", "a library", "snow", "friendship",
    "a mountain", "tea", "the wind",
]  # fmt: skip
ASKS = [
    "Describe {} in one short sentence.",
    "Write two short lines about {}, one per line.",
    "Give me one word that goes with {}.",
    "Name two things about {}, each on its own line.",
    "Say something short about {}.",
    "Write a title about {}, then one sentence on the next line.",
]


def load_target() -> tuple[Any, Path, HFBackend, Any, list[int]]:
    """The demo's SmolLM2: its model (conf/model/smollm2.yaml), weights directory, extraction
    backend (float32), transformers tokenizer (the same tokenizer.json) and end-of-turn ids."""
    from transformers import AutoTokenizer

    cfg = compose(["model=smollm2"])
    model = load_model(cfg.model)
    path = resolve_model_path(extract_job(cfg))
    backend = HFBackend(path, model_name="smollm2")
    tok = AutoTokenizer.from_pretrained(str(path))
    return model, path, backend, tok, model.encode(model.format.output.end.render())


def calibration_prompts(model: Any, answers: int) -> list[list[int]]:
    """The prompt ids of the first `answers` questions (the same questions in every script)."""
    questions = [ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS)) % len(TOPICS)])
                 for i in range(answers)]  # fmt: skip
    return [prompt_ids(model, [{"role": "user", "content": q}], None) for q in questions]


def hidden_gaps(tok: Any) -> tuple[list[str], list[str]]:
    """The vocabulary's whitespace token texts, and every W a stack may hide: "", " ", t and
    t + " " for each whitespace token t."""
    spaces = [tok.decode([t]) for t in whitespace_ids(tok)]
    return spaces, ["", " "] + [g for t in spaces for g in (t, t + " ")]


def sample_batches(
    hf: Any, prompts: list[list[int]], key: Mapping[str, Any], end_id: int
) -> Iterator[tuple[int, list[list[int]]]]:
    """Ground-truth output ids (up to and including the end id), one batch at a time:
    (index of the batch's first prompt, its answers). `key`: seed, batch, temperature,
    top_p, max_new_tokens. The same calls in the same order from one seed, so batch b holds
    the same answers whoever asks."""
    torch.manual_seed(key["seed"])
    for start in range(0, len(prompts), key["batch"]):
        chunk = prompts[start : start + key["batch"]]
        longest = max(map(len, chunk))
        ids = torch.full((len(chunk), longest), end_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(chunk):  # left padding: every row ends where generation starts
            ids[row, longest - len(p) :] = torch.tensor(p)
            mask[row, longest - len(p) :] = 1
        with torch.inference_mode():
            seqs = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=key["temperature"],
                top_p=key["top_p"],
                top_k=0,
                max_new_tokens=key["max_new_tokens"],
                eos_token_id=end_id,
                pad_token_id=end_id,
            )
        out = []
        for row in seqs[:, longest:].tolist():
            cut = row.index(end_id) + 1 if end_id in row else len(row)
            out.append(row[:cut])
        yield start, out


def sample_answers(
    hf: Any, prompts: list[list[int]], args: argparse.Namespace, end_id: int
) -> list[list[int]]:
    """Ground-truth output ids per prompt (`sample_batches` with the command line's key)."""
    out: list[list[int]] = []
    for _start, answers in sample_batches(hf, prompts, vars(args), end_id):
        out.extend(answers)
        print(f"[calibrate] sampled {len(out)}/{len(prompts)}", file=sys.stderr, flush=True)
    return out


def whitespace_ids(tok: Any) -> list[int]:
    """Every vocabulary id that decodes to whole whitespace text."""
    found = []
    for i in range(len(tok)):
        text = tok.decode([i])
        if text and not text.strip() and "\ufffd" not in text:
            found.append(i)
    return found


def split_point(tok: Any, body: list[int]) -> int | None:
    """First id boundary after a sentence end whose next text starts with whitespace (and
    has more than whitespace after it): where the stack puts its reasoning/content split."""
    for i in range(1, len(body)):
        before, after = tok.decode(body[:i]), tok.decode(body[i:])
        head = before.rstrip()
        if head[-1:] in (".", "!", "?", ":") and after[:1].isspace() and after.strip():
            return i
    return None


def near_gap(gap: str) -> bool:
    """The readings a record keeps beside its options come, as in core/candidates.py, from
    newline runs (and here at most one space, SmolLM2's tokens joining one), not from every
    whitespace token of the vocabulary: each costs a rebuild there. The options are all."""
    return set(gap) <= {"\n", " "} and gap.count(" ") <= 1


def gap_options(
    model: Any, reasoning: str, content: str, end: list[int], billed: int, gaps: list[str]
) -> tuple[list[tuple[list[int], str]], ...]:
    """Every (ids, W) with W in `gaps` whose canonical ids have the billed length (the
    options), and the near ones (`near_gap`) whose canonical ids miss it by at most
    READING_DISTANCE, shorter or longer (a non-canonical split of one may fit the bill)."""
    seen: dict[tuple[int, ...], str] = {}
    short: dict[tuple[int, ...], str] = {}
    long: dict[tuple[int, ...], str] = {}
    for gap in gaps:
        ids = model.encode([reasoning + gap + content]) + end
        off = len(ids) - billed
        if off == 0:
            seen.setdefault(tuple(ids), gap)
        elif abs(off) <= READING_DISTANCE and near_gap(gap):
            (short if off < 0 else long).setdefault(tuple(ids), gap)
    return (
        [(list(ids), gap) for ids, gap in seen.items()],
        [(list(ids), gap) for ids, gap in short.items()],
        [(list(ids), gap) for ids, gap in long.items()],
    )


def readings(options: list[tuple[list[int], str]]) -> list[dict[str, Any]]:
    return [
        {"output_ids": ids, "loss_mask": [1] * len(ids), "label": f"hidden {gap!r}"}
        for ids, gap in options
    ]


def diverge_of(options: list[list[int]]) -> int:
    shortest = min(map(len, options))
    for j in range(shortest):
        if len({o[j] for o in options}) > 1:
            return j
    return shortest


def base_record(
    sid: str, prompt: list[int], ids: list[int], sampling: dict[str, float]
) -> dict[str, Any]:
    return {
        "id": sid, "ok": True, "evidence": "text_proven", "issues": [], "notes": [],
        "prompt_ids": prompt, "output_ids": ids,
        "loss_mask": [0] * len(prompt) + [1] * len(ids), "sampling": sampling,
        "completion_tokens_reported": len(ids),
    }  # fmt: skip


def gap_record(
    sid: str, prompt: list[int], options: list[tuple[list[int], str]], sampling: dict[str, float]
) -> dict[str, Any]:
    """An unresolved record whose closed set holds every option of the hidden whitespace."""
    first = options[0][0]
    rec = base_record(sid, prompt, first, sampling)
    rec.update(ok=False, evidence="unresolved", issues=["reasoning_tail_unverifiable"])
    rec["candidates"] = {
        "closed": True,
        "why_open": None,
        "classes": ["reasoning_tail"],
        "diverge_at": diverge_of([ids for ids, _ in options]),
        "options": readings(options),
    }
    return rec


def no_option_record(
    sid: str,
    prompt: list[int],
    text: str,
    readings_: list[tuple[list[int], str]],
    billed: int,
    sampling: dict[str, float],
) -> dict[str, Any]:
    """A record no option of which fits the bill: its own ids are the returned text's
    (no hidden whitespace), flagged, with an open set of no option (core/candidates.py)."""
    own = next((ids for ids, gap in readings_ if gap == ""), readings_[0][0])
    rec = base_record(sid, prompt, own, sampling)
    rec.update(ok=False, evidence="unresolved")
    rec["issues"] = ["reasoning_tail_unverifiable", "billing_mismatch"]
    rec["completion_tokens_reported"] = billed
    rec["candidates"] = {
        "closed": False,
        "why_open": NO_OPTION_FITS,
        "classes": ["reasoning_tail"],
        "diverge_at": None,
        "options": [],
    }
    return rec


def posterior_bins(posteriors: list[tuple[float, bool]]) -> dict[str, dict[str, float]]:
    """Resolved records per posterior bin: how many, how many wrong, how many predicted."""
    edges = [(0.999, 0.9999), (0.9999, 0.999999), (0.999999, 1.0), (1.0, 1.0)]
    out = {}
    for low, high in edges:
        inside = [(p, w) for p, w in posteriors if (p == 1.0 if low == high else low <= p < high)]
        name = "1.0 (others impossible or beyond float)" if low == high else f"[{low}, {high})"
        out[name] = {
            "records": len(inside),
            "wrong": sum(w for _, w in inside),
            "predicted_wrong": sum(1 - p for p, _ in inside),
        }
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", type=int, default=500)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--min-posterior", type=float, default=0.999)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--score-dtype",
        default="float32",
        help="dtype the target scores in (sampling is float32): bfloat16 stands for a provider "
        "whose numerics differ from the target's",
    )
    ap.add_argument("--extract-sample", type=int, default=64, help="answers timed for extraction")
    ap.add_argument("--truths", type=Path, default=None, help="cache of the sampled ids (JSON)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too")
    ap.add_argument(
        "--no-prefix-check",
        action="store_true",
        help="leave the proven prefixes of unresolved sets out (the figures before issue 33)",
    )
    ap.add_argument(
        "--part",
        default=None,
        help="K/N: only the answers i with i %% N == K; --json gets this part's raw tallies "
        "(for --merge), so that N processes share the cores",
    )
    ap.add_argument("--merge", type=Path, nargs="+", default=None, help="parts' JSON to merge")
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="start no answer after this: the figures then cover the first answers the "
        "merged parts did (answers 0..M-1, M the first answer none did)",
    )
    ap.add_argument(
        "--from-index",
        type=int,
        default=0,
        help="skip this part's answers before this index (a part stopped by --max-minutes "
        "goes on from its next_index; --merge takes both)",
    )
    ap.add_argument("--records-out", type=Path, default=None, help="every final record, JSON lines")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    if args.merge:
        loaded = [json.loads(p.read_text()) for p in args.merge]
        return report(merge_raw(loaded, args.answers), args)
    torch.set_num_threads(args.threads)
    part, parts = (int(x) for x in (args.part or "0/1").split("/"))

    model, path, backend, tok, end = load_target()  # the extraction backend's own weights
    hf = backend.model
    # The target that resolves: the same weights, in the scoring dtype.
    judge = (
        hf
        if args.score_dtype == "float32"
        else HFBackend(path, model_name="smollm2", dtype=args.score_dtype).model
    )
    end_id = end[-1]
    prompts = calibration_prompts(model, args.answers)
    key = {k: getattr(args, k) for k in ("answers", "temperature", "top_p", "max_new_tokens",
                                         "batch", "seed")}  # fmt: skip
    cached = json.loads(args.truths.read_text()) if args.truths and args.truths.exists() else None
    t0 = time.monotonic()
    if cached and cached.get("key") == key:
        truths = cached["truths"]
        sample_s = float(cached["seconds"])
        print(f"[calibrate] {len(truths)} sampled answers from {args.truths}", file=sys.stderr)
    else:
        truths = sample_answers(hf, prompts, args, end_id)
        sample_s = time.monotonic() - t0
        if args.truths:
            args.truths.write_text(json.dumps({"key": key, "seconds": sample_s, "truths": truths}))

    spaces, gaps = hidden_gaps(tok)
    # This stack only hides whitespace: a bill no reading fits is a split (billing_splits).
    settings = ResolveSettings(
        min_posterior=args.min_posterior, max_options=len(gaps), billing_splits=True
    )
    scorer = HFSuffixScorer(judge, "smollm2")
    vocab = vocabulary_of(model.tokenizer)
    sampling = {"temperature": args.temperature, "top_p": args.top_p}

    counts: dict[str, int] = {}  # for the progress line; the figures come from per_answer
    seconds = {"resolution": 0.0, "split_check": 0.0, "prefix_check": 0.0}
    split_tokens = prefix_check_tokens = 0
    # Pairs of answers dealt in turn: the asks alternate, so i % parts would give a part
    # every other ask (and most of the hard sets to one part).
    mine = [i for i in range(args.from_index, len(truths)) if (i // 2) % parts == part]
    per_answer: list[dict[str, Any]] = []
    cur: dict[str, Any] = {}
    next_index: int | None = None
    out = args.records_out.open("w") if args.records_out else None

    def count(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1
        cur["counts"][key] = cur["counts"].get(key, 0) + 1

    def add(key: str, n: int) -> None:
        cur["tokens"][key] = cur["tokens"].get(key, 0) + n

    def keep(rec: dict[str, Any]) -> None:
        if out is not None:
            out.write(json.dumps(rec) + "\n")

    print(f"[calibrate] {len(spaces)} whitespace ids, {len(gaps)} gaps; reconstructing "
          f"{len(mine)} answers (part {part}/{parts})", file=sys.stderr)  # fmt: skip
    for n_done, i in enumerate(mine):
        if args.max_minutes is not None and time.monotonic() - t0 > 60 * args.max_minutes:
            next_index = i
            break
        cur = {"i": i, "counts": {}, "tokens": {}}
        per_answer.append(cur)
        prompt, truth = prompts[i], truths[i]
        if n_done and n_done % 25 == 0:
            print(f"[calibrate] {n_done}/{len(mine)} {dict(sorted(counts.items()))}",
                  file=sys.stderr, flush=True)  # fmt: skip
        add("bought", len(truth))
        ended = truth[-1:] == [end_id]
        body = truth[:-1] if ended else truth
        tail = end if ended else []
        text = tok.decode(body, skip_special_tokens=True)
        if model.encode([text]) + tail != truth:
            count("noncanonical_truth")
        if not ended:
            count("cut_by_max_tokens")
        at = split_point(tok, body)
        if at is None:
            count("shape_whole")
            reasoning, content = text.rstrip(), ""
        else:
            count("shape_reasoning_content")
            reasoning, content = tok.decode(body[:at]).rstrip(), tok.decode(body[at:]).lstrip()
        if reasoning + content != text:
            count("stack_hid_whitespace")
        options, short, long = gap_options(model, reasoning, content, tail, len(truth), gaps)
        posterior = 1.0
        if not options:
            # As core/candidates.py keeps it: no option, the readings, for the split check.
            rec = no_option_record(
                f"a{i}", prompt, reasoning + content, short + long, len(truth), sampling
            ) if short or long else {}  # fmt: skip
            short = [r for r in short if r[0] != rec.get("output_ids")]
            long = [r for r in long if r[0] != rec.get("output_ids")]
            if not (short or long):
                count("unresolved_no_option_fits_billing")
                continue
            count("no_option_fits_billing")
        elif len(options) == 1:
            rec = base_record(f"a{i}", prompt, options[0][0], sampling)
            rec["notes"] = ["single_candidate"]
        else:
            cur["set_size"] = len(options)
            t1 = time.monotonic()
            scored = score_record(gap_record(f"a{i}", prompt, options, sampling), scorer, settings)
            seconds["resolution"] += time.monotonic() - t1
            assert scored is not None
            if not scored["ok"]:
                count("target_unresolved")
                rec = dict(scored)
                rec["short_readings"] = readings(short)
                rec["long_readings"] = readings(long)
                rec = dict(with_prefix(rec))  # type: ignore[arg-type]  # every reading counts
                if not args.no_prefix_check and checkable_prefix(rec):
                    t4 = time.monotonic()
                    checked_prefix, cost = check_prefix(rec, judge, vocab, settings, "smollm2")
                    seconds["prefix_check"] += time.monotonic() - t4
                    prefix_check_tokens += cost
                    assert checked_prefix is not None
                    kept = checked_prefix["evidence"] == "prefix_proven"
                    count("prefix_kept" if kept else "prefix_withdrawn")
                    if kept:
                        ids, _ = training_ids(checked_prefix)
                        cut = ids[len(prompt) :]
                        add("exact_prefix_proven", len(cut))
                        if cut != truth[: len(cut)]:
                            count("prefix_proven_WRONG")  # silent
                            add("silent", len(cut))
                    keep(dict(checked_prefix))
                    continue
                count("no_prefix")
                keep(rec)
                continue
            posterior = scored["resolution"]["posterior"]
            rec = dict(scored)
        rec["short_readings"] = readings(short)
        rec["long_readings"] = readings(long)
        t2 = time.monotonic()
        checked, cost = check_record(rec, judge, vocab, settings, "smollm2")
        seconds["split_check"] += time.monotonic() - t2
        split_tokens += cost
        assert checked is not None and checkable(rec, settings.billing_splits) is None
        outcome = (checked.get("split_check") or {}).get("chosen")
        count(f"split_{outcome or 'unresolved'}")
        keep(dict(checked))
        if not checked["ok"]:
            count("unresolved_by_split_check")
            if not options:
                count("no_option_unresolved")
            continue
        # The split check weighs the set's other options with every split: its posterior
        # is the record's whole posterior.
        posterior = checked["split_check"].get("posterior", posterior)
        rec = checked
        wrong = rec["output_ids"] != truth
        rung = rec["evidence"]
        count(rung)
        add(f"exact_{rung}", len(rec["output_ids"]))
        if not options:
            count(f"no_option_{rung}" + ("_wrong" if wrong else ""))
            add(f"exact_no_option_{rung}", len(rec["output_ids"]))
        if wrong:
            count(f"{rung}_WRONG")  # silent: a usable record with ids the model did not sample
            add("silent", len(rec["output_ids"]))
            cur["wrong_example"] = {
                "answer": i,
                "rung": rung,
                "posterior": posterior,
                "truth_text": text,
                "truth_ids": len(truth),
                "truth_canonical_ids": len(model.encode([text])) + len(tail),
                "record_text": tok.decode(rec["output_ids"], skip_special_tokens=True),
                "options": len(options),
                "option_gaps": [g for _, g in options][:8],
                "split_check": rec.get("split_check"),
            }
        if rung == "target_resolved":
            cur["posterior"] = [posterior, wrong]
    if out is not None:
        out.close()

    # What extraction costs anyway: a plain forward over the answers, batched like extract
    # (on the first --extract-sample of them, scaled by tokens to all).
    seqs = [prompts[a["i"]] + truths[a["i"]] for a in per_answer]
    timed = seqs[: args.extract_sample]
    t3 = time.monotonic()
    for start in range(0, len(timed), 16):
        backend.forward(timed[start : start + 16])
    extract_s = (time.monotonic() - t3) * sum(map(len, seqs)) / max(1, sum(map(len, timed)))
    raw = {
        "per_answer": per_answer,
        "next_index": next_index,
        "seconds": {**seconds, "sampling": sample_s, "extraction_forward": extract_s},
        "split_check_tokens": split_tokens,
        "prefix_check_tokens": prefix_check_tokens,
        "resolution_tokens": {"prefix": scorer.prefix_tokens, "suffix": scorer.suffix_tokens},
        "options_pruned_unrun": scorer.pruned,
        "extraction_tokens": sum(map(len, seqs)),
        "whitespace_ids": len(spaces),
    }
    if parts > 1:
        raw["part"] = args.part
        if args.json:
            args.json.write_text(json.dumps(raw) + "\n")
        print(json.dumps({"answers": len(per_answer), "next_index": next_index}))
        return 0
    return report(merge_raw([raw], args.answers), args)


def merge_raw(parts: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """The raw tallies of --part runs as one run's, over answers 0..M-1: M is the first of
    the `total` answers no part did (every answer when all were done). Forward work and
    seconds are those of every answer done."""
    done = [a for raw in parts for a in raw["per_answer"]]
    indices = [a["i"] for a in done]
    if len(set(indices)) != len(indices):
        raise SystemExit("an answer is in two parts: merge each part once")
    covered = set(indices)
    limit = next((i for i in range(total) if i not in covered), None)
    answers = [a for a in done if limit is None or a["i"] < limit]
    out: dict[str, Any] = {
        "answers": len(answers), "answers_done": sum(len(r["per_answer"]) for r in parts),
        "first_answers_only": limit, "counts": {}, "tokens": {}, "predicted_wrong": 0.0,
        "posteriors": [], "set_sizes": [], "wrong_examples": [], "seconds": {},
        "split_check_tokens": 0, "prefix_check_tokens": 0, "resolution_tokens": {},
        "options_pruned_unrun": 0, "extraction_tokens": 0,
        "whitespace_ids": parts[0]["whitespace_ids"],
    }  # fmt: skip
    for answer in sorted(answers, key=lambda a: a["i"]):
        for key in ("counts", "tokens"):
            for name, value in answer[key].items():
                out[key][name] = out[key].get(name, 0) + value
        if "posterior" in answer:
            out["posteriors"].append(answer["posterior"])
            out["predicted_wrong"] += 1.0 - answer["posterior"][0]
        if "set_size" in answer:
            out["set_sizes"].append(answer["set_size"])
        if "wrong_example" in answer:
            out["wrong_examples"].append(answer["wrong_example"])
    for raw in parts:
        for key in ("split_check_tokens", "prefix_check_tokens", "options_pruned_unrun",
                    "extraction_tokens"):  # fmt: skip
            out[key] += raw[key]
        for key in ("seconds", "resolution_tokens"):
            for name, value in raw[key].items():
                out[key][name] = out[key].get(name, 0) + value
    out["seconds"]["sampling"] = parts[0]["seconds"]["sampling"]
    if len(parts) > 1:
        out["parts"] = len(parts)
    return out


def report(raw: dict[str, Any], args: argparse.Namespace) -> int:
    """Figures of the run (or of merged parts): shares of records and of tokens bought."""
    counts, tokens, seconds = raw["counts"], raw["tokens"], raw["seconds"]
    posteriors = [(float(p), bool(w)) for p, w in raw["posteriors"]]
    set_sizes = raw["set_sizes"]
    n = raw["answers"]
    proven = counts.get("text_proven", 0)
    resolved = counts.get("target_resolved", 0)
    silent = sum(v for k, v in counts.items() if k.endswith("_WRONG"))
    bought = tokens.get("bought", 0)
    whole = tokens.get("exact_text_proven", 0) + tokens.get("exact_target_resolved", 0)
    prefixes = tokens.get("exact_prefix_proven", 0)
    # resolve.billing_splits off (the default): the no-option records stay flagged.
    no_option = tokens.get("exact_no_option_text_proven", 0) + tokens.get(
        "exact_no_option_target_resolved", 0
    )
    extract_s = seconds.get("extraction_forward", 0.0)
    figures = {
        "answers": n,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens,
        "min_posterior": args.min_posterior,
        "score_dtype": args.score_dtype,
        "prefix_check": not args.no_prefix_check,
        "counts": dict(sorted(counts.items())),
        "share_text_proven": proven / n,
        "share_target_resolved": resolved / n,
        "share_proven_or_resolved": (proven + resolved) / n,
        "share_unresolved": 1 - (proven + resolved) / n,
        "share_proven_or_resolved_billing_splits_off": (
            proven
            + resolved
            - counts.get("no_option_target_resolved", 0)
            - counts.get("no_option_text_proven", 0)
        )
        / n,
        # Issue 33: of the completion tokens bought, those reaching training as exact.
        "tokens": dict(sorted(tokens.items())),
        "token_share_exact_whole": whole / bought if bought else None,
        "token_share_exact_with_prefixes": (whole + prefixes) / bought if bought else None,
        "token_share_exact_with_prefixes_billing_splits_off": (
            (whole + prefixes - no_option) / bought if bought else None
        ),
        "silent": silent,
        "silent_tokens": tokens.get("silent", 0),
        "resolved_wrong": counts.get("target_resolved_WRONG", 0),
        "resolved_wrong_predicted": raw["predicted_wrong"],
        "whitespace_ids": raw["whitespace_ids"],
        "seconds_sampling": round(seconds.get("sampling", 0.0), 1),
        "seconds_resolution": round(seconds.get("resolution", 0.0), 2),
        "seconds_split_check": round(seconds.get("split_check", 0.0), 2),
        "seconds_prefix_check": round(seconds.get("prefix_check", 0.0), 2),
        "seconds_extraction_forward": round(extract_s, 2),  # scaled from --extract-sample
        "resolution_share_of_extraction": (
            seconds.get("resolution", 0.0) / extract_s if extract_s else None
        ),
        "split_check_share_of_extraction": (
            seconds.get("split_check", 0.0) / extract_s if extract_s else None
        ),
        "resolution_tokens": raw["resolution_tokens"],
        "options_pruned_unrun": raw["options_pruned_unrun"],
        "split_check_tokens": raw["split_check_tokens"],
        "prefix_check_tokens": raw["prefix_check_tokens"],
        "extraction_tokens": raw["extraction_tokens"],
        "candidate_sets": {
            "scored": len(set_sizes),
            "options_min": min(set_sizes, default=0),
            "options_max": max(set_sizes, default=0),
            "options_mean": sum(set_sizes) / len(set_sizes) if set_sizes else 0,
        },
        "resolved_posterior_bins": posterior_bins(posteriors),
        "wrong_examples": raw["wrong_examples"],
    }
    figures["answers_done"] = raw["answers_done"]  # forward work and seconds cover these
    figures["first_answers_only"] = raw["first_answers_only"]
    if "parts" in raw:
        figures["parts"] = raw["parts"]
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    if posteriors:
        low = min(p for p, _ in posteriors)
        print(f"lowest resolved posterior {low:.6f}; wrong at posteriors "
              f"{[round(p, 6) for p, w in posteriors if w]}")  # fmt: skip
    return 0 if silent == 0 and math.isfinite(raw["predicted_wrong"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
