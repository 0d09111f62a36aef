"""fp8 rounding of the final state that keeps the teacher's choice.

Round-to-nearest float8 e4m3 (3 mantissa bits) moves a final state by about 2 % (relative L2),
which flips the LM head's argmax wherever the top two logits are close: 4.5 % of positions on
the demo model's text set (docs/measured/fp8_text.json). A drafter trained on such a store
learns from another teacher at those positions.

Every value lies between two neighbouring fp8 values, and either neighbour is within one fp8
step of it. For a row whose argmax differs from the plain store's, `quantize_keeping_argmax`
takes the other neighbour for the few values that move the reference token's logit most
against the intruder (a linear estimate), recomputes the row's logits exactly as a reader
would (dequantize, cast to the read dtype, final norm, head), and repeats. The row then has
the reference argmax, each value still within one step of the truth, the same bytes and the
same scale layout: readers do not change.

The reference is the plain store's teacher: the state cast to the read dtype (bfloat16),
then the same path. For a pre-norm store there are two readings, and each must keep its own
reference: the norm in float32 on the stored reading (speculators, which applies the norm
itself), and the post-norm state an export writes in the read dtype (SpecForge, ModelOpt).
Where the plain store's two readings disagree (a tie at its own precision) the first one's
token is the teacher (`readings_disagree`). Only the rows a trainer reads the teacher at are
checked (`teacher_rows`: a loss position or the one before it); the head products are the
whole cost, and a prompt row's teacher enters no loss. A row the search cannot fix in
`max_rounds` keeps round to nearest and is counted (`not_kept`); none did on the demo model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kimi_pipe.store.conventions import rms_norm

FP8_TORCH = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_TORCH).max)

DOC = (
    "argmax_kept: fp8 values of a final-state row whose LM-head argmax differed from the "
    "plain store's were re-rounded to the other neighbouring fp8 value (each within one fp8 "
    "step of the state) until the argmax is the plain store's, read with the norm in float32 "
    "and as an export's post-norm file, at every loss position and the position before it "
    "(kimi_pipe.store.teacher_rounding)"
)


def fp8_grid() -> torch.Tensor:
    """Every finite float8 e4m3 value, sorted, in float32 (one zero)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_TORCH).float()
    return torch.unique(values[torch.isfinite(values)])


@dataclass(frozen=True)
class TeacherHead:
    """What turns a stored final state into the teacher's logits.

    `weight`: the LM head [vocab, H]; `final_norm`: the manifest's `final_norm` spec when the
    store keeps the pre-norm state (None: the state is post-norm already); `read_dtype`: what
    readers of the store get (the fp8 store's manifest `dtype`).
    """

    weight: torch.Tensor
    final_norm: Mapping[str, Any] | None
    read_dtype: torch.dtype = torch.bfloat16
    row_chunk: int = 1024  # rows of [chunk, vocab] logits at once (Kimi: 163,840 wide)

    @property
    def readings(self) -> tuple[bool, ...]:
        """How trainers read the teacher: the norm in float32 on the stored reading (False),
        and, for a pre-norm store, the post-norm state an export writes in the read dtype
        (True: SpecForge and ModelOpt files). Each must keep its own reference's argmax."""
        return (False, True) if self.final_norm is not None else (False,)

    def logits(self, rows: torch.Tensor, post_cast: bool = False) -> torch.Tensor:
        """[R, H] states as a reader holds them -> [R, vocab] float32 logits."""
        x = rows.to(self.weight.device).float()
        if self.final_norm is not None:
            x = rms_norm(x, self.final_norm)
            if post_cast:
                x = x.to(self.read_dtype).float()
        return x @ self.weight.T

    def top(
        self, rows: torch.Tensor, token: torch.Tensor | None = None, post_cast: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """Per row: argmax, the runner-up, and the margin of `token` (default: the argmax)
        over the best other token; chunked over rows."""
        best, rival, margin = [], [], []
        for start in range(0, rows.shape[0], self.row_chunk):
            logits = self.logits(rows[start : start + self.row_chunk], post_cast)
            values, indices = logits.topk(2, dim=-1)
            want = (
                indices[:, 0]
                if token is None
                else token[start : start + self.row_chunk].to(logits.device)
            )
            mine = logits.gather(1, want[:, None]).squeeze(1)
            # The best other token: the runner-up when `want` leads, else the leader.
            leads = indices[:, 0] == want
            best.append(indices[:, 0])
            rival.append(torch.where(leads, indices[:, 1], indices[:, 0]))
            margin.append(mine - torch.where(leads, values[:, 1], values[:, 0]))
        return tuple(torch.cat(t).cpu() for t in (best, rival, margin))


@dataclass
class RoundingCounts:
    """Rows checked, rows round-to-nearest flipped, and how many of those were kept."""

    rows: int = 0
    flipped: int = 0
    kept: int = 0
    not_kept: int = 0
    values_changed: int = 0
    readings_disagree: int = 0
    rounds: dict[int, int] = field(default_factory=dict)

    def add(self, other: RoundingCounts) -> None:
        self.rows += other.rows
        self.flipped += other.flipped
        self.kept += other.kept
        self.not_kept += other.not_kept
        self.values_changed += other.values_changed
        self.readings_disagree += other.readings_disagree
        for k, v in other.rounds.items():
            self.rounds[k] = self.rounds.get(k, 0) + v

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows_checked": self.rows,
            "flipped_by_round_to_nearest": self.flipped,
            "kept_by_re_rounding": self.kept,
            "not_kept": self.not_kept,
            "values_re_rounded": self.values_changed,
            "plain_store_readings_disagree": self.readings_disagree,
            "rows_by_rounds": {str(k): v for k, v in sorted(self.rounds.items())},
        }


