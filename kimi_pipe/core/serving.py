"""Serving profiles: what a serving stack does to the model's text before we see it.

A profile is data (`conf/serving/*.yaml`). Reconstruction undoes what a declared profile
makes invertible (a note code, `ok` unchanged) and flags what it does not. `unknown`
declares nothing: every pattern a stack could have caused is flagged. The config default,
`auto`, has every field unknown here; generate replaces it with the profile its probes fit
(stages/serving_auto.py). Facts and how to pick a profile: docs/serving_profiles.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kimi_pipe.core.plain import plain

UNKNOWN = "unknown"

# field -> the values it may take ("unknown" is allowed everywhere)
CHOICES: dict[str, tuple[str, ...]] = {
    # vLLM's spaces_between_special_tokens=True with Kimi's slow tokenizer puts one space
    # on each side of every marker the decoded text keeps (`spaces`). Streaming (vLLM 0.15),
    # the space before a marker travels in the marker's own delta and is dropped with it:
    # only the space after each marker reaches the client (`leading`).
    "marker_spacing": ("none", "spaces", "leading"),
    # vLLM 0.33 strips the reasoning's trailing whitespace.
    "reasoning_tail": ("kept", "stripped"),
    # Who wrote the tool-call ids we get back:
    #   model: the model's own id, verbatim (vLLM 0.33, Moonshot)
    #   conversation: rebuilt as functions.{name}:{calls before + position} (SGLang 0.5.23)
    #   double_count: SGLang 0.5.14, history count added to the model's own index
    #   per_answer: rebuilt counting from 0 in each answer
    #   foreign: replaced by call_.../chatcmpl-tool-... (vLLM 0.15 auto tools, some gateways)
    "tool_call_ids": ("model", "conversation", "double_count", "per_answer", "foreign"),
    # vLLM 0.15 returns only the part of a dotted name after the last dot (web.search -> search).
    "tool_names": ("full", "last_dot_part"),
    # vLLM 0.33 coerces argument values to the declared schema type ("30" -> 30).
    "argument_types": ("verbatim", "coerced"),
    # A detokenizer that drops the think-end marker leaves the whole reply in the reasoning.
    "think_end": ("kept", "dropped"),
    # The Kimi tool parsers of vLLM and SGLang match `\s*{arguments}\s*` between the markers:
    # whitespace the model wrote at the arguments' edges is gone (`stripped`).
    "argument_edges": ("kept", "stripped"),
    # How the stack renders earlier turns: as the model's template does (`template`), or its
    # own way (`rerendered`: OpenRouter's reasoning spellings passed on, earlier reasoning
    # dropped, earlier arguments re-serialised). The billed prompt count decides among the
    # readings the profile admits (core/prompt_proof.py).
    "history": ("template", "rerendered"),
    # Where the generation prompt's last piece (Kimi's `<think>`) is: in the prompt the stack
    # renders, or left for the model to write and billed as output.
    "think_open": ("prompt", "output"),
}


@dataclass(frozen=True)
class ServingProfile:
    name: str = UNKNOWN
    marker_spacing: str = UNKNOWN
    reasoning_tail: str = UNKNOWN
    tool_call_ids: str = UNKNOWN
    tool_names: str = UNKNOWN
    argument_types: str = UNKNOWN
    think_end: str = UNKNOWN
    argument_edges: str = UNKNOWN
    history: str = UNKNOWN
    think_open: str = UNKNOWN

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None) -> ServingProfile:
        """Build from `serving` config; an unknown key or value is a clear error."""
        if not cfg:
            return cls()
        data = {str(k): v for k, v in dict(cfg).items() if k not in ("description", "source")}
        known = {f.name for f in fields(cls)}
        extra = set(data) - known
        if extra:
            raise ValueError(
                f"serving profile: unknown keys {sorted(extra)} (allowed: {sorted(known)}); "
                "see docs/serving_profiles.md"
            )
        for key, value in data.items():
            if key == "name":
                continue
            allowed = (*CHOICES[key], UNKNOWN)
            if value not in allowed:
                raise ValueError(
                    f"serving profile {data.get('name', '?')!r}: {key}={value!r}, "
                    f"expected one of {list(allowed)}"
                )
        return cls(**{k: str(v) for k, v in data.items()})


UNKNOWN_PROFILE = ServingProfile()


def admitted_stacks(profile: ServingProfile) -> dict[str, list[str]]:
    """Every behaviour a profile admits, field by field (`unknown`: all of CHOICES): what a
    closed candidate set was proven against (tests/test_closed_sets.py checks the claim)."""
    return {
        key: list(choices) if getattr(profile, key) == UNKNOWN else [getattr(profile, key)]
        for key, choices in CHOICES.items()
    }


def serving_profile(cfg: Any) -> ServingProfile:
    """The `serving` group of a composed config (absent: unknown)."""

    section = cfg.get("serving") if hasattr(cfg, "get") else None
    return ServingProfile.from_config(plain(section))
