"""core/prompt_proof.py: the billed counts pick one reading of the prompt, the boundary and the
output, or the record says why (pure function, readings written out by hand)."""

from __future__ import annotations

from kimi_pipe.core.prompt_proof import PromptReading, PromptReadings, prove_prompt

OPEN = 9  # the generation prompt's last id, which a stack may leave to the model
TEMPLATE = PromptReading("template", [1, 2, 3, OPEN])
RERENDERED = PromptReading("reasoning_any_field", [1, 2, 7, 7, 3, OPEN])
READINGS = PromptReadings((TEMPLATE, RERENDERED), generation_open=(OPEN,))


def proof(billed_prompt: int | None, billed_completion: int | None, *outputs: int, **kw):
    return prove_prompt(
        READINGS,
        billed_prompt=billed_prompt,
        billed_completion=billed_completion,
        output_lengths=list(outputs) or [5],
        **kw,
    )


def test_the_template_fits_both_bills() -> None:
    got = proof(4, 5)
    assert (got.ids, got.moved_to_output, got.issues) == ([1, 2, 3, OPEN], [], [])


def test_a_rerendered_history_fits_the_bill() -> None:
    got = proof(6, 5)
    assert got.ids == list(RERENDERED.ids) and got.issues == ["prompt_history_rerendered"]


def test_the_model_wrote_the_open_marker() -> None:
    """Prompt one short and completion one over: the marker moves to the output."""
    got = proof(3, 6)
    assert got.ids == [1, 2, 3] and got.moved_to_output == [OPEN]
    assert got.issues == ["think_open_billed_as_output"]


def test_the_prompt_alone_places_the_boundary() -> None:
    """Prompt one short, completion as read: no reading explains both bills. The prompt's
    alone fits one reading, with the marker left to the model; the output, one over its bill
    with it, carries its own flag (reconstruct), and candidate readings weigh both bills."""
    got = proof(3, 5)
    assert got.ids == [1, 2, 3] and got.moved_to_output == [OPEN]
    assert got.issues == ["think_open_billed_as_output"]


def test_the_prompt_alone_with_two_boundaries_is_ambiguous() -> None:
    dropped = PromptReading("reasoning_dropped", [1, 2, OPEN])  # three ids, as rendered
    readings = PromptReadings((TEMPLATE, dropped), generation_open=(OPEN,))
    got = prove_prompt(readings, billed_prompt=3, billed_completion=9, output_lengths=[5])
    assert got.issues == ["prompt_ambiguous"] and got.moved_to_output == []


def test_another_output_reading_only_beside_a_shift() -> None:
    # Output readings 6 (as read) and 5 (no think-end): completion 6 with the prompt as
    # rendered is the as-read output; the other reading is never chosen without a shift.
    assert proof(4, 6, 6, 5).output_reading == 0
    # Prompt one short, completion 6 = the other reading (5) + the moved marker.
    got = proof(3, 6, 6, 5)
    assert got.output_reading == 1 and got.moved_to_output == [OPEN]
    assert proof(4, 5, 6, 5).output_reading == 0  # no shift: as read, the bill flags it


def test_no_reading_fits() -> None:
    got = proof(40, 5)
    assert got.issues == ["prompt_unproven"] and got.ids == list(TEMPLATE.ids)


def test_readings_with_other_ids_at_the_billed_count() -> None:
    twin = PromptReading("arguments_compact", [1, 2, 4, OPEN])
    readings = PromptReadings((TEMPLATE, twin), generation_open=(OPEN,))
    got = prove_prompt(readings, billed_prompt=4, billed_completion=5, output_lengths=[5])
    assert got.issues == ["prompt_ambiguous"]


def test_no_billed_prompt_keeps_the_template() -> None:
    got = proof(None, 5)
    assert got.ids == list(TEMPLATE.ids) and got.issues == []


def test_a_tolerant_bill_places_no_boundary() -> None:
    got = proof(3, 6, tolerance=2)
    assert got.moved_to_output == [] and got.ids == list(TEMPLATE.ids)
