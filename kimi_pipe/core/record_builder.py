"""One reconstruction entry for every stage that writes token records (pure but for the
config read in `from_config`).

generate, reconstruct and audit all turn (messages, tools, response, request) into a record
through `RecordBuilder.build`: the reconstruction under the serving profile and billing
tolerance, the engine's ids from logprobs (policy), the candidate set of an ambiguous answer
(a one-member closed set proves the ids), the evidence rung and the sampling the request sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from kimi_pipe.core.candidates import Candidates, enumerate_candidates
from kimi_pipe.core.evidence import UNRESOLVED, evidence_of, sampling_of
from kimi_pipe.core.issue_codes import RECONSTRUCTION_ERRORS as ERRORS
from kimi_pipe.core.issue_codes import SINGLE_CANDIDATE, Code
from kimi_pipe.core.logprobs import LogprobPolicy, apply_logprobs, policy_from_config, record_fields
from kimi_pipe.core.models import Model
from kimi_pipe.core.plain import select
from kimi_pipe.core.prefix import with_prefix
from kimi_pipe.core.reconstruction import Reconstruction, reconstruct
from kimi_pipe.core.serving import UNKNOWN_PROFILE, ServingProfile, admitted_stacks, serving_profile
from kimi_pipe.core.token_record import TokenRecord


def billing_tolerance(cfg: Any) -> int:
    """`validation.billing_tolerance` of a composed config (absent or null: 0)."""

    value = select(cfg, "validation.billing_tolerance", default=0)
    return int(value or 0)


@dataclass(frozen=True)
class RecordBuilder:
    model: Model
    serving: ServingProfile = UNKNOWN_PROFILE
    billing_tolerance: int = 0
    logprobs: LogprobPolicy = field(default_factory=LogprobPolicy)

    @classmethod
    def from_config(
        cls, cfg: Any, model: Model, serving: ServingProfile | None = None
    ) -> RecordBuilder:
        """Profile (`serving`, unless given), tolerance and logprob policy from the config."""

        tolerance = billing_tolerance(cfg)
        policy = replace(policy_from_config(cfg), billing_tolerance=tolerance)
        return cls(model, serving or serving_profile(cfg), tolerance, policy)

    def reconstruction(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        response: Any,
    ) -> Reconstruction:
        rec = reconstruct(
            self.model,
            messages,
            tools,
            response,
            billing_tolerance=self.billing_tolerance,
            serving=self.serving,
        )
        return apply_logprobs(self.model, rec, response, self.logprobs)  # engine ids, if sent

    def build(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        response: Any,
        request: Any = None,
    ) -> TokenRecord:
        """The token record: reconstruction keys, id sources/logprobs, `evidence`,
        `sampling` (None when no request is known) and `candidates` where enumerable."""
        rec = self.reconstruction(messages, tools, response)
        candidates = None
        if not rec.ok:
            candidates = enumerate_candidates(
                self.model,
                messages,
                tools,
                response,
                rec,
                profile=self.serving,
                billing_tolerance=self.billing_tolerance,
            )
            if candidates is not None and _engine_spans(rec):
                # Part of the output holds the engine's own split; the options are re-encoded.
                candidates = replace(
                    candidates,
                    closed=False,
                    why_open="the engine's own ids in part of the output are not in the options",
                )
        record = cast(TokenRecord, rec.to_record() | record_fields(rec))
        if candidates is not None and candidates.proves:
            record = _proven_by(record, candidates)
            record["proven_against"] = {
                "profile": self.serving.name,
                "stacks": admitted_stacks(self.serving),
            }
        elif candidates is not None:
            record["candidates"] = candidates.to_record()
            if candidates.closed:
                record["candidates"]["proven_against"] = {
                    "profile": self.serving.name,
                    "stacks": admitted_stacks(self.serving),
                }
        if candidates is not None and candidates.keeps_readings and candidates.short:
            # Readings a few ids short of the bill: the split check weighs their longer splits.
            record["short_readings"] = [o.to_record() for o in candidates.short]
        if candidates is not None and candidates.keeps_readings and candidates.long:
            # And a few ids over it: their shorter splits.
            record["long_readings"] = [o.to_record() for o in candidates.long]
        record["evidence"] = evidence_of(record)
        record = with_prefix(record)  # flagged, yet its readings share a prefix: keep that
        record["sampling"] = sampling_of(request) if request is not None else None
        return record


def _engine_spans(rec: Reconstruction) -> bool:
    return any(span[2] == "engine" for span in rec.details.get("id_sources") or [])


def _proven_by(record: TokenRecord, candidates: Candidates) -> TokenRecord:
    """A closed one-member set: its ids are proven; the flags it covered become a note."""
    option = candidates.options[0]
    covered = {
        "reasoning_tail": {Code.REASONING_TAIL_UNVERIFIABLE, Code.BILLING_MISMATCH},
        "marker_space": {Code.LEADING_SPACE_AFTER_MARKER},
        "tool_section_space": {Code.SPACE_BEFORE_TOOL_SECTION},
        "argument_edges": {Code.TOOL_ARGUMENTS_EDGES_UNVERIFIABLE},
    }
    # Each option passed its own billing check: a mismatch of the as-returned reading goes too.
    drop = set().union({Code.BILLING_MISMATCH}, *(covered[c] for c in candidates.classes))
    issues = [c for c in record["issues"] if c not in drop] + [SINGLE_CANDIDATE]
    return record | {
        "issues": list(dict.fromkeys(issues)),
        "ok": not any(c in ERRORS for c in issues),
        "output_ids": option.output_ids,
        "loss_mask": option.loss_mask,
        "completion_tokens_reconstructed": len(option.output_ids),
    }


def mark_flagged(record: TokenRecord, codes: Sequence[str]) -> TokenRecord:
    """Add error codes from outside reconstruction (answer checks, billing of the call):
    the record is no longer `ok`, its rung `unresolved`."""
    if codes:
        record["issues"] = list(dict.fromkeys([*record.get("issues", []), *codes]))
        record["ok"] = False
        record["evidence"] = UNRESOLVED
        record = with_prefix(record)  # a code the candidate set does not cover: no prefix
    return record
