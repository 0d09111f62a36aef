"""The miniature Kimi K2.5's test inputs, shared by tests/test_kimi_miniature.py (transformers,
`make test`) and the sglang_cpu tier (tests/test_sglang_cpu.py, SGLang's engine): its own greedy
continuations, and the split check's records rebuilt from their text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kimi_pipe.core.models import Model
from kimi_pipe.core.prompt_render import prompt_ids

PAD_ID = 163839  # Kimi K2.5's [PAD] (the miniature's config.json keeps it)
# Questions rendered with Kimi's prompt format; the split check uses the first three (their
# greedy answers: two re-encode to their own ids, one does not).
QUESTIONS = ["What is 2+2?", "Name a colour.", "Say hi.", "Count to three."]


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """A transformers model's own greedy continuation of `prompt` (generate, no sampling)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=n, min_new_tokens=n, pad_token_id=PAD_ID,
        )  # fmt: skip
    return [int(t) for t in out[0, len(prompt) :]]


def split_check_records(
    kimi: Model, answers: list[tuple[list[int], list[int]]]
) -> tuple[list[dict[str, Any]], dict[str, tuple[list[int], bool]]]:
    """Records rebuilt from text alone: each answer's greedy ids decoded, then canonically
    re-encoded, billed at the true count, under greedy sampling (the split check's case).
    Returns the rows and, per id, (the true ids, whether the canonical encoding equals them)."""
    rows, truths = [], {}
    for i, (prompt, truth) in enumerate(answers):
        canonical = kimi.encode([kimi.tokenizer.decode(truth)])
        same = canonical == truth
        truths[f"g{i}"] = (truth, same)
        rows.append({
            "id": f"g{i}", "ok": len(canonical) == len(truth),
            "evidence": "text_proven" if len(canonical) == len(truth) else "unresolved",
            "issues": [] if len(canonical) == len(truth) else ["billing_mismatch"], "notes": [],
            "prompt_ids": prompt, "output_ids": canonical,
            "loss_mask": [0] * len(prompt) + [1] * len(canonical),
            "completion_tokens_reported": len(truth),
            "completion_tokens_reconstructed": len(canonical),
            "sampling": {"temperature": 0.0},
        })  # fmt: skip
    return rows, truths


def kimi_records(kimi: Model, n: int, questions: Sequence[str] = QUESTIONS) -> list[dict[str, Any]]:
    """Token records with Kimi's real prompt format and marker ids (reasoning, </think>,
    content, <|im_end|>), as reconstruction writes them (also benchmarks/drafters_miniature.py)."""
    think_end, im_end = kimi.markers["</think>"], kimi.markers["<|im_end|>"]
    rows = []
    for i in range(n):
        prompt = prompt_ids(kimi, [{"role": "user", "content": questions[i % len(questions)]}])
        output = [
            *kimi.encode([f"The user asks question {i}."]),
            think_end,
            *kimi.encode([f"Answer number {i}, briefly."]),
            im_end,
        ]
        rows.append({
            "id": f"k{i:02d}", "ok": True, "evidence": "text_proven", "issues": [], "notes": [],
            "prompt_ids": prompt, "output_ids": output,
            "loss_mask": [0] * len(prompt) + [1] * len(output),
            "completion_tokens_reported": len(output),
            "completion_tokens_reconstructed": len(output),
        })  # fmt: skip
    return rows
