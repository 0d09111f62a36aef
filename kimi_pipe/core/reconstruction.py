"""Exact output ids from one provider answer (pure: no IO, no globals).

The provider returns text split into fields; the model emitted one token stream. This
module puts the fields back into the model's declarative output format and encodes
them, then checks the result against the provider's own billing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kimi_pipe.core.formats import Marker, Piece, split_markers
from kimi_pipe.core.models import Model
from kimi_pipe.core.prompt_render import (
    PromptError,
    content_and_tool_calls,
    message_text,
    prompt_ids,
)

# Issue codes. Errors make `ok` false; notes are listed but leave `ok` as it is.
ERRORS = frozenset(
    {
        "truncated",  # finish_reason == "length": the answer was cut by max_tokens
        "billing_mismatch",  # reconstructed length != usage.completion_tokens (+- tolerance)
        "malformed_response",  # no choices / no message / not an object
        "provider_error",  # an error body or finish_reason "error"
        "empty_response",  # nothing at all came back
        "bad_prompt",  # the prompt messages cannot be rendered
        "partial_character",  # cut inside a UTF-8 character: the text holds U+FFFD, not the byte
    }
)
NOTES = frozenset(
    {
        "tool_call_ids_rebuilt",  # ids not in the model's pattern were rebuilt
        "no_usage",  # no usage.completion_tokens to check against
        "reasoning_from_content",  # no reasoning field: split content at the think-end marker
        "reasoning_from_details",  # reasoning taken from reasoning_details blocks
        "raw_markers_in_content",  # marker text inside content became marker ids
        "tool_arguments_not_json",  # kept verbatim where the format wanted parsed arguments
        "prompt_tokens_mismatch",  # rendered prompt length != usage.prompt_tokens
    }
)
LENGTH_REASONS = frozenset({"length", "max_tokens", "max_output_tokens"})


@dataclass
class Reconstruction:
    ok: bool
    issues: list[str]
    prompt_ids: list[int]
    output_ids: list[int]
    loss_mask: list[int]
    completion_tokens_reported: int | None
    completion_tokens_reconstructed: int
    details: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "issues": list(self.issues),
            "prompt_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "loss_mask": self.loss_mask,
            "completion_tokens_reported": self.completion_tokens_reported,
            "completion_tokens_reconstructed": self.completion_tokens_reconstructed,
        }


@dataclass(frozen=True)
class AnswerFields:
    """The parts of one chat-completion choice that carry model output."""

    reasoning: str
    reasoning_source: str | None  # which field it came from, None when absent
    content: str
    tool_calls: list[Mapping[str, Any]]
    finish_reason: str | None
    error: Any


def _field(obj: Mapping[str, Any], key: str) -> Any:
    """A key of a message/choice, also where LiteLLM moved it (provider_specific_fields)."""
    value = obj.get(key)
    if value is None:
        extra = obj.get("provider_specific_fields")
        if isinstance(extra, Mapping):
            value = extra.get(key)
    return value


def _reasoning(message: Mapping[str, Any]) -> tuple[str, str | None]:
    """reasoning, else reasoning_content, else the text blocks of reasoning_details."""
    present: str | None = None
    for key in ("reasoning", "reasoning_content"):
        value = _field(message, key)
        if isinstance(value, str):
            if value:
                return value, key
            present = present or key
    details = _field(message, "reasoning_details")
    if isinstance(details, list) and details:
        texts = [
            str(block.get("text") or "")
            for block in details
            if isinstance(block, Mapping)
            and block.get("type", "reasoning.text") == "reasoning.text"
        ]
        if any(texts):
            return "".join(texts), "reasoning_details"
        present = present or "reasoning_details"
    return "", present


def answer_fields(response: Any) -> AnswerFields | None:
    """Read the first choice; None when the response has no usable message."""
    if not isinstance(response, Mapping):
        return None
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return None
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, Mapping):
        return None
    reasoning, source = _reasoning(message)
    try:
        content = message_text(message.get("content"))
    except PromptError:
        return None
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        return None
    finish = _field(choice, "native_finish_reason") or choice.get("finish_reason")
    error = response.get("error") or choice.get("error")
    return AnswerFields(
        reasoning=reasoning,
        reasoning_source=source,
        content=content,
        tool_calls=[c for c in calls if isinstance(c, Mapping)],
        finish_reason=finish if isinstance(finish, str) else None,
        error=error,
    )


def output_pieces(
    model: Model, answer: AnswerFields, issues: list[str], call_index_offset: int = 0
) -> tuple[list[Piece], bool]:
    """The model's output stream as pieces; also whether the end-of-turn was appended."""
    out = model.format.output
    truncated = answer.finish_reason in LENGTH_REASONS
    reasoning, content = answer.reasoning, answer.content
    pieces: list[Piece] = []

    if out.reasoning is not None:
        reasoning_cut = False
        # An empty reasoning field with the think-end in content: the provider did not split.
        if not reasoning and out.think_end and out.think_end in content:
            reasoning, content = content.split(out.think_end, 1)
            issues.append("reasoning_from_content")
        elif answer.reasoning_source is None and truncated and not answer.tool_calls:
            # No reasoning field and no think-end: a provider that leaves reasoning in
            # content was cut before the model closed its reasoning.
            reasoning, content, reasoning_cut = content, "", True
        elif truncated and not content and not answer.tool_calls:
            reasoning_cut = True  # cut inside the reasoning: no think-end was emitted
        if answer.reasoning_source == "reasoning_details":
            issues.append("reasoning_from_details")
        if out.reasoning_strip:
            reasoning = reasoning.strip(out.reasoning_strip)
        if reasoning_cut:
            return ([reasoning] if reasoning else []), False
        # The template's own whitespace around the think-end: kept by some providers inside
        # the fields, stripped by others; the reasoning template adds it back either way.
        reasoning = _remove_once(reasoning, out.reasoning_trim_suffix, suffix=True)
        content = _remove_once(content, out.content_trim_prefix, suffix=False)
        pieces += out.reasoning.render(reasoning=reasoning)

    if out.content_strip:
        content = content.strip(out.content_strip)
    if answer.tool_calls and out.tool_calls_after_content:
        # The separator follows content with text only; whitespace-only content is kept whole.
        before = _remove_once(content, out.tool_calls_after_content, suffix=True)
        if before.strip():
            content = before
    content_pieces = split_markers(content, out.content_markers)
    if any(isinstance(p, Marker) for p in content_pieces):
        issues.append("raw_markers_in_content")
    ids: list[str] = []
    if answer.tool_calls:
        ids, rebuilt = _tool_call_ids(model, answer.tool_calls, call_index_offset)
        if rebuilt:
            issues.append("tool_call_ids_rebuilt")
    section, not_json = content_and_tool_calls(out, content_pieces, answer.tool_calls, ids)
    if not_json:
        issues.append("tool_arguments_not_json")
    pieces += section

    if truncated:
        return pieces, False
    return pieces + out.end.render(), True


