"""Render the `tools` of an OpenAI chat request the way a model's chat template does.

Two styles, chosen by data in `conf/model/*.yaml`:

- `typescript`: Moonshot's Kimi K2.5 declaration (`tool_declaration_ts.py`, shipped with the
  model). The tokenizer deep-sorts every dict of `tools` by key, then turns the function tools
  into a TypeScript-like namespace. When the encoder cannot express a schema (it raises), or
  finds no function tool, the K2.5 chat template falls back to
  `tools | tojson(separators=(',', ':'))` of the sorted tools; `render_tools` does the same.
- `json_lines`: ChatML-family templates (Qwen3, Qwen3.5/3.6): one `tool | tojson` per line,
  i.e. `json.dumps(tool, ensure_ascii=False)`. The text around the lines (`<tools>` header,
  instructions) is model data and belongs to the model config, not here.
- `json_compact`: `json.dumps(tools, ensure_ascii=False, separators=(",", ":"))` of the tools
  as given (the K2/K2-Thinking style; call `deep_sort` first where the tokenizer sorts).

All functions are pure. Behaviour is re-implemented from reading Moonshot's encoder, including
its quirks (Python `str()` of enum values and constraint values, `repr()` of numeric
defaults, lines of a self-referencing root in insertion order); see docs/tool_declarations.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kimi_pipe.errors import InputError

STYLES: tuple[str, ...] = ("typescript", "json_lines", "json_compact")

_INDENT = "  "
_FIELD_SEP = ",\n"
# Keys shown as `// key: value` comments, per scalar kind (all others are dropped).
_SCALAR_CONSTRAINTS: dict[str, tuple[str, ...]] = {
    "string": ("maxLength", "minLength", "pattern"),
    "number": ("maximum", "minimum"),
    "integer": ("maximum", "minimum"),
}
_ARRAY_CONSTRAINTS = ("minItems", "maxItems")
# `type: [..]` members as TypeScript; any other member makes the encoder fail.
_UNION_MEMBERS = {
    "string": "string",
    "number": "number",
    "integer": "number",
    "boolean": "boolean",
    "null": "null",
    "object": "{}",
    "array": "Array<any>",
}


class ToolDeclarationError(InputError):
    """Moonshot's encoder cannot express these tools; the chat template falls back to JSON."""


@dataclass(frozen=True)
class ToolDeclaration:
    """Rendered declaration text and, for `typescript`, why the JSON fallback was used."""

    text: str
    fallback_reason: str | None = None


