"""What a stack that coerces tool arguments to the request's schema may have changed (pure).

The one coercing stack measured, vLLM 0.33's parser engine (`ParserEngine._fix_arg_types`,
tests/fixtures/server_shapes/vllm-0.33.0-*: `{"seconds": "30"}` -> `{"seconds": 30}`), parses
the arguments, turns a string into the schema's type (and a typed value into a string where
the schema says string), and only when it changed something writes the whole object again
with `json.dumps(..., ensure_ascii=False)`. So:
  - arguments in any other layout were not coerced: they are the model's text;
  - arguments in that layout may stand for the same object with coerced values written the
    other way, in the layout the model wrote them in, which the re-serialisation erased.

The readings listed here are that object with every subset of the coercible values undone,
in the two layouts the model writes arguments in: json.dumps's (`", "`, `": "`) and compact
(`","`, `":"`) (every parsed Kimi argument in tests/fixtures/wild is one of the two). The
list is complete where every coercible value is a top-level integer written in ASCII text;
a number, boolean or null has other spellings (`"1.50"` -> 1.5) and nested values are not
listed, so those leave it incomplete (a candidate set built on it stays open).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TYPED = frozenset({"integer", "number", "boolean"})
LAYOUTS = ((", ", ": "), (",", ":"))  # json.dumps's default, compact
MAX_COERCED_VALUES = 6  # 2**6 subsets x 2 layouts per call; more leaves the list incomplete


@dataclass(frozen=True)
class CoercionReadings:
    """The texts the model may have written for one call's arguments, the returned text
    first, and whether the list holds every such text under the rule above."""

    texts: tuple[str, ...]
    complete: bool


# vLLM's aliases for schema type names (tool_parsers/utils.py, `_TYPE_ALIASES`), in part.
_ALIASES = {"int": "integer", "float": "number", "double": "number", "bool": "boolean"}


def schema_types(schema: Any) -> set[str]:
    """The types a coercing stack reads from a property's schema: `type`, the kinds of its
    `enum` values, its `anyOf`/`oneOf`/`allOf` branches; none at all reads as a string."""
    if not isinstance(schema, Mapping):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    for name in kind if isinstance(kind, list) else [kind]:
        if isinstance(name, str):
            types.add(_ALIASES.get(name.strip().lower(), name.strip().lower()))
    enum = schema.get("enum")
    for value in enum if isinstance(enum, list) else []:
        types.add(_json_kind(value))
    for branch_field in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(branch_field)
        for branch in branches if isinstance(branches, list) else []:
            types |= schema_types(branch) if isinstance(branch, Mapping) else set()
    return types or {"string"}


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else "string"


def _scalar_of(text: str) -> Any:
    """The JSON scalar a string holds verbatim (`"30"` -> 30, `"null"` -> None), or the
    string itself."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if (value is None or isinstance(value, bool | int | float)) and json.dumps(value) == text:
        return value
    return text


def coerce_text(text: str, types: set[str]) -> Any:
    """What the stack makes of a string under these schema types (vLLM's
    `coerce_to_schema_type`: null, integer, number, boolean, object/array, string, in that
    order; else the JSON the text holds, else the text)."""
    for kind in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if kind not in types:
            continue
        if kind == "null" and text.lower() == "null":
            return None
        if kind == "string":
            return text
        if kind == "integer":
            try:
                return int(text)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if math.isfinite(number):
                return number if number != int(number) else int(number)
        if kind == "boolean" and text.lower().strip() in ("true", "1", "false", "0"):
            return text.lower().strip() in ("true", "1")
        if kind in ("object", "array"):
            try:
                return json.loads(text)
            except ValueError:
                continue
    try:
        return json.loads(text)
    except ValueError:
        return text


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _undone(value: Any, schema: Any) -> tuple[Any, bool] | None:
    """The value the model may have written before a coercion to `schema` produced `value`,
    and whether that is its only spelling; None where no coercion produces `value`.

    A typed value (integer, number, boolean) may have been a string: its canonical spelling
    is listed (`30` <- `"30"`), the only one for an integer of an integer-only schema (the
    stack's int() would also take `" 30"` or `"+30"`, which a model writing JSON for an
    integer field does not write); a number or boolean had others (`"2.0"`, `"True"`).
    A string may have been a JSON scalar the stack turned into its text (`"12345"` <-
    `12345` where the schema says string): exact for integers, booleans and null."""
    types = schema_types(schema)
    if isinstance(value, bool | int | float):
        text = json.dumps(value)
        if _same(coerce_text(text, types), value):
            exact = isinstance(value, int) and not isinstance(value, bool)
            return text, exact and types & TYPED == {"integer"}
        return None
    if isinstance(value, str):
        scalar = _scalar_of(value)
        if scalar is not value and _same(coerce_text(json.dumps(scalar), types), value):
            return scalar, not isinstance(scalar, float)
    return None


def _coercible(value: Any, schema: Any) -> bool:
    """The stack may have changed `value` or something inside it (only where the schema
    declares the property: the stack skips undeclared keys)."""
    if not isinstance(schema, Mapping):
        return False
    if _undone(value, schema) is not None:
        return True
    if isinstance(value, dict) and isinstance(schema.get("properties"), Mapping):
        properties = schema["properties"]
        return any(_coercible(v, properties.get(k)) for k, v in value.items())
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return any(_coercible(v, schema["items"]) for v in value)
    return False


def coercion_readings(arguments: str, properties: Mapping[str, Any]) -> CoercionReadings | None:
    """Every text the model may have written that a coercing stack returns as `arguments`
    (`properties`: the called tool's declared parameters), or None where no coercion can have
    happened (not json.dumps's layout, nothing the schema would coerce)."""
    try:
        values = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(values, dict) or json.dumps(values, ensure_ascii=False) != arguments:
        return None
    undone: dict[str, Any] = {}
    complete = arguments.isascii()
    nested = False
    for key, value in values.items():
        schema = properties.get(key)
        found = _undone(value, schema) if isinstance(schema, Mapping) else None
        if found is not None:
            undone[key], exact = found
            complete = complete and exact
        elif _coercible(value, schema):
            nested = True  # not listed: the set built on it stays open
    if not undone and not nested:
        return None
    if nested or len(undone) > MAX_COERCED_VALUES:
        complete = False
    texts = [arguments]
    keys = list(undone)[:MAX_COERCED_VALUES]
    for size in range(1, len(keys) + 1):
        for subset in itertools.combinations(keys, size):
            written = {k: (undone[k] if k in subset else v) for k, v in values.items()}
            for separators in LAYOUTS:
                text = json.dumps(written, ensure_ascii=False, separators=separators)
                if text not in texts:
                    texts.append(text)
    return CoercionReadings(tuple(texts), complete)
