"""Prompt datasets: a local JSONL file or a Hugging Face dataset -> OpenAI chat prompts.

`load_prompts(cfg.dataset)` returns a `PromptSet`, an iterable of `Prompt` in a deterministic
order. Rows that cannot become a prompt are skipped and counted in `PromptSet.skipped`
(reason code -> count), never fatal. Which fields hold what is data in `conf/dataset/*.yaml`
(`mapping:`); this module knows only a few generic row shapes.

Why about 600 lines: every row shape (JSONL, Hub conversations, single turns, tools) goes
through one cleaning path that decides what becomes a prompt and what is skipped with which
reason; split apart, the skip reasons would drift.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_pipe.core.plain import plain
from kimi_pipe.errors import ConfigError, InputError, MissingFile

log = logging.getLogger(__name__)

# What a mandatory setting that was never given reads as in a composed config node.
MISSING = "???"

ROLES = frozenset({"system", "user", "assistant", "tool"})
# The model answers after one of these; a prompt ending elsewhere has nothing to answer.
ANSWERABLE_LAST_ROLES = frozenset({"user", "tool"})
EXAMPLES_PER_REASON = 5


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict]  # OpenAI chat messages
    tools: list[dict] | None  # OpenAI tools (type=function), None when the row has none


class SkipRow(Exception):
    """A row that cannot become a prompt; `reason` is a short stable code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# A source yields (fallback id, raw row); a converter turns a raw row into a Prompt.
RowSource = Callable[[], Iterable[tuple[str, Any]]]
RowConverter = Callable[[str, Any], Prompt]


class PromptSet:
    """Deterministic iterable of prompts. `skipped` is refilled on every full iteration."""

    def __init__(
        self,
        name: str,
        source: RowSource,
        convert: RowConverter,
        limit: int | None = None,
    ) -> None:
        self.name = name
        self._source = source
        self._convert = convert
        self.limit = limit
        self.skipped: Counter[str] = Counter()
        # reason -> first few row ids, so a report can point at real rows.
        self.skipped_examples: dict[str, list[str]] = {}
        self._len: int | None = None

    def __iter__(self) -> Iterator[Prompt]:
        self.skipped = Counter()
        self.skipped_examples = {}
        seen: set[str] = set()
        count = 0
        if self.limit is not None and self.limit <= 0:
            return
        for fallback_id, row in self._source():
            try:
                prompt = self._convert(fallback_id, row)
                if prompt.id in seen:
                    raise SkipRow("duplicate_id", prompt.id)
            except SkipRow as skip:
                self._skip(skip.reason, fallback_id, str(skip))
                continue
            except RecursionError:  # a row nested too deeply to walk: that row, not the run
                self._skip("too_deeply_nested", fallback_id, "nesting too deep")
                continue
            seen.add(prompt.id)
            yield prompt
            count += 1
            if self.limit is not None and count >= self.limit:
                break
        self._len = count
        if self.skipped:
            log.warning(
                "dataset %s: %d prompts, skipped %d rows: %s",
                self.name,
                count,
                sum(self.skipped.values()),
                dict(self.skipped),
            )

    def __len__(self) -> int:
        """Exact number of prompts; costs one counting pass the first time (then cached)."""
        if self._len is None:
            for _ in self:
                pass
        assert self._len is not None
        return self._len

    def summary(self) -> dict[str, Any]:
        """What the last full pass yielded and skipped, for a run's summary.json."""
        return {
            "dataset": self.name,
            "prompts": self._len,
            "skipped": dict(self.skipped),
            "skipped_examples": {k: list(v) for k, v in self.skipped_examples.items()},
        }

    def _skip(self, reason: str, row_id: str, detail: str) -> None:
        self.skipped[reason] += 1
        examples = self.skipped_examples.setdefault(reason, [])
        if len(examples) < EXAMPLES_PER_REASON:
            examples.append(row_id)
        log.debug("dataset %s: skipped row %s (%s)", self.name, row_id, detail)


# ---------------------------------------------------------------------------------------
# Message / tool validation shared by every source.


