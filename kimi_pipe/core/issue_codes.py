"""Every code a record can carry, in one place: issue codes, notes, evidence rungs and flags.

A record's `issues` list holds errors (they make `ok` false) and notes (listed, `ok` kept);
its `evidence` is one rung of the ladder (docs/design.md, "Evidence ladder"). The modules
that set a code import it from here; the older names (`reconstruction.ERRORS`,
`split_check.SPLIT_AMBIGUOUS`, ...) are these same objects, imported where they were defined.
This module imports nothing of the package: every layer may use it.
"""

from __future__ import annotations

from enum import StrEnum


class Code(StrEnum):
    """Every code a record, a skip or a flag can carry; each member equals its string
    (`Code.TRUNCATED == "truncated"`), so records, JSON and comparisons are unchanged."""

    def __repr__(self) -> str:
        return repr(self.value)  # a printed list or table of codes reads as before: 'truncated'

    # --- the evidence ladder (core/evidence.py), strongest first ----------------------------------
    ENGINE_IDS = "engine_ids"  # whole-output logprobs confirmed against the text and the bill
    TEXT_PROVEN = "text_proven"  # text + serving profile + billed length prove the ids
    TARGET_RESOLVED = "target_resolved"  # the target model chose among a closed candidate set
    PREFIX_PROVEN = "prefix_proven"  # flagged; the ids every reading shares up to a cut are used
    # flagged; drawn from the target's posterior, not bought
    POSTERIOR_SAMPLED = "posterior_sampled"
    UNRESOLVED = "unresolved"  # flagged; `issues` says why
    # --- reconstruction (core/reconstruction.py): errors make `ok` false --------------------------
    # reconstructed length != usage.completion_tokens (+- tol)
    BILLING_MISMATCH = "billing_mismatch"
    PARTIAL_CHARACTER = "partial_character"  # cut inside a UTF-8 character (text holds U+FFFD)
    LEADING_SPACE_AFTER_MARKER = "leading_space_after_marker"  # a space after a marker: whose?
    SPACE_BEFORE_TOOL_SECTION = "space_before_tool_section"  # content ends in whitespace: moved?
    # stripped tail the bill can't prove
    REASONING_TAIL_UNVERIFIABLE = "reasoning_tail_unverifiable"
    TOOL_ARGUMENTS_EDGES_UNVERIFIABLE = "tool_arguments_edges_unverifiable"  # stripped edges
    # The prompt, held to the output's standard (core/prompt_proof.py):
    PROMPT_UNPROVEN = "prompt_unproven"  # no reading of the prompt has the billed prompt count
    PROMPT_AMBIGUOUS = "prompt_ambiguous"  # readings with other ids have the billed count
    # readings of the prompt have other ids and no prompt count was billed to pick one
    PROMPT_NOT_BILLED = "prompt_not_billed"
    OTHER_MODEL = "other_model"  # the answer names a model the model config does not declare
    MALFORMED_RESPONSE = "malformed_response"  # no choices / no message / not an object
    PROVIDER_ERROR = "provider_error"  # an error body or finish_reason "error"
    EMPTY_RESPONSE = "empty_response"  # nothing at all came back
    BAD_PROMPT = "bad_prompt"  # the prompt messages cannot be rendered
    # the profile declares marker spaces, the answer lacks them
    MARKER_SPACING_MISMATCH = "marker_spacing_mismatch"
    # a tool-call id whose index is not the model's counter
    TOOL_INDEX_UNTRUSTED = "tool_index_untrusted"
    # an id rebuilt from a name the request does not declare
    TOOL_NAME_NOT_DECLARED = "tool_name_not_declared"
    # reasoning only, no think-end: dropped or never written?
    REASONING_WITHOUT_THINK_END = "reasoning_without_think_end"
    # typed values a stack may have re-serialised ("30" -> 30)
    TOOL_ARGUMENTS_MAYBE_COERCED = "tool_arguments_maybe_coerced"
    TOOL_INDEX_UNVERIFIABLE = "tool_index_unverifiable"
    # A tool-call turn billed one id under its reading (with the `<think>` the model wrote): one
    # marker no parser needs is missing (section inside the reasoning, no end-of-turn, ...).
    TOOL_TURN_MARKER_MISSING = "tool_turn_marker_missing"
    # --- reconstruction notes: listed, `ok` kept --------------------------------------------------
    # finish_reason == "length": cut by max_tokens. Its ids are proven like any other (no
    # end-of-turn appended); a cut inside a character is `partial_character`.
    TRUNCATED = "truncated"
    SINGLE_CANDIDATE = "single_candidate"  # one id sequence fits text, every reading and the bill
    # The billed prompt fits a stack's re-rendering of earlier turns (reasoning from another
    # field or dropped, arguments re-serialised), not the template's: those ids are the prompt.
    PROMPT_HISTORY_RERENDERED = "prompt_history_rerendered"
    # Prompt billed shorter and completion longer by the generation prompt's end (`<think>`): the
    # model wrote it; the same ids, the boundary (and the loss mask) moved after the given prompt.
    THINK_OPEN_BILLED_AS_OUTPUT = "think_open_billed_as_output"
    # The answer's text starts with the generation prompt's end (`<think>`) as characters (no
    # reasoning parser took it out, or the stack echoed the prompt's): read as the marker, which
    # the bills place in the output (the note above) or leave in the prompt.
    THINK_OPEN_AS_TEXT = "think_open_as_text"
    RAW_MARKERS_IN_REASONING = "raw_markers_in_reasoning"  # marker text in reasoning became ids
    # Records before 2026-12-07: tool calls, no content, and the bill fit the reading without a
    # think-end, read as the tool-call section written inside the reasoning. Other readings fit
    # that bill too; such a turn is now `tool_turn_marker_missing`, this one of its options.
    TOOL_SECTION_IN_REASONING = "tool_section_in_reasoning"
    # Typed argument values (numbers, booleans) that the bill shows were written as they are: the
    # same values as strings would cost at least two ids more (tool_arguments_maybe_coerced lifted).
    TOOL_ARGUMENT_TYPES_BILLED = "tool_argument_types_billed"
    TOOL_CALL_IDS_REBUILT = "tool_call_ids_rebuilt"  # ids not in the model's pattern were rebuilt
    NO_USAGE = "no_usage"  # no usage.completion_tokens to check against
    # no reasoning field: split content at the think-end marker
    REASONING_FROM_CONTENT = "reasoning_from_content"
    # reasoning taken from reasoning_details blocks
    REASONING_FROM_DETAILS = "reasoning_from_details"
    # marker text inside content became marker ids
    RAW_MARKERS_IN_CONTENT = "raw_markers_in_content"
    # kept verbatim where the format wanted parsed arguments
    TOOL_ARGUMENTS_NOT_JSON = "tool_arguments_not_json"
    # the space beside each marker removed (spaces_between_...)
    MARKER_SPACES_REMOVED = "marker_spaces_removed"
    # index mapped back to the model's conversation counter
    TOOL_INDEX_REPAIRED = "tool_index_repaired"
    # truncated dotted name matched to the one declared tool
    TOOL_NAME_REPAIRED = "tool_name_repaired"
    # the model ended its turn inside the reasoning (billed length proves it)
    NO_THINK_END = "no_think_end"
    # --- engine logprobs (core/logprobs.py) -------------------------------------------------------
    LOGPROB_MISMATCH = "logprob_mismatch"  # covered text differs from the answer text
    LOGPROBS_INVALID = "logprobs_invalid"
    # same text, other ids than re-encoding: engine's kept
    NONCANONICAL_SPLIT = "noncanonical_split"
    LOGPROBS_MISSING = "logprobs_missing"  # logprobs were asked for and none came back
    STACK_CHANGED_TEXT = "stack_changed_text"
    # --- answer checks (core/answer_checks.py) ----------------------------------------------------
    CONTENT_FILTER = "content_filter"  # the provider's filter cut or replaced the answer
    OTHER_PROVIDER = "other_provider"  # the answer names a provider outside routing `only`
    MODEL_UNNAMED = "model_unnamed"  # the answer names no model: which one wrote it?
    # the provider said nothing about why the answer ended
    FINISH_REASON_NULL = "finish_reason_null"
    FINISH_REASON_UNKNOWN = "finish_reason_unknown"  # a finish reason no provider documents
    # the prompt held lone surrogates / invalid UTF-8 (now U+FFFD)
    PROMPT_TEXT_REPLACED = "prompt_text_replaced"
    ANSWER_TEXT_REPLACED = "answer_text_replaced"  # the answer did
    API_KEY_ECHOED = "api_key_echoed"  # the answer contained the API key (redacted before writing)
    # --- the reconstruct stage (stages/reconstruct.py) --------------------------------------------
    MALFORMED_RECORD = "malformed_record"  # an input line that is no record (bad JSON, wrong kinds)
    BAD_SERVING_PROFILE = "bad_serving_profile"  # a stored serving_profile names no conf/serving
    # --- target resolution and split checks (extraction/) -----------------------------------------
    TARGET_UNRESOLVED = "target_unresolved"  # scored, but no option reached resolve.min_posterior
    # note: the target chose the option (posterior stated)
    RESOLVED_BY_TARGET = "resolved_by_target"
    SPLIT_CHECKED = "split_checked"  # note: no other split was possible under the sampling
    SPLIT_RESOLVED = "split_resolved"  # note: the target chose among splits (posterior stated)
    SPLIT_AMBIGUOUS = "split_ambiguous"  # issue: another split is too likely, or not enumerable
    TARGET_DISAGREES = "target_disagrees"  # issue: the ids are impossible under the sampling
    PREFIX_SPLIT_CHECKED = "prefix_split_checked"  # note: the target confirmed the prefix
    PREFIX_SPLIT_AMBIGUOUS = "prefix_split_ambiguous"  # issue: another split may leave it early
    # --- extraction's per-sample skip reasons (extraction/sharding.py) ----------------------------
    # a captured state has NaN or inf: not written
    NONFINITE_HIDDEN_STATE = "nonfinite_hidden_state"
    CAPTURE_OOM = "capture_oom"  # out of memory even alone in a batch: sample not written
    BAD_CAPTURE = "bad_capture"  # the engine returned states of the wrong shape for this sample
    # --- provider billing flags (providers/calls.py) ----------------------------------------------
    TOOL_ARGUMENTS_NOT_STRING = "tool_arguments_not_string"  # a stack sent arguments as an object
    BILLED_ERROR_BODY = "billed_error_body"  # an error body that was billed anyway
    BILLED_ABOVE_RESERVATION = "billed_above_reservation"  # stated cost above what was reserved
    COST_BELOW_LISTED_PRICE = "cost_below_listed_price"  # stated cost < tokens x listed price


