"""The prompt the model was given, held to the output's standard (pure: no IO).

The provider bills `usage.prompt_tokens`: the length of the prompt its stack rendered. The
model's own template is one reading of the messages; a stack may render earlier turns its own
way (OpenRouter's `reasoning` / `reasoning_details` passed on as the model's reasoning field,
earlier reasoning dropped, earlier tool arguments re-serialised), and some stacks leave the
end of the generation prompt (Kimi's `<think>`) for the model to write, billed as output.
Each is a reading: an id sequence. The billed count selects among them: one reading (or one
id sequence) fits, and the prompt is proven; none fits (`prompt_unproven`) or several with
other ids fit (`prompt_ambiguous`), and the record is flagged, with the template's reading
kept for the record's reader. Sources: docs/reconstruct.md, "The prompt".
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kimi_pipe.core.issue_codes import (
    PROMPT_AMBIGUOUS,
    PROMPT_HISTORY_RERENDERED,
    PROMPT_UNPROVEN,
    THINK_OPEN_BILLED_AS_OUTPUT,
)
from kimi_pipe.core.models import Model
from kimi_pipe.core.prompt_render import (
    REASONING_FIELDS,
    TEMPLATE_HISTORY,
    HistoryRendering,
    render_prompt,
)
from kimi_pipe.core.serving import ServingProfile

TEMPLATE_NAME = TEMPLATE_HISTORY.name  # a lone rendering is always the template's


@dataclass(frozen=True)
class PromptReading:
    """One way the prompt may have been rendered: its name and its ids."""

    name: str
    ids: list[int]  # never changed after it is made: readings of one answer share it


@dataclass(frozen=True)
class PromptReadings:
    """Every distinct reading of one request's prompt, the template's first, and the ids of
    the generation prompt's end a stack may leave to the model (empty: none declared)."""

    readings: tuple[PromptReading, ...]
    generation_open: tuple[int, ...] = ()
    open_in_output: bool = False  # the profile says the model writes it (think_open: output)

    @property
    def template(self) -> PromptReading:
        return self.readings[0]


@dataclass(frozen=True)
class PromptProof:
    """What the bill says of the prompt: its ids, the ids moved to the front of the output
    (the generation prompt's end the model wrote itself), the output reading the bill fits
    (an index into `output_lengths`; 0: the as-returned one), and the codes to add."""

    ids: list[int]  # a reading's ids, shared: copy before changing them
    moved_to_output: list[int]
    issues: list[str]
    reading: str
    output_reading: int = 0


def _has_history(messages: Sequence[Mapping[str, Any]]) -> tuple[bool, bool]:
    """Whether any earlier assistant turn carries reasoning, and any carries tool calls:
    without them every reading renders the same text."""
    reasoning = calls = False
    for message in messages:
        # (dict, Mapping): Mapping's answer, JSON's dict without the ABC's registry lookup.
        if isinstance(message, (dict, Mapping)) and message.get("role") == "assistant":
            reasoning = reasoning or any(message.get(k) is not None for k in REASONING_FIELDS)
            calls = calls or bool(message.get("tool_calls"))
    return reasoning, calls


def history_renderings(
    messages: Sequence[Mapping[str, Any]], profile: ServingProfile
) -> list[HistoryRendering]:
    """The renderings the profile admits that can differ for these messages, template first."""
    if profile.history == "template":
        return [TEMPLATE_HISTORY]
    reasoning, calls = _has_history(messages)
    if not (reasoning or calls):
        return [TEMPLATE_HISTORY]  # the common case: one reading, nothing built
    reasonings = ("template", "any_field", "dropped") if reasoning else ("template",)
    arguments = ("verbatim", "compact", "spaced") if calls else ("verbatim",)
    ids = ("verbatim", "canonical") if calls else ("verbatim",)
    return [HistoryRendering(r, a, i) for r, a, i in itertools.product(reasonings, arguments, ids)]