def normalize_content(content: Any) -> str | None:
    """OpenAI content: a string, None, or a list of text parts (joined, as OpenAI does)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise SkipRow("non_text_content")
            text = part.get("text")
            if not isinstance(text, str):
                raise SkipRow("invalid_content")
            texts.append(text)
        return "".join(texts)
    raise SkipRow("invalid_content", type(content).__name__)


def _check_tool_calls(tool_calls: Any) -> None:
    if not isinstance(tool_calls, list) or not tool_calls:
        raise SkipRow("invalid_tool_calls", "not a non-empty list")
    for call in tool_calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise SkipRow("invalid_tool_calls", "missing function.name")
        if not isinstance(function.get("arguments"), str | dict):
            raise SkipRow("invalid_tool_calls", "arguments must be a JSON string or object")


def clean_messages(messages: Any) -> list[dict]:
    """Validate OpenAI chat messages; return plain-dict copies with normalized content."""
    if not isinstance(messages, list) or not messages:
        raise SkipRow("invalid_messages", "not a non-empty list")
    out: list[dict] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise SkipRow("invalid_messages", "message is not an object")
        role = message.get("role")
        if role not in ROLES:
            raise SkipRow("invalid_role", repr(role))
        msg = dict(message)
        msg["content"] = normalize_content(msg.get("content"))
        if msg.get("tool_calls") is None:
            msg.pop("tool_calls", None)
        else:
            if role != "assistant":
                raise SkipRow("invalid_tool_calls", f"tool_calls on a {role} message")
            _check_tool_calls(msg["tool_calls"])
        if msg["content"] is None and "tool_calls" not in msg:
            raise SkipRow("missing_content", f"{role} message without content")
        out.append(msg)
    return out


def _parse_json_text(value: Any, code: str) -> Any:
    """Datasets store JSON fields as text or as objects: parse text, blank text is None."""
    if not isinstance(value, str):
        return value
    if not value.strip():
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise SkipRow(code, f"not JSON: {exc}") from None


def clean_tools(tools: Any) -> list[dict] | None:
    """Validate OpenAI tools; a JSON string is parsed, an empty list means no tools."""
    tools = _parse_json_text(tools, "invalid_tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise SkipRow("invalid_tools", "not a list")
    if not tools:
        return None
    for tool in tools:
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise SkipRow("invalid_tools", "each tool must be {type: function, function: {...}}")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise SkipRow("invalid_tools", "missing function.name")
        params = function.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise SkipRow("invalid_tools", "function.parameters must be an object")
    return [dict(tool) for tool in tools]


def finish_messages(messages: list[dict], drop_trailing_assistant: bool) -> list[dict]:
    """Drop the final assistant turn (the model answers it instead); the prompt must then
    end on a user or tool turn, otherwise there is nothing for the model to answer."""
    if drop_trailing_assistant and messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise SkipRow("no_turn_to_answer", "no messages left")
    last = messages[-1]["role"]
    if last not in ANSWERABLE_LAST_ROLES:
        raise SkipRow("no_turn_to_answer", f"ends with a {last} turn")
    return messages


def _make_id(value: Any, fallback: str) -> str:
    if value is None or value == "":
        return fallback
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise SkipRow("invalid_id", repr(value)[:80])
    return str(value)


# ---------------------------------------------------------------------------------------
# Local JSONL: one {"id", "messages", "tools"?} object per line.


def _cfg_get(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """Read an optional key; a mandatory value never given (`???`) reads as unset."""
    value = cfg.get(key, default)
    return default if value == MISSING else plain(value)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            if line_no == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 BOM (Windows editors)
            # Invalid UTF-8 becomes lone surrogates: the run replaces and flags them
            # instead of refusing the whole file for one bad byte.
            line = raw.decode("utf-8", errors="surrogateescape")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:  # e.g. a torn last line
                row = SkipRow("invalid_json", f"{path}:{line_no}: {exc}")
            except RecursionError:
                row = SkipRow("too_deeply_nested", f"{path}:{line_no}")
            yield f"line-{line_no}", row


def _jsonl_converter(drop_trailing_assistant: bool) -> RowConverter:
    def convert(fallback_id: str, row: Any) -> Prompt:
        if isinstance(row, SkipRow):
            raise row
        if not isinstance(row, dict):
            raise SkipRow("not_an_object")
        if "messages" not in row:
            raise SkipRow("missing_messages")
        messages = clean_messages(row["messages"])
        messages = finish_messages(messages, drop_trailing_assistant)
        return Prompt(_make_id(row.get("id"), fallback_id), messages, clean_tools(row.get("tools")))

    return convert


def jsonl_prompt_file(cfg: Mapping[str, Any]) -> Path:
    """`dataset.path` of a JSONL dataset: a file that holds at least one line, or a
    user-facing error naming it (checked before anything is bought)."""
    raw_path = _cfg_get(cfg, "path")
    if not raw_path:
        raise ConfigError(
            "dataset jsonl: `dataset.path` is required, e.g. "
            "`dataset=jsonl dataset.path=prompts.jsonl`"
        )
    path = Path(str(raw_path)).expanduser()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise MissingFile(
            f"dataset jsonl: prompt file {what}: {path.resolve()} "
            f'(set dataset.path to a JSONL file of {{"id", "messages", "tools"?}} records)'
        )
    with path.open("rb") as handle:
        if not any(line.strip() for line in handle):
            raise InputError(f"dataset jsonl: prompt file {path.resolve()} is empty")
    return path


def _limit(cfg: Mapping[str, Any], key: str) -> int | None:
    value = _cfg_get(cfg, key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"dataset.{key}={value!r}: give a whole number of prompts (or null)")
    return value


def check_prompt_source(dataset_cfg: Mapping[str, Any]) -> None:
    """What can be checked of a dataset without loading it (a JSONL file: there, a file,
    not empty; the prompt cap a number): before a stage spends anything on it."""
    source = _cfg_get(dataset_cfg, "source", "jsonl")
    if source == "jsonl":
        jsonl_prompt_file(dataset_cfg)
    _limit(dataset_cfg, "limit" if source == "jsonl" else "num_samples")


def load_jsonl_prompts(cfg: Mapping[str, Any]) -> PromptSet:
    path = jsonl_prompt_file(cfg)
    return PromptSet(
        name=str(_cfg_get(cfg, "name", "jsonl")),
        source=lambda: _jsonl_rows(path),
        convert=_jsonl_converter(bool(_cfg_get(cfg, "drop_trailing_assistant", True))),
        limit=_limit(cfg, "limit"),
    )


# ---------------------------------------------------------------------------------------
# Hugging Face datasets: a declarative `mapping:` turns one row into messages (+ tools).

# OpenAI message keys copied from a turn when present and not null. Parquet turns of one
# list share a struct type, so a key missing from a turn reads back as None.
DEFAULT_COPY_FIELDS = ("tool_calls", "tool_call_id", "name", "reasoning_content")


def _field(row: Mapping[str, Any], key: str) -> Any:
    if key not in row:
        raise SkipRow("missing_field", key)
    return row[key]


def _optional_system(row: Mapping[str, Any], mapping: Mapping[str, Any]) -> list[dict]:
    key = mapping.get("system_field")
    if not key:
        return []
    system = row.get(key)
    if system is None or (isinstance(system, str) and not system.strip()):
        return []
    if not isinstance(system, str):
        raise SkipRow("invalid_content", f"{key} is not a string")
    return [{"role": "system", "content": system}]


def map_conversation(row: Mapping[str, Any], mapping: Mapping[str, Any]) -> list[dict]:
    """A list of turns (OpenAI, ShareGPT `from`/`value`, SWE-agent `role`/`text`, ...)."""
    turns = _field(row, mapping.get("messages_field", "messages"))
    if not isinstance(turns, list) or not turns:
        raise SkipRow("invalid_messages", "turn list is empty or not a list")
    role_field = mapping.get("role_field", "role")
    content_field = mapping.get("content_field", "content")
    role_map: Mapping[str, str] = mapping.get("role_map") or {}
    copy_fields = mapping.get("copy_fields", DEFAULT_COPY_FIELDS)
    messages = _optional_system(row, mapping)
    for turn in turns:
        if not isinstance(turn, Mapping):
            raise SkipRow("invalid_messages", "turn is not an object")
        raw_role = turn.get(role_field)
        role = role_map.get(str(raw_role), raw_role)
        if role not in ROLES:
            raise SkipRow("unknown_role", repr(raw_role))
        message = {"role": role, "content": turn.get(content_field)}
        for key in copy_fields:
            if turn.get(key) is not None:
                message[key] = turn[key]
        messages.append(message)
    return messages


def map_single_turn(row: Mapping[str, Any], mapping: Mapping[str, Any]) -> list[dict]:
    """One prompt string (plus an optional system string) per row."""
    prompt = _field(row, mapping.get("prompt_field", "prompt"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise SkipRow("empty_prompt")
    return [*_optional_system(row, mapping), {"role": "user", "content": prompt}]


MAPPING_KINDS: dict[str, Callable[[Mapping[str, Any], Mapping[str, Any]], list[dict]]] = {
    "conversation": map_conversation,
    "single_turn": map_single_turn,
}


def _param_map_schema(params: Mapping[str, Any], param_types: Mapping[str, str]) -> dict:
    """{"arg": {"type": "str, optional", "description", "default"}} -> a JSON schema.

    A type ending in ", optional" or a parameter with a default is not required; type
    names are looked up in `param_types` (first by full name, then by the name before
    `[`), an unknown type keeps only the description.
    """
    properties: dict[str, dict] = {}
    required: list[str] = []
    for arg, spec in params.items():
        if not isinstance(spec, Mapping):
            raise SkipRow("invalid_tools", f"parameter {arg!r} is not an object")
        raw_type = str(spec.get("type") or "").strip()
        optional = raw_type.endswith(", optional")
        base = raw_type.removesuffix(", optional").strip()
        prop: dict[str, Any] = {}
        json_type = param_types.get(base) or param_types.get(base.split("[", 1)[0])
        if json_type:
            prop["type"] = json_type
        if spec.get("description"):
            prop["description"] = spec["description"]
        if "default" in spec and spec["default"] not in (None, ""):
            prop["default"] = spec["default"]
        elif not optional:
            required.append(arg)
        properties[arg] = prop
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


TOOLS_FORMATS = ("openai", "function", "param_map")


def normalize_tools(raw: Any, mapping: Mapping[str, Any]) -> list[dict] | None:
    """Dataset tools -> OpenAI tools. `tools_format`: openai (as is), function (bare
    {name, description, parameters}), param_map (parameters as {arg: {type, ...}})."""
    raw = _parse_json_text(raw, "invalid_tools")
    if raw is None:
        return None
    fmt = mapping.get("tools_format", "openai")
    if fmt not in TOOLS_FORMATS:
        raise ValueError(f"unknown mapping.tools_format {fmt!r} (one of {TOOLS_FORMATS})")
    if fmt == "openai":
        return clean_tools(raw)
    if not isinstance(raw, list):
        raise SkipRow("invalid_tools", "not a list")
    tools = []
    for function in raw:
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise SkipRow("invalid_tools", "missing name")
        function = {k: v for k, v in function.items() if v is not None}
        if fmt == "param_map":
            params = function.get("parameters") or {}
            if not isinstance(params, Mapping):
                raise SkipRow("invalid_tools", "parameters is not an object")
            function["parameters"] = _param_map_schema(params, mapping.get("param_types") or {})
        tools.append({"type": "function", "function": function})
    return clean_tools(tools)


def _hf_converter(mapping: Mapping[str, Any], drop_trailing_assistant: bool) -> RowConverter:
    kind = mapping.get("kind")
    if kind not in MAPPING_KINDS:
        raise ValueError(f"unknown dataset mapping.kind {kind!r} (one of {sorted(MAPPING_KINDS)})")
    to_messages = MAPPING_KINDS[kind]
    id_field = mapping.get("id_field")
    tools_field = mapping.get("tools_field")
    if mapping.get("tools_format", "openai") not in TOOLS_FORMATS:
        raise ValueError(f"unknown mapping.tools_format {mapping['tools_format']!r}")

    def convert(fallback_id: str, row: Any) -> Prompt:
        messages = clean_messages(to_messages(row, mapping))
        messages = finish_messages(messages, drop_trailing_assistant)
        tools = normalize_tools(row.get(tools_field), mapping) if tools_field else None
        row_id = _make_id(row.get(id_field), fallback_id) if id_field else fallback_id
        return Prompt(row_id, messages, tools)

    return convert


DATA_FILE_BUILDERS = {
    ".parquet": "parquet",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".arrow": "arrow",
}


def _load_hf(cfg: Mapping[str, Any], name: str, streaming: bool) -> Any:
    """`datasets.load_dataset` for a Hub id (or a local dataset folder), or for local
    `data_files` (a path, list or {split: paths}; builder chosen by file extension)."""
    import datasets  # heavy import, only when a Hugging Face source is used

    split = _cfg_get(cfg, "split", "train")
    kwargs: dict[str, Any] = {
        "split": split,
        "streaming": streaming,
        "cache_dir": _cfg_get(cfg, "cache_dir"),
        "revision": _cfg_get(cfg, "revision"),
    }
    data_files = _cfg_get(cfg, "data_files")
    if data_files:
        first = data_files
        while not isinstance(first, str):
            first = next(iter(first.values() if isinstance(first, dict) else first))
        builder = _cfg_get(cfg, "data_format") or DATA_FILE_BUILDERS.get(Path(first).suffix)
        if builder is None:
            raise ValueError(f"dataset {name}: cannot tell the format of {first}; set data_format")
        kwargs.pop("revision")
        return datasets.load_dataset(builder, data_files=data_files, **kwargs)
    hf_id = _cfg_get(cfg, "hf_id")
    if not hf_id:
        raise ValueError(f"dataset {name}: set dataset.hf_id (or dataset.data_files)")
    hf_config = _cfg_get(cfg, "hf_config")
    try:
        return datasets.load_dataset(hf_id, hf_config, **kwargs)
    except Exception as exc:  # offline, gated, renamed, bad split: all need the same advice
        raise RuntimeError(
            f"dataset {name}: could not load Hugging Face dataset {hf_id!r} "
            f"(config {hf_config!r}, split {split!r}): {type(exc).__name__}: {exc}\n"
            "Fix: allow network access to huggingface.co (gated sets also need HF_TOKEN and "
            "accepted terms on the dataset page), or pre-download it into the cache on a "
            "connected machine and copy HF_HOME over (then set HF_DATASETS_OFFLINE=1), or use "
            "a local file: dataset=jsonl dataset.path=FILE."
        ) from exc


def _indexed_rows(ds: Any, seed: int | None, chunk: int = 256) -> Iterator[tuple[int, Any]]:
    """All rows of a map-style dataset as (original index, row), shuffled with `seed`
    exactly like `Dataset.shuffle(seed=seed)` (numpy default_rng permutation)."""
    import numpy as np  # optional dep

    n = len(ds)
    order = np.random.default_rng(seed).permutation(n) if seed is not None else np.arange(n)
    for start in range(0, n, chunk):
        indices = [int(i) for i in order[start : start + chunk]]
        yield from zip(indices, ds.select(indices), strict=True)


def load_hf_prompts(cfg: Mapping[str, Any]) -> PromptSet:
    name = str(_cfg_get(cfg, "name", "hf"))
    mapping = _cfg_get(cfg, "mapping") or {}
    convert = _hf_converter(mapping, bool(_cfg_get(cfg, "drop_trailing_assistant", True)))
    streaming = bool(_cfg_get(cfg, "streaming", False))
    seed = _cfg_get(cfg, "seed")
    split = _cfg_get(cfg, "split", "train")
    buffer_size = int(_cfg_get(cfg, "shuffle_buffer", 10_000))
    ds = _load_hf(cfg, name, streaming)  # fail now, not at the first iteration

    def rows() -> Iterator[tuple[str, Any]]:
        if streaming:
            stream = ds if seed is None else ds.shuffle(seed=seed, buffer_size=buffer_size)
            # Stream position, not a row index: stable for the same seed and buffer size.
            for position, row in enumerate(stream):
                yield f"{split}-s{position}", row
        else:
            for index, row in _indexed_rows(ds, seed):
                yield f"{split}-{index}", row

    return PromptSet(name=name, source=rows, convert=convert, limit=_limit(cfg, "num_samples"))


# ---------------------------------------------------------------------------------------

SOURCES: dict[str, Callable[[Mapping[str, Any]], PromptSet]] = {
    "jsonl": load_jsonl_prompts,
    "hf": load_hf_prompts,
}


def load_prompts(dataset_cfg: Mapping[str, Any]) -> PromptSet:
    """Build the prompt set described by a `conf/dataset/*.yaml` config."""
    source = _cfg_get(dataset_cfg, "source", "jsonl")
    if source not in SOURCES:
        raise ConfigError(
            f"dataset {dataset_cfg.get('name', '?')}: unknown source {source!r} "
            f"(one of {sorted(SOURCES)})"
        )
    return SOURCES[source](dataset_cfg)