# The names the package imports: each the member itself, typed as the string it equals (a
# record's codes are plain strings once read back).

# --- the evidence ladder (core/evidence.py), strongest first ---------------------------------
ENGINE_IDS: str = Code.ENGINE_IDS
TEXT_PROVEN: str = Code.TEXT_PROVEN
TARGET_RESOLVED: str = Code.TARGET_RESOLVED
PREFIX_PROVEN: str = Code.PREFIX_PROVEN
POSTERIOR_SAMPLED: str = Code.POSTERIOR_SAMPLED
UNRESOLVED: str = Code.UNRESOLVED

# --- reconstruction (core/reconstruction.py): errors make `ok` false -------------------------
BILLING_MISMATCH: str = Code.BILLING_MISMATCH
PARTIAL_CHARACTER: str = Code.PARTIAL_CHARACTER
LEADING_SPACE_AFTER_MARKER: str = Code.LEADING_SPACE_AFTER_MARKER
SPACE_BEFORE_TOOL_SECTION: str = Code.SPACE_BEFORE_TOOL_SECTION
REASONING_TAIL_UNVERIFIABLE: str = Code.REASONING_TAIL_UNVERIFIABLE
TOOL_ARGUMENTS_EDGES_UNVERIFIABLE: str = Code.TOOL_ARGUMENTS_EDGES_UNVERIFIABLE
PROMPT_UNPROVEN: str = Code.PROMPT_UNPROVEN
PROMPT_AMBIGUOUS: str = Code.PROMPT_AMBIGUOUS
OTHER_MODEL: str = Code.OTHER_MODEL
RECONSTRUCTION_ERRORS: frozenset[str] = frozenset(
    {
        BILLING_MISMATCH,
        PROMPT_UNPROVEN,
        PROMPT_AMBIGUOUS,
        Code.PROMPT_NOT_BILLED,
        OTHER_MODEL,
        Code.MALFORMED_RESPONSE,
        Code.PROVIDER_ERROR,
        Code.EMPTY_RESPONSE,
        Code.BAD_PROMPT,
        PARTIAL_CHARACTER,
        # What a serving stack may change without changing the length (docs/serving_profiles.md):
        LEADING_SPACE_AFTER_MARKER,
        Code.MARKER_SPACING_MISMATCH,
        Code.TOOL_INDEX_UNTRUSTED,
        Code.TOOL_NAME_NOT_DECLARED,
        Code.REASONING_WITHOUT_THINK_END,
        REASONING_TAIL_UNVERIFIABLE,
        Code.TOOL_ARGUMENTS_MAYBE_COERCED,
        SPACE_BEFORE_TOOL_SECTION,
        # A stack that strips the arguments' edges (`\s*` in the parser) leaves no trace of
        # whitespace there that costs no id (' {"' and '{"' are one token each):
        TOOL_ARGUMENTS_EDGES_UNVERIFIABLE,
        # A conversation with earlier calls and an index a stack rebuilt or may have rebuilt:
        # the model's own index (its counter, or 0 again) is not in the text.
        Code.TOOL_INDEX_UNVERIFIABLE,
        Code.TOOL_TURN_MARKER_MISSING,
    }
)