def _remove_once(text: str, part: str, *, suffix: bool) -> str:
    if not part:
        return text
    return text.removesuffix(part) if suffix else text.removeprefix(part)


def _tool_call_ids(
    model: Model, calls: Sequence[Mapping[str, Any]], offset: int = 0
) -> tuple[list[str], bool]:
    """Keep ids in the model's own pattern; rebuild others, counting calls from `offset`
    (0: calls in this answer; or the calls earlier in the conversation, per the format)."""
    out = model.format.output
    ids, rebuilt = [], False
    for index, call in enumerate(calls):
        call_id = call.get("id")
        if out.tool_call_id_pattern is None or (
            isinstance(call_id, str) and out.tool_call_id_pattern.match(call_id)
        ):
            ids.append(str(call_id or ""))
            continue
        name = (call.get("function") or {}).get("name") or ""
        ids.append(out.tool_call_id.format(name=name, index=offset + index))
        rebuilt = True
    return ids, rebuilt


def _calls_in_history(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(
        len(m.get("tool_calls") or [])
        for m in messages
        if isinstance(m, Mapping) and m.get("role") == "assistant"
    )


def _usage_int(response: Any, key: str) -> int | None:
    usage = response.get("usage") if isinstance(response, Mapping) else None
    value = usage.get(key) if isinstance(usage, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def reconstruct(
    model: Model,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    response: Any,
    *,
    billing_tolerance: int = 0,
) -> Reconstruction:
    """Prompt ids, output ids, loss mask and issue codes for one sample. Never raises on
    bad data: a bad sample comes back with `ok: false` and its issue codes."""
    issues: list[str] = []
    try:
        prompt = prompt_ids(model, messages, tools)
    except (PromptError, AttributeError, TypeError, KeyError) as exc:
        prompt = []
        issues.append("bad_prompt")
        detail = {"prompt_error": str(exc)}
    else:
        detail = {}

    answer = answer_fields(response)
    reported = _usage_int(response, "completion_tokens")
    output: list[int] = []
    ended = False
    if answer is None:
        issues.append("provider_error" if _is_error(response) else "malformed_response")
    else:
        if answer.error or answer.finish_reason == "error":
            issues.append("provider_error")
        if answer.finish_reason in LENGTH_REASONS:
            issues.append("truncated")
            # A cut inside a multi-byte character reaches us as U+FFFD: the last id cannot be
            # recovered from text, and the length check cannot see it.
            if (answer.content or answer.reasoning).endswith("\ufffd"):
                issues.append("partial_character")
        try:
            offset = (
                _calls_in_history(messages)
                if model.format.output.tool_call_index == "conversation"
                else 0
            )
            pieces, ended = output_pieces(model, answer, issues, offset)
            output = model.encode(pieces)
        except (AttributeError, TypeError, ValueError) as exc:  # e.g. a tool call not an object
            issues.append("malformed_response")
            detail["response_error"] = f"{type(exc).__name__}: {exc}"
            pieces, ended, output = [], False, []
        if not (answer.reasoning or answer.content or answer.tool_calls) and not _truncated(answer):
            issues.append("empty_response")
        if reported is None:
            issues.append("no_usage")
        elif abs(reported - len(output)) > billing_tolerance:
            issues.append("billing_mismatch")
        reported_prompt = _usage_int(response, "prompt_tokens")
        if prompt and reported_prompt is not None and reported_prompt != len(prompt):
            issues.append("prompt_tokens_mismatch")

    mask_spec = model.format.loss_mask
    loss_mask = [mask_spec.prompt] * len(prompt) + [mask_spec.output] * len(output)
    if ended and output and mask_spec.end_token != mask_spec.output:
        end_len = len(model.encode(model.format.output.end.render()))
        loss_mask[len(loss_mask) - end_len :] = [mask_spec.end_token] * end_len
    issues = list(dict.fromkeys(issues))  # stable, no duplicates
    return Reconstruction(
        ok=not any(code in ERRORS for code in issues),
        issues=issues,
        prompt_ids=prompt,
        output_ids=output,
        loss_mask=loss_mask,
        completion_tokens_reported=reported,
        completion_tokens_reconstructed=len(output),
        details=detail,
    )


def _truncated(answer: AnswerFields) -> bool:
    return answer.finish_reason in LENGTH_REASONS


def _is_error(response: Any) -> bool:
    return isinstance(response, Mapping) and bool(response.get("error"))
