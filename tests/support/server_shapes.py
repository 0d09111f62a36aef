"""The server-shape corpus (tests/fixtures/server_shapes, made by
tools/make_server_fixtures.py) and the profile declared for each record's stack: one answer
for the corpus's tests and the benchmarks that count it."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

from kimi_pipe.config import compose
from kimi_pipe.core.serving import ServingProfile, serving_profile

SHAPES = Path(__file__).resolve().parents[1] / "fixtures" / "server_shapes"
# The shipped profile of each stack version; vLLM 0.34.0 for files a reviewer makes.
PROFILE_OF_VERSION = {
    "0.15.1": "vllm_0_15",
    "0.33.0": "vllm_0_33",
    "0.34.0": "vllm_0_34",
    "0.5.14": "sglang_0_5_14",
    "0.5.23": "sglang_0_5_23",
}


@cache
def shipped_profile(name: str) -> ServingProfile:
    """A conf/serving profile, composed once per name."""
    return serving_profile(compose([f"serving={name}"]))


def declared_profile(record: dict[str, Any]) -> ServingProfile:
    """The shipped profile of the record's stack, with the deployment's settings."""
    overrides = {}
    if not record["settings"].get("spaces_between_special_tokens"):
        overrides["marker_spacing"] = "none"
    if record["settings"].get("ids") == "call_":
        overrides["tool_call_ids"] = "foreign"  # a gateway replaced the ids
    if record["settings"].get("stream") and record["version"] == "0.5.14":
        overrides["tool_call_ids"] = "conversation"
    if record["settings"].get("stream") and record["version"] == "0.15.1":
        # Streaming: the space before a marker leaves with the marker's delta; the tool
        # parser streams the model's own id.
        overrides["tool_call_ids"] = "model"
        if record["settings"].get("spaces_between_special_tokens"):
            overrides["marker_spacing"] = "leading"  # only non-streaming double-counts
    return replace(shipped_profile(PROFILE_OF_VERSION[record["version"]]), **overrides)