# Flags whose readings differ in length from the text as returned (a marker space or a moved
# space that costs an id, a think-end that may be missing): beside them one id fewer has
# another explanation than a missing marker (`tool_turn_marker_missing`).
LENGTH_AMBIGUOUS: frozenset[str] = frozenset(
    {
        LEADING_SPACE_AFTER_MARKER,
        Code.MARKER_SPACING_MISMATCH,
        SPACE_BEFORE_TOOL_SECTION,
        Code.REASONING_WITHOUT_THINK_END,
    }
)

# --- reconstruction notes: listed, `ok` kept ----------------------------------------------
TRUNCATED: str = Code.TRUNCATED
SINGLE_CANDIDATE: str = Code.SINGLE_CANDIDATE
PROMPT_HISTORY_RERENDERED: str = Code.PROMPT_HISTORY_RERENDERED
THINK_OPEN_BILLED_AS_OUTPUT: str = Code.THINK_OPEN_BILLED_AS_OUTPUT
THINK_OPEN_AS_TEXT: str = Code.THINK_OPEN_AS_TEXT
RAW_MARKERS_IN_REASONING: str = Code.RAW_MARKERS_IN_REASONING
TOOL_SECTION_IN_REASONING: str = Code.TOOL_SECTION_IN_REASONING
TOOL_ARGUMENT_TYPES_BILLED: str = Code.TOOL_ARGUMENT_TYPES_BILLED
RECONSTRUCTION_NOTES: frozenset[str] = frozenset(
    {
        TRUNCATED,
        SINGLE_CANDIDATE,
        PROMPT_HISTORY_RERENDERED,
        THINK_OPEN_BILLED_AS_OUTPUT,
        THINK_OPEN_AS_TEXT,
        RAW_MARKERS_IN_REASONING,
        Code.TOOL_CALL_IDS_REBUILT,
        Code.NO_USAGE,
        Code.REASONING_FROM_CONTENT,
        Code.REASONING_FROM_DETAILS,
        Code.RAW_MARKERS_IN_CONTENT,
        Code.TOOL_ARGUMENTS_NOT_JSON,
        # A declared serving profile undid a change (docs/serving_profiles.md):
        Code.MARKER_SPACES_REMOVED,
        Code.TOOL_INDEX_REPAIRED,
        Code.TOOL_NAME_REPAIRED,
        Code.NO_THINK_END,
        # Older records' note (unlisted, extraction took it for a blocking code).
        Code.TOOL_SECTION_IN_REASONING,
    }
)
# Codes that keep a record out of training files whatever the policy: the last id is unknown.
NEVER_USABLE: frozenset[str] = frozenset({PARTIAL_CHARACTER})