def deep_sort(value: Any) -> Any:
    """Copy of `value` with every dict's keys sorted, recursively (lists keep their order)."""
    if isinstance(value, Mapping):
        return {key: deep_sort(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [deep_sort(item) for item in value]
    return value


def render_tools(tools: Sequence[Any], style: str) -> str:
    """Declaration text for `tools` in `style` ("" for no tools: the caller omits the block)."""
    return declare_tools(tools, style).text


def declare_tools(tools: Sequence[Any], style: str) -> ToolDeclaration:
    """Like `render_tools`, also saying whether the `typescript` style fell back to JSON."""
    if style not in STYLES:
        raise ValueError(f"unknown tool declaration style {style!r}; expected one of {STYLES}")
    if not tools:
        return ToolDeclaration("")
    if style == "json_lines":
        return ToolDeclaration("\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
    if style == "json_compact":
        return ToolDeclaration(_compact_json(tools))
    ordered = deep_sort(list(tools))
    try:
        text = encode_typescript(ordered)
    except ToolDeclarationError as err:
        return ToolDeclaration(_compact_json(ordered), fallback_reason=str(err))
    if not text:
        return ToolDeclaration(_compact_json(ordered), fallback_reason="no function tools")
    return ToolDeclaration(text)


def encode_typescript(tools: Sequence[Any]) -> str:
    """Moonshot's TypeScript-style declaration of the function tools, in the order given.

    Returns "" when there is no function tool. Raises ToolDeclarationError wherever Moonshot's
    encoder raises (any Python exception there makes the tokenizer use the JSON fallback).
    Does not sort: `render_tools` deep-sorts first, as the K2.5 tokenizer does.
    """
    try:
        functions = [_encode_function(tool["function"]) for tool in _function_tools(tools)]
    except Exception as err:  # the K2.5 tokenizer falls back to JSON on any exception
        raise ToolDeclarationError(f"{type(err).__name__}: {err}") from err
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"


def as_vllm_tool_dicts(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`tools` as vLLM hands them to the chat template (`ChatCompletionToolsParam.model_dump()`).

    vLLM validates each tool into a pydantic model and dumps it: `type` first, then
    `function` with `name`, `description` and `parameters` (null when absent) in that order,
    extra keys after them. This changes `json_lines` text (key order, `"description": null`);
    it does not change the `typescript` text.
    """
    dumped: list[dict[str, Any]] = []
    for tool in tools:
        function = dict(tool.get("function") or {})
        head = {key: function.pop(key, None) for key in ("name", "description", "parameters")}
        extra = {key: value for key, value in tool.items() if key not in ("type", "function")}
        dumped.append({"type": tool.get("type", "function"), "function": head | function} | extra)
    return dumped


def _compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _function_tools(tools: Sequence[Any]) -> list[Mapping[str, Any]]:
    """Tools of type "function" with a non-empty `function`; others are skipped silently."""
    kept: list[Mapping[str, Any]] = []
    for tool in tools:
        if tool.get("type") == "function" and tool.get("function", {}):
            kept.append(tool)
    return kept


# --- schema model: parsed first (definitions are registered while parsing), rendered after ---


@dataclass
class _Registry:
    """`$defs` seen so far (in first-seen order) and whether `#` (the root) is referenced."""

    definitions: dict[str, Any] = field(default_factory=dict)
    self_ref: bool = False


@dataclass
class _Node:
    description: Any = ""
    constraints: dict[str, Any] = field(default_factory=dict)

    def render(self, indent: str) -> str:
        raise NotImplementedError

    def docstring(self, indent: str) -> str:
        """Comment lines shown above a field (or an array item) of this type."""
        lines: list[str] = []
        if self.description:
            lines.append(_comment(self.description, indent))
        if self.constraints:
            # str() of each value, as Moonshot's f-string does (so True, 1.0, 'a' unquoted).
            pairs = ", ".join(f"{key}: {value}" for key, value in sorted(self.constraints.items()))
            lines.append(f"{indent}// {pairs}")
        return "".join(line + "\n" for line in lines)


@dataclass
class _Scalar(_Node):
    kind: Any = "any"

    def render(self, indent: str) -> str:
        return "number" if self.kind == "integer" else str(self.kind)

    def strict_text(self, indent: str) -> str:
        """Text where Moonshot joins or concatenates: a non-string `type` is an error there."""
        if not isinstance(self.kind, str):
            raise TypeError(f"type {self.kind!r} is not a string")
        return self.render(indent)


@dataclass
class _Field:
    name: str
    node: _Node
    optional: bool
    default: Any = None

    def render(self, indent: str) -> str:
        text = self.node.docstring(indent)
        if self.default is not None:
            plain = isinstance(self.default, (int, float, bool))
            shown = repr(self.default) if plain else json.dumps(self.default, ensure_ascii=False)
            text += f"{indent}// Default: {shown}\n"
        mark = "?" if self.optional else ""
        return f"{text}{indent}{self.name}{mark}: {self.node.render(indent)}"


@dataclass
class _Object(_Node):
    fields: list[_Field] = field(default_factory=list)
    extra: Any = None  # additionalProperties: None (absent), True, False, a _Node, or invalid

    def render(self, indent: str) -> str:
        inner = indent + _INDENT
        required = sorted((f for f in self.fields if not f.optional), key=lambda f: f.name)
        optional = sorted((f for f in self.fields if f.optional), key=lambda f: f.name)
        parts = [f.render(inner) for f in required + optional]
        if self.extra is not None:
            parts.append(f"{inner}[k: string]: {self._extra_text(inner)}")
        if not parts:
            return "{}"
        return "{\n" + _FIELD_SEP.join(parts) + "\n" + indent + "}"

    def _extra_text(self, inner: str) -> str:
        if self.extra is True:
            return "any"
        if self.extra is False:
            return "never"
        if isinstance(self.extra, _Node):
            return self.extra.render(inner)
        raise ValueError(f"unknown additionalProperties: {self.extra!r}")


@dataclass
class _Array(_Node):
    item: _Node = field(default_factory=_Scalar)

    def render(self, indent: str) -> str:
        inner = indent + _INDENT
        notes = self.item.docstring(inner)
        if not notes:
            return f"Array<{self.item.render(indent)}>"
        return "Array<\n" + notes + inner + _strict(self.item, inner) + "\n" + indent + ">"


@dataclass
class _Enum(_Node):
    values: Any = ()

    def render(self, indent: str) -> str:
        # Strings quoted as-is (no escaping); anything else via str(): None, True, 1.5.
        return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in self.values)


@dataclass
class _AnyOf(_Node):
    branches: list[_Node] = field(default_factory=list)

    def render(self, indent: str) -> str:
        return " | ".join(_strict(branch, indent) for branch in self.branches)


@dataclass
class _Union(_Node):
    members: list[str] = field(default_factory=list)

    def render(self, indent: str) -> str:
        return " | ".join(self.members)


@dataclass
class _Ref(_Node):
    name: str = ""

    def render(self, indent: str) -> str:
        return self.name


def _strict(node: _Node, indent: str) -> str:
    return node.strict_text(indent) if isinstance(node, _Scalar) else node.render(indent)


def _comment(text: str, indent: str) -> str:
    """Each line as `// line`; empty lines stay empty (no indent, no slashes)."""
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


def _base(schema: Mapping[str, Any], allowed: Sequence[str] = ()) -> dict[str, Any]:
    return {
        "description": schema.get("description", ""),
        "constraints": {k: v for k, v in schema.items() if k in allowed},
    }


def _parse(schema: Any, registry: _Registry) -> _Node:
    """One JSON schema node, in Moonshot's precedence: $ref, anyOf, enum, type, {}."""
    if isinstance(schema, bool):
        return _Scalar(kind="any" if schema else "null")
    if not isinstance(schema, Mapping):
        raise ValueError(f"invalid JSON schema: {schema!r}")
    if "$ref" in schema:
        return _parse_ref(schema, registry)
    if "anyOf" in schema:
        branches = [_parse(branch, registry) for branch in schema["anyOf"]]
        return _AnyOf(**_base(schema), branches=branches)
    if "enum" in schema:
        return _parse_enum(schema)
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, list):
            return _Union(**_base(schema), members=[_UNION_MEMBERS[k] for k in kind])
        if kind == "object":
            return _parse_object(schema, registry)
        if kind == "array":
            items = schema.get("items")
            item = _parse(items, registry) if items else _Scalar()
            return _Array(**_base(schema, _ARRAY_CONSTRAINTS), item=item)
        allowed = _SCALAR_CONSTRAINTS.get(kind, ()) if isinstance(kind, str) else ()
        return _Scalar(**_base(schema, allowed), kind=kind)
    if not schema:
        return _Scalar()
    # Schemas Moonshot cannot express: oneOf, allOf, const, not, description-only, ...
    raise ValueError(f"unsupported JSON schema keys {sorted(schema)}")


def _parse_object(schema: Mapping[str, Any], registry: _Registry) -> _Object:
    node = _Object(**_base(schema))
    if not schema:
        return node
    definitions = schema.get("$defs")
    if "$defs" in schema and definitions:
        for name, definition in definitions.items():
            registry.definitions[name] = definition
    extra = schema.get("additionalProperties")
    node.extra = _parse(extra, registry) if isinstance(extra, dict) else extra
    if "properties" not in schema:
        return node
    properties = schema["properties"]
    optional = set(properties.keys()) - set(schema.get("required", []))
    for name, prop in properties.items():
        default = prop.get("default") if isinstance(prop, dict) else None
        node.fields.append(_Field(name, _parse(prop, registry), name in optional, default))
    return node


def _parse_enum(schema: Mapping[str, Any]) -> _Enum:
    values = schema["enum"]
    if "type" in schema:
        kind = _enum_kind(schema["type"])
        for value in values:
            if value is not None and not _enum_value_fits(value, kind):
                raise ValueError(f"enum value {value!r} does not match type {kind!r}")
    return _Enum(**_base(schema), values=values)


def _enum_kind(kind: Any) -> Any:
    """The declared type of an enum; a list may only be one type, or one type plus null."""
    if not isinstance(kind, list):
        return kind
    if len(kind) == 1:
        return kind[0]
    if len(kind) == 2 and "null" in kind:
        return kind[0] if kind[0] != "null" else kind[1]
    raise ValueError(f"enum type {kind!r} is not supported")


def _enum_value_fits(value: Any, kind: Any) -> bool:
    checks: dict[str, tuple[type, ...]] = {
        "string": (str,),
        "number": (int, float),
        "integer": (int,),
        "boolean": (bool,),
    }
    if not isinstance(kind, str) or kind not in checks:
        return True
    return isinstance(value, checks[kind])


def _parse_ref(schema: Mapping[str, Any], registry: _Registry) -> _Ref:
    ref = schema["$ref"]
    if ref == "#":
        registry.self_ref = True
        return _Ref(**_base(schema), name="parameters")
    if not ref.startswith("#/$defs/"):
        raise ValueError(f"unsupported $ref {ref!r} (only '#' and '#/$defs/NAME')")
    name = ref.split("/")[-1]
    if name not in registry.definitions:
        # Only definitions registered before this point count (Moonshot resolves while parsing).
        raise ValueError(f"$ref {ref!r} not found")
    if registry.definitions[name].get("$self_ref", False):
        name = "parameters"
    return _Ref(**_base(schema), name=name)


def _encode_function(function: Mapping[str, Any]) -> str:
    registry = _Registry()
    root = _parse_object(function.get("parameters") or {}, registry)
    interfaces: list[str] = []
    root_name = None
    if registry.self_ref:
        # The root becomes `interface parameters`, its fields in insertion order (not sorted,
        # not required-first) and without additionalProperties, as Moonshot renders it.
        root_name = "parameters"
        body = _FIELD_SEP.join(f.render(_INDENT) for f in root.fields)
        wrapped = "\n" + body + "\n" if body else ""
        interfaces.append("interface parameters {" + wrapped + "}")
    for name, definition in list(registry.definitions.items()):
        text = _parse(definition, registry).render("")
        about = definition.get("description", "")
        heading = _comment(about, "") + "\n" if about else ""
        interfaces.append(f"{heading}interface {name} {text}")
    name = function.get("name", "function")
    signature = root_name if root_name else root.render("")
    description = function.get("description")
    parts = [
        "\n".join(interfaces),
        (description and _comment(description, "")) or "",
        f"type {name} = (_: {signature}) => any;",
    ]
    return "\n".join(part for part in parts if part)
