"""Calibrate target resolution on a real model: does a posterior of p mean "wrong 1 - p"?

    .venv/bin/python scripts/calibrate_resolution.py --answers 500 --top-p 0.9

1. Samples answers with the demo's SmolLM2 (transformers `generate`, temperature 1, the
   given top_p, top_k off); the sampled ids are the ground truth.
2. A stack strips each answer's trailing whitespace the way vLLM strips the reasoning's
   (`str.rstrip()`), keeping the billed completion_tokens.
3. Reconstructs with the project's code (`core.reconstruction.reconstruct`, default
   `unknown` profile) and, where `kimi_pipe.core.candidates` exists, its candidate sets.
4. Where billing says the stack removed exactly one token of whitespace, every single
   whitespace token of the vocabulary that fits (canonical encoding, billed length) is an
   option: a CLOSED set under "the split is canonical". `extraction.resolve` scores them
   under the same sampling with the same weights, at resolve.min_posterior.
5. Prints the shares (text-proven, resolved, unresolved), resolved-wrong against the
   ground truth and the count the posteriors predict (sum of 1 - posterior), and the answers
   whose sampled ids are not the canonical encoding of their text (no text-only method can
   recover those; counted apart).
It also times a plain extraction forward over every answer (what extract does anyway) and
reports resolution's extra forward time as a share of it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kimi_pipe.config import compose  # noqa: E402
from kimi_pipe.core.models import load_model  # noqa: E402
from kimi_pipe.core.prompt_render import prompt_ids  # noqa: E402
from kimi_pipe.core.reconstruction import reconstruct  # noqa: E402
from kimi_pipe.core.serving import UNKNOWN_PROFILE  # noqa: E402
from kimi_pipe.extraction.hf_backend import HFBackend, resolve_model_path  # noqa: E402
from kimi_pipe.extraction.resolve import (  # noqa: E402
    HFSuffixScorer,
    ResolveSettings,
    score_record,
)

TOPICS = [
    "the sea", "a cat", "rain", "Paris", "music", "bread", "a river", "winter", "the moon",
    "trees", "coffee", "a bicycle", "chess", "the sun", "a library", "snow", "friendship",
    "a mountain", "tea", "the wind",
]  # fmt: skip
ASKS = [
    "Describe {} in one short sentence.",
    "Give me one word that goes with {}.",
    "Write a three-word title about {}.",
    "Say something short about {}.",
    "What colour is {}? Answer briefly.",
]


def sample_answers(
    hf: Any, prompts: list[list[int]], args: argparse.Namespace, end_id: int
) -> list[list[int]]:
    """Ground-truth output ids (up to and including the end id) per prompt, batched."""
    out: list[list[int]] = []
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    for start in range(0, len(prompts), args.batch):
        chunk = prompts[start : start + args.batch]
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
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=0,
                max_new_tokens=args.max_new_tokens,
                eos_token_id=end_id,
                pad_token_id=end_id,
            )
        for row in seqs[:, longest:].tolist():
            cut = row.index(end_id) + 1 if end_id in row else len(row)
            out.append(row[:cut])
        print(f"[calibrate] sampled {len(out)}/{len(prompts)}", file=sys.stderr, flush=True)
    del gen
    return out


def whitespace_tokens(tok: Any) -> list[str]:
    """Every vocabulary token that decodes to whole whitespace text."""
    found = []
    for i in range(len(tok)):
        text = tok.decode([i])
        if text and not text.strip() and "\ufffd" not in text:
            found.append(text)
    return sorted(set(found))


def tail_options(
    model: Any, content: str, missing: int, spaces: list[str], end: list[int]
) -> list[tuple[list[int], str]]:
    """Whitespace tails adding exactly `missing` (= 1) ids to the canonical encoding."""
    base = len(model.encode([content]))
    seen: dict[tuple[int, ...], str] = {}
    for ws in spaces:
        ids = model.encode([content + ws])
        if len(ids) - base == missing:
            seen.setdefault(tuple(ids), ws)
    return [(list(ids) + end, ws) for ids, ws in sorted(seen.items(), key=lambda kv: kv[1])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", type=int, default=500)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--min-posterior", type=float, default=0.999)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--extract-sample", type=int, default=64, help="answers timed for extraction")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = compose(["model=smollm2"])
    model = load_model(cfg.model)
    path = resolve_model_path(cfg)
    backend = HFBackend(path, model_name="smollm2")  # the extraction backend's own weights
    hf = backend.model
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))  # the same tokenizer.json the model uses
    end = model.encode(model.format.output.end.render())
    end_id = end[-1]

    questions = [ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS)) % len(TOPICS)])
                 for i in range(args.answers)]  # fmt: skip
    messages = [[{"role": "user", "content": q}] for q in questions]
    prompts = [prompt_ids(model, m, None) for m in messages]
    t0 = time.monotonic()
    truths = sample_answers(hf, prompts, args, end_id)
    sample_s = time.monotonic() - t0

    try:
        from kimi_pipe.core.candidates import enumerate_candidates
    except ImportError:
        enumerate_candidates = None  # type: ignore[assignment]
    spaces = whitespace_tokens(tok)
    settings = ResolveSettings(min_posterior=args.min_posterior, max_options=len(spaces) + 1)
    scorer = HFSuffixScorer(hf, "smollm2")
    sampling = {"temperature": args.temperature, "top_p": args.top_p}

    counts: dict[str, int] = {}
    predicted_wrong = 0.0
    posteriors: list[tuple[float, bool]] = []
    resolve_s = 0.0

    def count(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    print(f"[calibrate] {len(spaces)} whitespace tokens; reconstructing", file=sys.stderr)
    for i, (msgs, prompt, truth) in enumerate(zip(messages, prompts, truths, strict=True)):
        ended = truth[-1:] == [end_id]
        text = tok.decode(truth[:-1] if ended else truth, skip_special_tokens=True)
        canonical = model.encode([text]) + (end if ended else [])
        if canonical != truth:
            count("noncanonical_truth")
        stripped = text.rstrip()
        if stripped != text:
            count("tail_stripped")
        response = {
            "choices": [
                {
                    "message": {"role": "assistant", "content": stripped},
                    "finish_reason": "stop" if ended else "length",
                }
            ],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(truth)},
        }
        rec = reconstruct(model, msgs, None, response, serving=UNKNOWN_PROFILE)
        if not ended:
            count("cut_by_max_tokens")
        if rec.ok:
            count("text_proven")
            if rec.output_ids != truth:
                count("text_proven_WRONG")  # silent: must stay 0 unless the truth is non-canonical
            continue
        if enumerate_candidates is not None:
            cands = enumerate_candidates(model, msgs, None, response, rec, profile=UNKNOWN_PROFILE)
            if cands is not None:
                count("core_candidates_closed" if cands.closed else "core_candidates_open")
        missing = len(truth) - rec.completion_tokens_reconstructed
        if set(rec.issues) - {"truncated"} != {"billing_mismatch"} or missing != 1 or not ended:
            count("unresolved_other" if missing != 1 else "unresolved_not_a_tail")
            continue
        options = tail_options(model, stripped, missing, spaces, end)
        if len(options) < 2:
            count("unresolved_no_options" if not options else "text_proven_single_tail")
            continue
        diverge = min(
            next((j for j, (a, b) in enumerate(zip(o[0], options[0][0], strict=False)) if a != b),
                 min(len(o[0]), len(options[0][0])))
            for o in options[1:]
        )  # fmt: skip
        record = {
            "id": f"a{i}",
            "ok": False,
            "issues": ["billing_mismatch"],
            "prompt_ids": prompt,
            "output_ids": rec.output_ids,
            "loss_mask": rec.loss_mask,
            "sampling": sampling,
            "candidates": {
                "closed": True,
                "why_open": None,
                "classes": ["content_tail"],
                "diverge_at": diverge,
                "options": [
                    {"output_ids": ids, "loss_mask": [1] * len(ids), "label": f"tail {ws!r}"}
                    for ids, ws in options
                ],
            },
        }
        t1 = time.monotonic()
        new = score_record(record, scorer, settings)
        resolve_s += time.monotonic() - t1
        assert new is not None
        res = new["resolution"]
        if not new["ok"]:
            count("target_unresolved")
            continue
        count("target_resolved")
        wrong = new["output_ids"] != truth
        predicted_wrong += 1.0 - res["posterior"]
        posteriors.append((res["posterior"], wrong))
        if wrong:
            count("target_resolved_WRONG")
        if canonical != truth:
            count("target_resolved_noncanonical")

    # What extraction costs anyway: a plain forward over the answers, batched like extract
    # (on the first --extract-sample of them, scaled by tokens to all).
    seqs = [p + t for p, t in zip(prompts, truths, strict=True)]
    timed = seqs[: args.extract_sample]
    t2 = time.monotonic()
    for start in range(0, len(timed), 16):
        backend.forward(timed[start : start + 16])
    extract_s = (time.monotonic() - t2) * sum(map(len, seqs)) / max(1, sum(map(len, timed)))

    n = len(truths)
    proven = counts.get("text_proven", 0)
    resolved = counts.get("target_resolved", 0)
    figures = {
        "answers": n,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "min_posterior": args.min_posterior,
        "counts": dict(sorted(counts.items())),
        "share_text_proven": proven / n,
        "share_target_resolved": resolved / n,
        "share_proven_or_resolved": (proven + resolved) / n,
        "share_unresolved": 1 - (proven + resolved) / n,
        "resolved_wrong": counts.get("target_resolved_WRONG", 0),
        "resolved_wrong_predicted": predicted_wrong,
        "whitespace_tokens": len(spaces),
        "seconds_sampling": round(sample_s, 1),
        "seconds_resolution": round(resolve_s, 2),
        "seconds_extraction_forward": round(extract_s, 2),  # scaled from --extract-sample
        "resolution_share_of_extraction": resolve_s / extract_s if extract_s else None,
        "resolution_tokens": {"prefix": scorer.prefix_tokens, "suffix": scorer.suffix_tokens},
        "extraction_tokens": sum(map(len, seqs)),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    if posteriors:
        low = min(p for p, _ in posteriors)
        print(f"lowest resolved posterior {low:.6f}; wrong at posteriors "
              f"{[round(p, 6) for p, w in posteriors if w]}")  # fmt: skip
    return 0 if math.isfinite(predicted_wrong) else 1


if __name__ == "__main__":
    raise SystemExit(main())