# --- engine logprobs (core/logprobs.py) -----------------------------------------------------
LOGPROB_ERRORS: frozenset[str] = frozenset(
    {
        Code.LOGPROB_MISMATCH,
        # Entries that are not tokens or do not fit the output: the answer was changed
        # somewhere between the engine and us, so re-encoding its text proves nothing.
        Code.LOGPROBS_INVALID,
    }
)
NONCANONICAL_SPLIT: str = Code.NONCANONICAL_SPLIT
LOGPROB_NOTES: frozenset[str] = frozenset(
    {
        NONCANONICAL_SPLIT,
        Code.LOGPROBS_MISSING,
        # The text differs from the engine's tokens only where stacks change it (whitespace
        # beside markers, argument values coerced to schema types): the engine's ids kept.
        Code.STACK_CHANGED_TEXT,
    }
)

# --- answer checks (core/answer_checks.py) --------------------------------------------------
CONTENT_FILTER: str = Code.CONTENT_FILTER
OTHER_PROVIDER: str = Code.OTHER_PROVIDER
ANSWER_CODES: frozenset[str] = frozenset(
    {
        OTHER_PROVIDER,
        OTHER_MODEL,  # also: the answer names another model than the one requested
        Code.MODEL_UNNAMED,
        Code.FINISH_REASON_NULL,
        Code.FINISH_REASON_UNKNOWN,
        CONTENT_FILTER,
    }
)
TEXT_CODES: frozenset[str] = frozenset(
    {
        Code.PROMPT_TEXT_REPLACED,
        Code.ANSWER_TEXT_REPLACED,
        Code.API_KEY_ECHOED,
    }
)

