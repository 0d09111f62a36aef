"""The suite's cases and models, shared with the tools that check against the suite
(tools/check_install.py, tools/check_prompt_reference.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from kimi_pipe.core.models import Model, load_model
from kimi_pipe.core.serving import ServingProfile
from kimi_pipe.core.tokenizers import STRICT_ENV, TokenizerNotFound

# The hand-written provider answers keep the reasoning's trailing whitespace and the tool-call
# arguments' edges, as a stack that declares `reasoning_tail: kept` and `argument_edges: kept`
# does; under the default `unknown` profile a tail that could have lost a newline is flagged
# (test_unknown_stack_flags_an_unprovable_reasoning_tail), and so are arguments a stripping
# parser may have trimmed at no cost in ids.
TAIL_KEPT = ServingProfile(name="tail_kept", reasoning_tail="kept", argument_edges="kept")
# The same, on a command line (two overrides: splice with *).
TAIL_KEPT_OVERRIDES = ("serving.reasoning_tail=kept", "serving.argument_edges=kept")

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def model_config(name: str) -> Any:
    return OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml")


def load_or_skip(name: str, **tokenizer_overrides: Any) -> Model:
    cfg = model_config(name)
    for key, value in tokenizer_overrides.items():
        cfg.tokenizer[key] = value
    try:
        return load_model(cfg)
    except TokenizerNotFound as exc:
        if os.environ.get(STRICT_ENV) == "1":
            pytest.fail(f"{STRICT_ENV}=1 and the {name} tokenizer is missing: {exc}")
        pytest.skip(f"{name} tokenizer not available: {exc}")


def read_cases(name: str) -> list[dict[str, Any]]:
    with (FIXTURES / name).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def expected_output_ids(model: Model, case: dict[str, Any]) -> list[int]:
    """A case's true output ids: `expect.output_ids` where the fixture builder spelled them
    out, else the raw model text encoded with every marker name recognised."""
    expect = case["expect"]
    if expect.get("output_ids") is not None:
        return list(expect["output_ids"])
    text = expect["output_text"]
    return [] if text is None else model.tokenizer.encode_with_markers(text)


def tool_history(calls: int, user: str) -> list[dict[str, Any]]:
    """A conversation of `calls` earlier get_weather calls, each answered: what a second turn
    whose model may restart the call index follows."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": user}]
    for n in range(calls):
        call_id = f"functions.get_weather:{n}"
        function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": call_id, "function": function}],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": "sunny"})
    return messages
