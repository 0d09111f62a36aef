"""Tool declarations rendered as the model's own chat template does.

Where the expected text comes from is said at each case. No expectation below was produced by
running kimi_pipe: they are published outputs of Moonshot's encoder, or derived by hand from
reading its source (`tool_declaration_ts.py` shipped in moonshotai/Kimi-K2.5; the same file is
vendored in vllm and in thinking-machines-lab/tinker-cookbook
`tinker_cookbook/renderers/kimi_k2_5_tool_declaration_ts.py`).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.utils.chat_template_utils import render_jinja_template

from kimi_pipe.core.tool_declarations import (
    as_vllm_tool_dicts,
    declare_tools,
    deep_sort,
    encode_typescript,
    render_tools,
)

HEAD = "# Tools\n\n## functions\nnamespace functions {\n"
TAIL = "}\n"


def _fn(name: str, parameters: Any = None, description: str | None = None) -> list[dict]:
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return [{"type": "function", "function": function}]


def _obj(properties: dict, required: list[str] | None = None, **extra: Any) -> dict:
    schema: dict[str, Any] = {"type": "object", "properties": properties, **extra}
    if required is not None:
        schema["required"] = required
    return schema


# Golden pairs written by Moonshot's own encoder: lightseekorg/smg, commit 65afd0dc5,
# crates/tokenizer/tests/fixtures/kimi_k25/{schemas,expected}/NN_*.{json,txt}; their
# regenerate.py imports `encode_tools_to_typescript_style` from a Kimi-K2.5 snapshot and writes
# its output byte for byte. Names below are the fixture file names.
MOONSHOT_GOLDEN: list[tuple[str, list[dict], str]] = [
    (
        "01_simple_string",
        _fn(
            "echo",
            _obj({"text": {"type": "string"}}, ["text"]),
            "Echo a string back to the caller.",
        ),
        HEAD + "// Echo a string back to the caller.\n"
        "type echo = (_: {\n  text: string\n}) => any;\n" + TAIL,
    ),
    (
        "02_optional_number",
        _fn(
            "delay",
            _obj({"ms": {"type": "integer", "minimum": 0}, "reason": {"type": "string"}}, ["ms"]),
            "Sleep for some milliseconds.",
        ),
        HEAD + "// Sleep for some milliseconds.\ntype delay = (_: {\n  // minimum: 0\n"
        "  ms: number,\n  reason?: string\n}) => any;\n" + TAIL,
    ),
    (
        "03_nested_object",
        _fn(
            "create_user",
            _obj(
                {"user": _obj({"name": {"type": "string"}, "age": {"type": "integer"}}, ["name"])},
                ["user"],
            ),
            "Create a new user record.",
        ),
        HEAD + "// Create a new user record.\ntype create_user = (_: {\n  user: {\n"
        "    name: string,\n    age?: number\n  }\n}) => any;\n" + TAIL,
    ),
    (
        "04_array_of_strings",
        _fn(
            "tag_items",
            _obj({"tags": {"type": "array", "items": {"type": "string"}}}, ["tags"]),
            "Apply tags.",
        ),
        HEAD + "// Apply tags.\ntype tag_items = (_: {\n  tags: Array<string>\n}) => any;\n" + TAIL,
    ),
    (
        "05_two_tools",
        _fn("ping", _obj({})) + _fn("pong", _obj({})),
        HEAD + "type ping = (_: {}) => any;\ntype pong = (_: {}) => any;\n" + TAIL,
    ),
    (
        "06_enum",
        _fn("set_status", _obj({"status": {"enum": ["active", "paused", "done"]}}, ["status"])),
        HEAD
        + 'type set_status = (_: {\n  status: "active" | "paused" | "done"\n}) => any;\n'
        + TAIL,
    ),
    (
        "07_anyof",
        _fn("set_value", _obj({"v": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}, ["v"])),
        HEAD + "type set_value = (_: {\n  v: string | number\n}) => any;\n" + TAIL,
    ),
    (
        "08_type_list",
        _fn("store", _obj({"x": {"type": ["string", "null"]}}, ["x"])),
        HEAD + "type store = (_: {\n  x: string | null\n}) => any;\n" + TAIL,
    ),
    (
        "09_ref_local",
        _fn(
            "create_node",
            {
                "type": "object",
                "$defs": {
                    "Node": _obj({"id": {"type": "string"}, "label": {"type": "string"}}, ["id"])
                },
                "properties": {"node": {"$ref": "#/$defs/Node"}},
                "required": ["node"],
            },
        ),
        HEAD + "interface Node {\n  id: string,\n  label?: string\n}\ntype create_node = (_: {\n"
        "  node: Node\n}) => any;\n" + TAIL,
    ),
    (
        "11_multiline_description",
        _fn(
            "annotate",
            _obj({"text": {"type": "string", "description": "The text\nto annotate."}}, ["text"]),
            "Annotate the input.\nSupports multiple\nlines.",
        ),
        HEAD + "// Annotate the input.\n// Supports multiple\n// lines.\ntype annotate = (_: {\n"
        "  // The text\n  // to annotate.\n  text: string\n}) => any;\n" + TAIL,
    ),
    (
        "12_unicode",
        _fn("translate", _obj({"text": {"type": "string"}}, ["text"]), "翻译 text into 中文."),
        HEAD
        + "// 翻译 text into 中文.\ntype translate = (_: {\n  text: string\n}) => any;\n"
        + TAIL,
    ),
    (
        "13_empty_params",
        _fn("noop", _obj({})),
        HEAD + "type noop = (_: {}) => any;\n" + TAIL,
    ),
    (
        "14_unknown_type",
        _fn("weird", _obj({"x": {"type": "uuid"}}, ["x"])),
        HEAD + "type weird = (_: {\n  x: uuid\n}) => any;\n" + TAIL,
    ),
]


@pytest.mark.parametrize(
    ("tools", "expected"),
    [(tools, expected) for _, tools, expected in MOONSHOT_GOLDEN],
    ids=[name for name, _, _ in MOONSHOT_GOLDEN],
)
def test_typescript_matches_moonshot_golden_output(tools: list[dict], expected: str) -> None:
    assert encode_typescript(tools) == expected
    # The K2.5 tokenizer deep-sorts first; none of these cases depends on key order.
    assert render_tools(tools, "typescript") == expected


# Derived by hand from the encoder's source; each comment names the rule that gives the text.
HAND_DERIVED: list[tuple[str, list[dict], str]] = [
    (
        # Field comments: description, then constraints sorted by key as `key: str(value)` (only
        # minLength/maxLength/pattern for strings, minimum/maximum for numbers; `format` and
        # `exclusiveMinimum` are dropped), then `Default: repr(v)` for int/float/bool and
        # json.dumps(v) otherwise. Required fields first, each group sorted by name.
        "comments_constraints_defaults",
        _fn(
            "search",
            _obj(
                {
                    "query": {
                        "type": "string",
                        "description": "What to look for",
                        "minLength": 1,
                        "pattern": "^[a-z]+$",
                        "format": "email",
                    },
                    "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
                    "exact": {"type": "boolean", "default": True},
                    "lang": {"type": "string", "default": "en"},
                    "ratio": {"type": "number", "default": 0.5, "exclusiveMinimum": 0},
                },
                ["query"],
            ),
        ),
        HEAD + "type search = (_: {\n  // What to look for\n  // minLength: 1, pattern: ^[a-z]+$\n"
        '  query: string,\n  // Default: True\n  exact?: boolean,\n  // Default: "en"\n'
        "  lang?: string,\n  // maximum: 50, minimum: 1\n  // Default: 10\n  limit?: number,\n"
        "  // Default: 0.5\n  ratio?: number\n}) => any;\n" + TAIL,
    ),
    (
        # Arrays: no `items` -> Array<any>; an item with comments is written on its own lines
        # (`Array<\n` ... `\n>`), an item without stays inline; minItems/maxItems are comments
        # of the array field itself.
        "arrays",
        _fn(
            "batch",
            _obj(
                {
                    "ids": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0},
                        "minItems": 1,
                        "description": "Row ids",
                    },
                    "rows": {"type": "array", "items": _obj({"k": {"type": "string"}}, ["k"])},
                    "any": {"type": "array"},
                },
                ["ids", "rows", "any"],
            ),
        ),
        HEAD + "type batch = (_: {\n  any: Array<any>,\n  // Row ids\n  // minItems: 1\n"
        "  ids: Array<\n    // minimum: 0\n    number\n  >,\n  rows: Array<{\n    k: string\n"
        "  }>\n}) => any;\n" + TAIL,
    ),
    (
        # Enum members: strings in double quotes, everything else through Python str():
        # null -> None, true -> True. A [type, "null"] type list is allowed for an enum.
        "enum_literals",
        _fn(
            "pick",
            _obj(
                {
                    "level": {"type": ["integer", "null"], "enum": [1, 2, None]},
                    "flag": {"enum": [True, False]},
                    "mode": {"type": "string", "enum": ["fast", "slow"], "description": "Speed"},
                },
                ["level"],
            ),
        ),
        HEAD + "type pick = (_: {\n  level: 1 | 2 | None,\n  flag?: True | False,\n  // Speed\n"
        '  mode?: "fast" | "slow"\n}) => any;\n' + TAIL,
    ),
    (
        # additionalProperties: schema -> its type, true -> any, false -> never; written as
        # the last line of the object, after the named fields.
        "additional_properties",
        _fn(
            "tag",
            _obj(
                {
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "strict": _obj({"a": {"type": "number"}}, additionalProperties=False),
                    "free": {"type": "object", "additionalProperties": True},
                },
                ["labels"],
            ),
        ),
        HEAD + "type tag = (_: {\n  labels: {\n    [k: string]: string\n  },\n  free?: {\n"
        "    [k: string]: any\n  },\n  strict?: {\n    a?: number,\n    [k: string]: never\n"
        "  }\n}) => any;\n" + TAIL,
    ),
    (
        # `$ref: "#"` makes the root an `interface parameters`, whose fields keep insertion
        # order (here alphabetical after the tokenizer's deep sort), NOT required-first.
        "self_reference",
        _fn(
            "tree",
            _obj(
                {
                    "value": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#"}},
                },
                ["value"],
            ),
            "A tree node",
        ),
        HEAD + "interface parameters {\n  children?: Array<parameters>,\n  value: string\n}\n"
        "// A tree node\ntype tree = (_: parameters) => any;\n" + TAIL,
    ),
    (
        # $defs become interfaces before the function, in (deep-sorted) key order, each led by
        # its description; a non-object definition is written as `interface NAME <type>`. A
        # description next to a $ref is a comment of the field.
        "defs_interfaces",
        _fn(
            "move",
            _obj(
                {
                    "to": {"$ref": "#/$defs/Point", "description": "Target"},
                    "color": {"$ref": "#/$defs/Color"},
                },
                ["to"],
                **{
                    "$defs": {
                        "Point": _obj(
                            {"x": {"type": "number"}, "y": {"type": "number"}},
                            ["x", "y"],
                            description="A point",
                        ),
                        "Color": {"enum": ["red", "blue"]},
                    }
                },
            ),
        ),
        HEAD + 'interface Color "red" | "blue"\n// A point\ninterface Point {\n  x: number,\n'
        "  y: number\n}\ntype move = (_: {\n  // Target\n  to: Point,\n  color?: Color\n"
        "}) => any;\n" + TAIL,
    ),
    (
        # Description lines: an empty line stays empty (no `//`).
        "blank_description_line",
        _fn("note", _obj({}), "First\n\nThird"),
        HEAD + "// First\n\n// Third\ntype note = (_: {}) => any;\n" + TAIL,
    ),
    (
        # No `parameters` at all: `function.get("parameters") or {}` -> empty object.
        "no_parameters",
        _fn("now"),
        HEAD + "type now = (_: {}) => any;\n" + TAIL,
    ),
]


@pytest.mark.parametrize(
    ("tools", "expected"),
    [(tools, expected) for _, tools, expected in HAND_DERIVED],
    ids=[name for name, _, _ in HAND_DERIVED],
)
def test_typescript_follows_moonshot_rules(tools: list[dict], expected: str) -> None:
    declaration = declare_tools(tools, "typescript")
    assert declaration.fallback_reason is None
    assert declaration.text == expected


# The tool_declare block of moonshotai/Kimi-K2.5 chat_template.jinja, verbatim (vendored at
# lightseekorg/smg crates/tokenizer/tests/fixtures/kimi_k25/chat_template.jinja). The K2.5
# tokenizer's apply_chat_template deep-sorts `tools`, sets `tools_ts_str` from the encoder, and
# leaves it unset when the encoder raises.
KIMI_TOOL_BLOCK = """{%- if tools -%}
  {%- if tools_ts_str -%}
    <|im_system|>tool_declare<|im_middle|>{{ tools_ts_str }}<|im_end|>
  {%- else -%}
    <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
  {%- endif -%}
{%- endif -%}"""


def _kimi_template(tools: list[dict], tools_ts_str: str | None) -> str:
    extra = {} if tools_ts_str is None else {"tools_ts_str": tools_ts_str}
    rendered, _ = render_jinja_template(
        [[{"role": "user", "content": "hi"}]], tools=tools, chat_template=KIMI_TOOL_BLOCK, **extra
    )
    return rendered[0]


FALLBACKS: list[tuple[str, list[Any]]] = [
    # Schemas Moonshot's parser rejects (ValueError), so the template writes compact JSON.
    ("one_of", _fn("f", _obj({"x": {"oneOf": [{"type": "string"}, {"type": "null"}]}}))),
    ("description_only", _fn("f", _obj({"x": {"description": "anything goes"}}))),
    (
        "definitions_ref",
        _fn("f", _obj({"x": {"$ref": "#/definitions/A"}}, definitions={"A": {"type": "string"}})),
    ),
    ("enum_type_mismatch", _fn("f", _obj({"x": {"type": "string", "enum": [1]}}))),
    # No tool with type "function" (e.g. bare function dicts): the encoder returns "".
    ("bare_function", [{"name": "f", "parameters": _obj({"q": {"type": "string"}})}]),
]


@pytest.mark.parametrize("tools", [t for _, t in FALLBACKS], ids=[n for n, _ in FALLBACKS])
def test_unencodable_tools_fall_back_to_sorted_compact_json(tools: list[Any]) -> None:
    declaration = declare_tools(tools, "typescript")
    assert declaration.fallback_reason
    sorted_tools = deep_sort(tools)
    # Oracle: the real template block, rendered by transformers' own jinja environment.
    expected = _kimi_template(sorted_tools, None)
    block = f"<|im_system|>tool_declare<|im_middle|>{declaration.text}<|im_end|>"
    assert block == expected
    assert json.loads(declaration.text) == tools


def test_typescript_block_matches_kimi_template_framing() -> None:
    tools = MOONSHOT_GOLDEN[1][1]
    text = render_tools(tools, "typescript")
    expected = _kimi_template(deep_sort(tools), text)
    assert expected == f"<|im_system|>tool_declare<|im_middle|>{text}<|im_end|>"


def test_typescript_sorts_keys_like_the_k25_tokenizer() -> None:
    # Interfaces follow $defs key order, which the tokenizer's deep sort makes alphabetical;
    # the encoder alone keeps the order it is given.
    defs = {"Zeta": {"type": "string"}, "Alpha": {"type": "number"}}
    tools = _fn(
        "f",
        _obj({"a": {"$ref": "#/$defs/Alpha"}, "z": {"$ref": "#/$defs/Zeta"}}, **{"$defs": defs}),
    )
    body = "type f = (_: {\n  a?: Alpha,\n  z?: Zeta\n}) => any;\n"
    assert render_tools(tools, "typescript") == (
        HEAD + "interface Alpha number\ninterface Zeta string\n" + body + TAIL
    )
    assert encode_typescript(tools) == (
        HEAD + "interface Zeta string\ninterface Alpha number\n" + body + TAIL
    )


_JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5))
_JSON = st.recursive(
    _JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=10,
)


def _shuffled(value: Any, rnd: Any) -> Any:
    if isinstance(value, dict):
        keys = list(value)
        rnd.shuffle(keys)
        return {k: _shuffled(value[k], rnd) for k in keys}
    if isinstance(value, list):
        return [_shuffled(v, rnd) for v in value]
    return value


@settings(max_examples=60, deadline=None)
@given(properties=st.dictionaries(st.sampled_from("abcdef"), _JSON, max_size=4), rnd=st.randoms())
def test_typescript_output_does_not_depend_on_key_order(properties: dict, rnd: Any) -> None:
    tools = _fn("f", {"type": "object", "properties": properties, "required": ["a"]}, "d")
    assert render_tools(tools, "typescript") == render_tools(_shuffled(tools, rnd), "typescript")


# The tools part of Qwen/Qwen3.5 chat_template.jinja, verbatim up to the system message (copy
# at HermestoAizales/llama.cpp models/templates/Qwen3.5-4B.jinja; the Qwen3.6 template in
# llama-cpp-python's Qwen35 handler has the same block).
QWEN35_TOOL_BLOCK = r"""{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
{%- endif %}"""  # noqa: E501

# The text around the json_lines body, as proposed for conf/model/qwen3_5.yaml.
QWEN35_TOOLS_BEFORE = "# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
QWEN35_TOOLS_AFTER = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
    "value_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is "
    "no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>"
)

QWEN_TOOLS = _fn(
    "get_weather",
    _obj({"city": {"type": "string", "description": "城市, e.g. Zürich"}}, ["city"]),
    "Weather now",
) + [{"type": "function", "function": {"parameters": {"type": "object"}, "name": "ping"}}]


def test_json_lines_matches_qwen35_template() -> None:
    rendered, _ = render_jinja_template(
        [[{"role": "user", "content": "hi"}]], tools=QWEN_TOOLS, chat_template=QWEN35_TOOL_BLOCK
    )
    body = render_tools(QWEN_TOOLS, "json_lines")
    assert rendered[0] == "<|im_start|>system\n" + QWEN35_TOOLS_BEFORE + body + QWEN35_TOOLS_AFTER


def test_json_lines_is_one_unescaped_json_object_per_tool_in_given_key_order() -> None:
    # `tool | tojson` in transformers is json.dumps(ensure_ascii=False) with default separators.
    assert render_tools(QWEN_TOOLS, "json_lines") == (
        '{"type": "function", "function": {"name": "get_weather", "description": "Weather now", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string", '
        '"description": "城市, e.g. Zürich"}}, "required": ["city"]}}}\n'
        '{"type": "function", "function": {"parameters": {"type": "object"}, "name": "ping"}}'
    )


def test_vllm_dump_orders_function_fields_and_fills_nulls() -> None:
    # vLLM FunctionDefinition fields: name, description=None, parameters=None (extra="allow"
    # keeps other keys after them); ChatCompletionToolsParam: type, function.
    tools = [
        {
            "function": {"parameters": {"type": "object"}, "name": "ping", "strict": True},
            "type": "function",
        }
    ]
    assert as_vllm_tool_dicts(tools) == [
        {
            "type": "function",
            "function": {
                "name": "ping",
                "description": None,
                "parameters": {"type": "object"},
                "strict": True,
            },
        }
    ]
    assert render_tools(as_vllm_tool_dicts(tools), "json_lines") == (
        '{"type": "function", "function": {"name": "ping", "description": null, '
        '"parameters": {"type": "object"}, "strict": true}}'
    )


def test_json_compact_keeps_given_order() -> None:
    tools = [{"type": "function", "function": {"name": "é", "parameters": {}}}]
    assert render_tools(tools, "json_compact") == (
        '[{"type":"function","function":{"name":"é","parameters":{}}}]'
    )


@pytest.mark.parametrize("style", ["typescript", "json_lines", "json_compact"])
def test_no_tools_means_no_declaration(style: str) -> None:
    assert render_tools([], style) == ""


def test_unknown_style_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown tool declaration style 'yaml'"):
        render_tools(_fn("f"), "yaml")