# --- closed candidate sets (core/candidates.py): flag code -> ambiguity class ------------
CLASS_OF_CODE: dict[str, str] = {
    REASONING_TAIL_UNVERIFIABLE: "reasoning_tail",
    LEADING_SPACE_AFTER_MARKER: "marker_space",
    SPACE_BEFORE_TOOL_SECTION: "tool_section_space",
    TOOL_ARGUMENTS_EDGES_UNVERIFIABLE: "argument_edges",
    Code.TOOL_ARGUMENTS_MAYBE_COERCED: "argument_types",
    Code.TOOL_TURN_MARKER_MISSING: "missing_marker",
}

# --- the reconstruct stage (stages/reconstruct.py) ----------------------------------------
MALFORMED_RECORD: str = Code.MALFORMED_RECORD
BAD_SERVING_PROFILE: str = Code.BAD_SERVING_PROFILE

# --- target resolution and split checks (extraction/) -------------------------------------
TARGET_UNRESOLVED: str = Code.TARGET_UNRESOLVED
RESOLVED_BY_TARGET: str = Code.RESOLVED_BY_TARGET
SPLIT_CHECKED: str = Code.SPLIT_CHECKED
SPLIT_RESOLVED: str = Code.SPLIT_RESOLVED
SPLIT_AMBIGUOUS: str = Code.SPLIT_AMBIGUOUS
TARGET_DISAGREES: str = Code.TARGET_DISAGREES
PREFIX_SPLIT_CHECKED: str = Code.PREFIX_SPLIT_CHECKED
PREFIX_SPLIT_AMBIGUOUS: str = Code.PREFIX_SPLIT_AMBIGUOUS

# --- extraction's per-sample skip reasons (extraction/sharding.py) ---------------------------
NONFINITE_HIDDEN_STATE: str = Code.NONFINITE_HIDDEN_STATE
CAPTURE_OOM: str = Code.CAPTURE_OOM
BAD_CAPTURE: str = Code.BAD_CAPTURE

# --- provider billing flags (providers/calls.py) -----------------------------------------
TOOL_ARGUMENTS_NOT_STRING: str = Code.TOOL_ARGUMENTS_NOT_STRING
BILLED_ERROR_BODY: str = Code.BILLED_ERROR_BODY
BILLED_ABOVE_RESERVATION: str = Code.BILLED_ABOVE_RESERVATION
COST_BELOW_LISTED_PRICE: str = Code.COST_BELOW_LISTED_PRICE