def teacher_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """Rows whose teacher a trainer reads: a loss position, or the one before it (the state
    at t predicts token t + 1; trainers differ in which of the two the mask names)."""
    mask = loss_mask.reshape(-1).bool()
    before = torch.zeros_like(mask)
    before[:-1] = mask[1:]
    return mask | before


def quantize_keeping_argmax(
    final: torch.Tensor,
    head: TeacherHead,
    *,
    rows_read: torch.Tensor | None = None,
    min_margin: float = 1e-3,
    max_rounds: int = 12,
) -> tuple[torch.Tensor, torch.Tensor, RoundingCounts]:
    """[T, H] float32 final states -> (fp8 [T, H], float32 scales [T, 1], counts).

    The fp8 values dequantize to a row whose LM-head argmax equals that of the row cast to
    `head.read_dtype`, with a margin of at least min(`min_margin`, half the reference's own
    margin), wherever the search succeeds. Scales are round-to-nearest's (amax / 448).
    `rows_read` (bool [T], e.g. `teacher_rows(loss_mask)`): only these rows are checked (the
    head products are the cost); the others keep round to nearest. None: every row.
    """
    x = final.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    target = (x / scale).clamp(-FP8_MAX, FP8_MAX)
    q = target.to(FP8_TORCH)
    checked = (
        torch.arange(x.shape[0])
        if rows_read is None
        else torch.nonzero(rows_read.reshape(-1).bool()).squeeze(1)
    )
    counts = RoundingCounts(rows=int(checked.numel()))
    if checked.numel() == 0:
        return q, scale, counts
    # One reference per reading: the plain store's argmax as that reading computes it.
    stored, read_q = x[checked].to(head.read_dtype), _read(q[checked], scale[checked], head)
    refs: list[torch.Tensor] = []
    needs: list[torch.Tensor] = []
    flipped = torch.zeros(checked.numel(), dtype=torch.bool)
    for post_cast in head.readings:
        ref, _, ref_margin = head.top(stored, post_cast=post_cast)
        got, _, _ = head.top(read_q, post_cast=post_cast)
        need = torch.minimum(torch.full_like(ref_margin, min_margin), ref_margin / 2)
        if refs:
            # The plain store's readings disagree (a tie at its own precision): the first
            # reading's token is the teacher; no fp8 row could match both.
            split = ref != refs[0]
            counts.readings_disagree += int(split.sum())
            need = torch.where(split, torch.full_like(need, float("-inf")), need)
            got = torch.where(split, ref, got)
        refs.append(ref)
        needs.append(need)
        flipped |= got != ref
    pick_rows = torch.nonzero(flipped).squeeze(1)
    rows = checked[pick_rows]
    counts.flipped = int(rows.numel())
    if rows.numel() == 0:
        return q, scale, counts

    grid = fp8_grid()
    t = target[rows]
    hi_i = torch.searchsorted(grid, t).clamp(max=grid.numel() - 1)
    hi = grid[hi_i]
    lo = torch.where(hi == t, hi, grid[(hi_i - 1).clamp(min=0)])
    nearest = q[rows].float()
    cur = nearest.clone()
    wants = [r[pick_rows] for r in refs]
    needs = [n[pick_rows] for n in needs]
    norm_w = (
        torch.tensor(head.final_norm["weight"], dtype=torch.float32)
        if head.final_norm is not None
        else torch.ones(x.shape[1])
    )
    row_scale = scale[rows]
    active = torch.ones(rows.numel(), dtype=torch.bool)

    def worst_reading(values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per row: the reading furthest from its need: (shortfall, its token, its rival)."""
        deq = (values * row_scale).to(head.read_dtype)
        per = [
            (head.top(deq, want, post_cast=pc), want, need)
            for pc, want, need in zip(head.readings, wants, needs, strict=True)
        ]
        short = torch.stack([need - margin for (_, _, margin), _, need in per])
        worst = short.argmax(0)
        pick = worst[None, :]
        token = torch.stack([w for _, w, _ in per]).gather(0, pick).squeeze(0)
        rival = torch.stack([r for (_, r, _), _, _ in per]).gather(0, pick).squeeze(0)
        return short.gather(0, pick).squeeze(0), token, rival

    for round_no in range(1, max_rounds + 1):
        shortfall, want, rival = worst_reading(cur)
        done = shortfall < 0
        newly = done & active
        if newly.any():
            counts.rounds[round_no - 1] = int(newly.sum())
        active &= ~done
        if not active.any():
            break
        idx = torch.nonzero(active).squeeze(1)
        # d(logit_want - logit_rival) / d(value): the head's rows through the norm's weight
        # and the row's rms (the rms's own change is second order: the exact recompute checks).
        h = (cur[idx] * row_scale[idx]).float()
        rms = (
            torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + float(head.final_norm["eps"]))
            if head.final_norm is not None
            else 1.0
        )
        dev = head.weight.device
        rows_w = head.weight[want[idx].to(dev)] - head.weight[rival[idx].to(dev)]
        direction = rows_w.float().cpu() * norm_w * rms
        alt = torch.where(cur[idx] == lo[idx], hi[idx], lo[idx])
        gain = (alt - cur[idx]) * row_scale[idx] * direction
        # A value moves once: moving it back for the next rival would undo the last round.
        gain = torch.where((gain > 0) & (cur[idx] == nearest[idx]), gain, torch.zeros_like(gain))
        order = gain.argsort(dim=-1, descending=True)
        cumulative = gain.gather(1, order).cumsum(-1)
        # Enough values to cover the shortfall with some room; at least one.
        deficit = shortfall[idx].clamp(min=0) * 1.25 + 1e-6
        take = (cumulative < deficit[:, None]).sum(-1) + 1
        pick = torch.arange(x.shape[1])[None, :] < take[:, None]
        chosen = torch.zeros_like(pick).scatter(1, order, pick)
        chosen &= gain > 0
        cur[idx] = torch.where(chosen, alt, cur[idx])
    else:
        shortfall, _, _ = worst_reading(cur)
        active &= ~(shortfall < 0)
    # A row the search could not fix keeps round-to-nearest (never something worse).
    fixed = ~active
    counts.kept = int(fixed.sum())
    counts.not_kept = int(active.sum())
    new_rows = torch.where(fixed[:, None], cur, nearest)
    counts.values_changed = int((new_rows != nearest).sum())
    q[rows] = new_rows.to(FP8_TORCH)
    return q, scale, counts


def _read(q: torch.Tensor, scale: torch.Tensor, head: TeacherHead) -> torch.Tensor:
    """What a reader of the store gets: fp8 value x scale in float32, cast to the read dtype."""
    return (q.float() * scale).to(head.read_dtype)
