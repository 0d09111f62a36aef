"""Two hidden-state stores of the same records, compared state by state (one backend against
another: `extract=sglang` against `extract=hf`). Either store may be a unit store (an
executor's, docs/distributed.md): it is read through its committed indexes.

    python -m kimi_pipe.extraction.parity REFERENCE_STORE CANDIDATE_STORE [--records R.jsonl]
        [--max-len N] [--baseline BASELINE_STORE] [--json OUT.json]

For every sample in both stores and every stored state (each auxiliary layer, and the final
state taken post-norm in both, the one convention every store can give), per token row:
relative error ||c - r|| / ||r|| and cosine(c, r); when both stores keep the pre-norm final
state, that state as stored too. Reported per state: the max relative error
over all rows, the global relative L2 error, the min and mean cosine, the max abs difference.
Also checked exactly: the layer ids of the two manifests, each sample's input_ids and
loss_mask (against each other, and against the token records when given).

Verdict per state: global relative L2 < REL_L2_TOL and every row's cosine >= MIN_COSINE, a
fixed guess at the tolerance of bf16 compute (8 mantissa bits, about 4e-3 per rounding,
compounded through the layers). With a BASELINE store (the reference's own engine run in the
candidate's compute dtype, e.g. transformers in bf16 against transformers in float32) the
tolerance is measured instead: per state, the candidate's relative L2 error and its worst
cosine gap (1 - min cosine) may be at most BASELINE_FACTOR times the baseline's. That is the
honest bf16 tolerance: on SmolLM2, transformers' own bf16 run misses the fixed 2e-2 on the
final state (2.3e-2). Exit 0 only when every state passes and every exact check holds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kimi_pipe.extraction.token_samples import apply_max_len, read_token_records
from kimi_pipe.store.conventions import POST_NORM, PRE_NORM, final_state_as
from kimi_pipe.store.unit_reader import open_local_store

REL_L2_TOL = 2e-2
MIN_COSINE = 0.99
# With a baseline: how many times the reference engine's own bf16 error another engine may
# make (different kernels round differently; a wrong layer or token is orders of magnitude off).
BASELINE_FACTOR = 4.0
# ... and never less than float32's own run-to-run noise (a float32 baseline equal to the
# reference would otherwise demand bit-exact agreement).
BASELINE_FLOOR = 1e-5
PRE_NORM_ROW = "final state (pre-norm)"


@dataclass
class StateParity:
    """Agreement of one stored state over every compared token."""

    name: str
    tokens: int = 0
    max_rel_err: float = 0.0
    max_abs_diff: float = 0.0
    min_cosine: float = 1.0
    cosine_sum: float = 0.0
    err2: float = 0.0
    ref2: float = 0.0
    rel_l2_limit: float = REL_L2_TOL  # pass: rel_l2 below it
    cosine_gap_limit: float = 1.0 - MIN_COSINE  # pass: 1 - min_cosine at most this

    def add(self, ref: torch.Tensor, cand: torch.Tensor) -> None:
        r, c = ref.float(), cand.float()
        diff = c - r
        row_ref = r.norm(dim=-1)
        row_err = diff.norm(dim=-1)
        # A zero reference row has no relative error to speak of: count it by its abs error.
        rel = torch.where(row_ref > 0, row_err / row_ref.clamp_min(1e-30), row_err)
        cos = torch.nn.functional.cosine_similarity(r, c, dim=-1, eps=1e-30)
        self.tokens += int(r.shape[0])
        self.max_rel_err = max(self.max_rel_err, float(rel.max()))
        self.max_abs_diff = max(self.max_abs_diff, float(diff.abs().max()))
        self.min_cosine = min(self.min_cosine, float(cos.min()))
        self.cosine_sum += float(cos.sum())
        self.err2 += float((diff**2).sum())
        self.ref2 += float((r**2).sum())

    @property
    def rel_l2(self) -> float:
        return math.sqrt(self.err2 / self.ref2) if self.ref2 else float("nan")

    @property
    def mean_cosine(self) -> float:
        return self.cosine_sum / self.tokens if self.tokens else float("nan")

    @property
    def ok(self) -> bool:
        return (
            self.tokens > 0
            and self.rel_l2 < self.rel_l2_limit
            and 1.0 - self.min_cosine <= self.cosine_gap_limit
        )

    def row(self) -> dict[str, Any]:
        return {
            "state": self.name,
            "tokens": self.tokens,
            "max_rel_err": self.max_rel_err,
            "rel_l2": self.rel_l2,
            "min_cosine": self.min_cosine,
            "mean_cosine": self.mean_cosine,
            "max_abs_diff": self.max_abs_diff,
            "rel_l2_limit": self.rel_l2_limit,
            "min_cosine_limit": 1.0 - self.cosine_gap_limit,
            "ok": self.ok,
        }


@dataclass
class StoreParity:
    reference: str
    candidate: str
    layer_ids: list[int]
    capture_ids: list[int] | None
    samples_reference: int
    samples_candidate: int
    compared: int = 0
    tokens: int = 0
    states: list[StateParity] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # exact checks that failed
    baseline: StoreParity | None = None  # the reference against its own bf16 run, when given

    @property
    def ok_exact(self) -> bool:
        """Ids, masks, layer ids and sample counts: what must hold whatever the numbers."""
        return not self.problems and self.compared > 0 and self.compared == self.samples_reference

    @property
    def ok(self) -> bool:
        return (
            not self.problems
            and self.compared > 0
            and self.compared == self.samples_reference
            and all(s.ok for s in self.states)
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["states"] = [s.row() for s in self.states]
        out["ok"] = self.ok
        if self.baseline is not None:
            out["baseline"] = self.baseline.as_dict()
            out["tolerance"] = {"times_the_baseline_error": BASELINE_FACTOR}
        else:
            out["tolerance"] = {"rel_l2_below": REL_L2_TOL, "min_cosine_at_least": MIN_COSINE}
        return out

    def table(self) -> str:
        lines = [
            f"{'state':<34} {'tokens':>7} {'max rel err':>11} {'rel L2':>9} "
            f"{'min cos':>9} {'mean cos':>9} {'max |diff|':>10}  verdict (limits: rel L2, min cos)",
        ]
        for s in self.states:
            lines.append(
                f"{s.name:<34} {s.tokens:>7} {s.max_rel_err:>11.3e} {s.rel_l2:>9.2e} "
                f"{s.min_cosine:>9.5f} {s.mean_cosine:>9.5f} {s.max_abs_diff:>10.3e}  "
                f"{'PASS' if s.ok else 'FAIL'} ({s.rel_l2_limit:.2e}, "
                f"{1.0 - s.cosine_gap_limit:.5f})"
            )
        if self.baseline is not None:
            lines.append(f"baseline ({self.baseline.candidate} against the reference):")
            lines.extend(self.baseline.table().splitlines()[1:])
        return "\n".join(lines)


def compare_stores(
    reference: str | Path,
    candidate: str | Path,
    *,
    records: str | Path | None = None,
    max_len: int | None = None,
    only_ok: bool = False,
    baseline: str | Path | None = None,
) -> StoreParity:
    """Compare `candidate` against `reference` on every sample the reference holds; with a
    `baseline` store, each state's tolerance is BASELINE_FACTOR times the baseline's error."""
    if baseline is not None:
        base = compare_stores(
            reference, baseline, records=records, max_len=max_len, only_ok=only_ok
        )
        report = compare_stores(
            reference, candidate, records=records, max_len=max_len, only_ok=only_ok
        )
        report.baseline = base
        # Aux rows and the post-norm row pair by position (only the candidate's names carry
        # SGLang's capture ids); the pre-norm row is there only when both stores of a
        # comparison keep that state, and without the baseline's it keeps the fixed tolerance.
        pairs = list(zip(report.states, base.states, strict=False))
        pre = [s for s in report.states if s.name == PRE_NORM_ROW]
        base_pre = [s for s in base.states if s.name == PRE_NORM_ROW]
        pairs = [(m, t) for m, t in pairs if PRE_NORM_ROW not in (m.name, t.name)]
        pairs += list(zip(pre, base_pre, strict=False))
        for mine, theirs in pairs:
            mine.rel_l2_limit = max(BASELINE_FACTOR * theirs.rel_l2, BASELINE_FLOOR)
            mine.cosine_gap_limit = max(BASELINE_FACTOR * (1.0 - theirs.min_cosine), BASELINE_FLOOR)
        if not base.ok_exact:
            report.problems.extend(f"baseline: {p}" for p in base.problems)
        return report
    ref, cand = open_local_store(reference), open_local_store(candidate)
    layers = [int(i) for i in ref.manifest["layer_ids"]]
    capture = cand.manifest.get("sglang_capture_ids")  # make_manifest puts extras at the top
    report = StoreParity(
        reference=str(reference),
        candidate=str(candidate),
        layer_ids=layers,
        capture_ids=[int(i) for i in capture] if capture is not None else None,
        samples_reference=len(ref),
        samples_candidate=len(cand),
    )
    cand_layers = [int(i) for i in cand.manifest["layer_ids"]]
    if cand_layers != layers:
        report.problems.append(f"layer ids differ: reference {layers}, candidate {cand_layers}")
    if capture is not None and [int(i) for i in capture] != [i + 1 for i in cand_layers]:
        # SGLang's capture id of "output of layer" i is i + 1 (kimi_pipe.extraction.layers).
        report.problems.append(
            f"SGLang captured ids {capture}, the manifest's output-of-layer ids {cand_layers} "
            "need ids + 1"
        )
    h = int(ref.manifest["hidden_size"])
    if int(cand.manifest["hidden_size"]) != h:
        report.problems.append(
            f"hidden size differs: reference {h}, candidate {cand.manifest['hidden_size']}"
        )
        return report
    expected: dict[str, tuple[list[int], list[int]]] = {}
    if records is not None:
        samples, _ = read_token_records(records, only_ok=only_ok)
        samples, _ = apply_max_len(samples, max_len, "truncate")
        expected = {s.id: (s.input_ids, s.loss_mask) for s in samples}
    report.states = [
        StateParity(f"aux: output of layer {i}" + (f" (capture {i + 1})" if capture else ""))
        for i in layers
    ] + [StateParity("final state (post-norm)")]
    # Both stores keep the pre-norm state: compare it as stored too (what speculators reads).
    both_pre = ref.manifest.get("final_state") == cand.manifest.get("final_state") == PRE_NORM
    if both_pre:
        report.states.append(StateParity(PRE_NORM_ROW))
    for sid in ref.ids:
        if sid not in cand:
            report.problems.append(f"{sid}: in the reference store, not in the candidate")
            continue
        a, b = ref[sid], cand[sid]
        for key in ("input_ids", "loss_mask"):
            if not torch.equal(a[key], b[key]):
                report.problems.append(f"{sid}: {key} differ between the stores")
        if expected:
            want = expected.get(sid)
            if want is None:
                report.problems.append(f"{sid}: stored but not in the records")
            elif a["input_ids"].tolist() != want[0] or b["loss_mask"].tolist() != want[1]:
                report.problems.append(f"{sid}: input_ids/loss_mask differ from the records")
        for k in range(len(layers)):
            cols = slice(k * h, (k + 1) * h)
            report.states[k].add(a["aux_hidden_state"][:, cols], b["aux_hidden_state"][:, cols])
        report.states[len(layers)].add(
            final_state_as(ref.manifest, a["hidden_state"].float(), POST_NORM),
            final_state_as(cand.manifest, b["hidden_state"].float(), POST_NORM),
        )
        if both_pre:
            report.states[-1].add(a["hidden_state"], b["hidden_state"])
        report.compared += 1
        report.tokens += int(a["input_ids"].shape[0])
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference")
    parser.add_argument("candidate")
    parser.add_argument("--records", default=None, help="token records both stores were made from")
    parser.add_argument("--max-len", type=int, default=None, help="the extract.max_len used")
    parser.add_argument(
        "--baseline",
        default=None,
        help="the reference's engine in the candidate's dtype: the tolerance is measured from it",
    )
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    report = compare_stores(
        args.reference,
        args.candidate,
        records=args.records,
        max_len=args.max_len,
        baseline=args.baseline,
    )
    print(
        f"samples: reference {report.samples_reference}, candidate {report.samples_candidate}, "
        f"compared {report.compared} ({report.tokens} tokens); layer ids {report.layer_ids}"
        + (f", SGLang capture ids {report.capture_ids}" if report.capture_ids else "")
    )
    print(report.table())
    for problem in report.problems[:20]:
        print(f"MISMATCH: {problem}")
    print("PARITY:", "PASS" if report.ok else "FAIL")
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