def prompt_readings(
    model: Model,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    profile: ServingProfile,
) -> PromptReadings:
    """The distinct readings of the prompt (raises PromptError like render_prompt)."""
    renderings = history_renderings(messages, profile)
    if len(renderings) == 1:  # no earlier turn to re-render: the common case, one encode
        pieces = render_prompt(model.format, messages, tools, renderings[0])
        readings = [PromptReading(TEMPLATE_NAME, model.encode_prompt(pieces))]
    else:
        seen: set[tuple[Any, ...]] = set()
        readings = []
        for history in renderings:
            pieces = render_prompt(model.format, messages, tools, history)
            key = tuple(pieces)
            if key in seen:
                continue  # the same text: encoded once
            seen.add(key)
            ids = model.encode_prompt(pieces)
            if all(r.ids != ids for r in readings):
                readings.append(PromptReading(history.name, ids))
    opening = model.format.prompt.generation_open
    open_ids: tuple[int, ...] = ()
    if opening is not None and profile.think_open != "prompt":
        open_ids = model.constant_ids(opening)
    return PromptReadings(tuple(readings), open_ids, profile.think_open == "output")


def prove_prompt(
    readings: PromptReadings,
    *,
    billed_prompt: int | None,
    billed_completion: int | None,
    output_lengths: Sequence[int],
    tolerance: int = 0,
) -> PromptProof:
    """Weigh the readings of the prompt (and of the boundary, and of the output) against the
    bill. Proven: exactly one combination fits both billed counts; or, where none does (the
    output has its own flags), exactly one prompt reading fits the prompt count as rendered.
    Without a billed prompt count the template's reading stands; reconstruct flags it
    `prompt_not_billed` where other readings have other ids."""
    template = readings.template
    if billed_prompt is None:
        return PromptProof(template.ids, [], [], template.name)
    moved = len(readings.generation_open)
    shifts = [moved] if readings.open_in_output else [0] + ([moved] if moved else [])
    if tolerance:
        # A bill with slack cannot place a one-id boundary: the declared one, the output as read.
        shifts, output_lengths = shifts[:1], output_lengths[:1]

    def prompt_fits(reading: PromptReading, shift: int) -> bool:
        if shift and tuple(reading.ids[-shift:]) != readings.generation_open:
            return False
        return abs(len(reading.ids) - shift - billed_prompt) <= tolerance  # type: ignore[operator]

    both = [
        (reading, shift, index)
        for reading in readings.readings
        for shift in shifts
        if prompt_fits(reading, shift)
        for index, length in enumerate(output_lengths)
        # Another output reading (a tool-call turn one marker short) only beside a stack that
        # left `<think>` to the model, as the one recorded doing it: the prompt's bill shows it.
        if index == 0 or shift
        if billed_completion is not None and abs(length + shift - billed_completion) <= tolerance
    ]
    if not both:
        # The output does not fit its bill as read (its own flags say why): the prompt alone,
        # with the boundary it places (a `<think>` not in the prompt is the output's first id).
        alone = [(r, shift) for r in readings.readings for shift in shifts if prompt_fits(r, shift)]
        if len(alone) != 1:
            code = PROMPT_UNPROVEN if not alone else PROMPT_AMBIGUOUS
            return PromptProof(template.ids, [], [code], template.name)
        both = [(alone[0][0], alone[0][1], 0)]
    if len(both) > 1 and tolerance:
        # Within the slack, the reading nearest the billed count, when one is nearest.
        def miss(fit: tuple[PromptReading, int, int]) -> int:
            return abs(len(fit[0].ids) - fit[1] - billed_prompt)  # type: ignore[operator]

        nearest = min(map(miss, both))
        both = [fit for fit in both if miss(fit) == nearest]
    if len(both) > 1:
        return PromptProof(template.ids, [], [PROMPT_AMBIGUOUS], template.name)
    reading, shift, index = both[0]
    issues = [] if reading is template else [PROMPT_HISTORY_RERENDERED]
    ids = reading.ids
    if shift:
        issues.append(THINK_OPEN_BILLED_AS_OUTPUT)
        return PromptProof(ids[:-shift], list(ids[-shift:]), issues, reading.name, index)
    return PromptProof(ids, [], issues, reading.name, index)
