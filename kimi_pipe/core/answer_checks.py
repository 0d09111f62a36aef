"""Checks on a provider's answer that token reconstruction cannot make, and text repair.

`answer_issues` flags an answer that is not what was asked for: another model than the
one requested (a dated variant such as `-0127` is the same model) or no model named, another
provider than the routing's `only` list, a finish reason that is null, unknown or
`content_filter`. Each is an error code (the record is not `ok`).

`clean_text` makes any JSON-like value writable: lone surrogates (from a `\\ud800` escape or
invalid UTF-8 read with surrogateescape) become U+FFFD, non-finite floats become strings,
and an API key echoed anywhere is replaced by `***`; it says what it changed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from kimi_pipe.core.issue_codes import CONTENT_FILTER, OTHER_PROVIDER, Code

# finish_reason values a provider really sends for a completed answer (OpenAI's and the
# native ones OpenRouter passes on in `native_finish_reason`), lower-cased.
KNOWN_FINISH_REASONS = frozenset(
    {
        "stop",
        "length",
        "tool_calls",
        "function_call",
        "eos",
        "end_turn",
        "stop_sequence",
        "max_tokens",
        "max_output_tokens",
        "tool_use",
        "model_length",
    }
)

_DATED = re.compile(r"-\d{4}(?:-?\d{2}){0,2}$")  # -0127, -2025-01-27, -20250127
_SURROGATE = re.compile("[\ud800-\udfff]")


def _names(model: str) -> set[str]:
    """A LiteLLM model string and its tails: openrouter/moonshotai/kimi-k2.5 ->
    {that, moonshotai/kimi-k2.5, kimi-k2.5}."""
    parts = model.lower().split("/")
    # Empty parts kept: `openai//abs/path` (a local server's model) answers as `/abs/path`.
    return {name for i in range(len(parts)) if (name := "/".join(parts[i:]))}


def same_model(answered: str, asked: str) -> bool:
    names = _names(asked)
    answered = answered.lower()
    return answered in names or _DATED.sub("", answered) in names


def _provider_key(name: str) -> str:
    """OpenRouter's routing slugs (`atlas-cloud`, `deepinfra/fp4`) and the provider names its
    answers carry (`AtlasCloud`, `DeepInfra`) compared alike."""
    return re.sub(r"[^a-z0-9]", "", name.split("/")[0].lower())


def other_provider(response: dict[str, Any], request: dict[str, Any] | None) -> bool:
    """The answer names a provider outside the request's routing `only` list (a fallback the
    pinning should have refused): its serving stack is not the one the job was pinned to."""
    extra = (request or {}).get("extra_body") or {}
    routing = extra.get("provider") if isinstance(extra, dict) else None
    only = routing.get("only") if isinstance(routing, dict) else None
    answered = response.get("provider")
    if not only or not isinstance(answered, str) or not answered:
        return False
    return _provider_key(answered) not in {_provider_key(str(name)) for name in only}


def answer_issues(
    response: dict[str, Any], asked_model: str, request: dict[str, Any] | None = None
) -> list[str]:
    issues: list[str] = []
    answered = response.get("model")
    if not isinstance(answered, str) or not answered.strip():
        # Every provider recorded names its model (docs/wild.md); an answer that does not
        # says nothing of which model wrote it, and is not taken for the one asked.
        issues.append(Code.MODEL_UNNAMED)
    elif not same_model(answered, asked_model):
        issues.append(Code.OTHER_MODEL)
    if other_provider(response, request):
        issues.append(OTHER_PROVIDER)
    choices = response.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    psf = choice.get("provider_specific_fields") or {}
    # LiteLLM maps null and unknown reasons to "stop"; the provider's own value survives in
    # provider_specific_fields when it sent one.
    if isinstance(psf, dict) and "native_finish_reason" in psf:
        finish = psf["native_finish_reason"]
    else:
        finish = choice.get("finish_reason")
    if finish is None:
        issues.append(Code.FINISH_REASON_NULL)
    elif not isinstance(finish, str):
        issues.append(Code.FINISH_REASON_UNKNOWN)
    elif finish.lower() == CONTENT_FILTER or choice.get("finish_reason") == CONTENT_FILTER:
        issues.append(CONTENT_FILTER)
    elif finish.lower() not in KNOWN_FINISH_REASONS and finish.lower() != "error":
        issues.append(Code.FINISH_REASON_UNKNOWN)
    return issues


@dataclass
class TextRepair:
    surrogates: bool = False
    key_echoed: bool = False
    non_finite: bool = False


def clean_text(value: Any, key: str | None = None, repair: TextRepair | None = None) -> Any:
    """`value` with lone surrogates replaced, non-finite floats as strings and `key`
    redacted; what was changed is set on `repair`."""
    repair = repair if repair is not None else TextRepair()
    if isinstance(value, str):
        if key and key in value:
            repair.key_echoed = True
            value = value.replace(key, "***")
        if _SURROGATE.search(value):
            repair.surrogates = True
            value = _SURROGATE.sub("\ufffd", value)
        return value
    if isinstance(value, dict):
        return {clean_text(k, key, repair): clean_text(v, key, repair) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_text(v, key, repair) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        repair.non_finite = True
        return repr(value)
    return value
