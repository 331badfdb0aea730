"""JSON-schema keywords xgrammar enforces, and a check that refuses the rest.

NOTE: xgrammar silently ignores what it cannot express (uniqueItems, not, if/then/else, a
second allOf branch, oneOf's exclusivity, multipleOf on numbers or with a range, a length with a
pattern or format, a lookahead in a pattern, ...): the output would look constrained and not be. Each keyword below was checked on xgrammar 0.2.8 by matching a value that
satisfies it and one that breaks it (tests/structured/test_schema_support.py holds both).
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import Draft202012Validator, validator_for

from kvmesh.engine.structured.spec import StructuredOutputError

# annotations: no constraint to enforce
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "$anchor", "contentMediaType", "contentEncoding", "discriminator",
})
_ENFORCED = frozenset({
    "type", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "minProperties", "maxProperties",
    "items", "prefixItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "allOf",
})
# string formats xgrammar turns into a pattern (others are ignored by it)
FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6",
                     "uri", "uuid"})
_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_LENGTHS = frozenset({"minLength", "maxLength"})
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties")


def check_schema(schema: Any, param: str = "structured_outputs") -> None:
    """StructuredOutputError if the schema is not a valid JSON schema (its draft's metaschema)
    or uses a keyword xgrammar would not enforce (named, with where)."""
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        where = "#/" + "/".join(str(p) for p in e.path) if e.path else "#"
        raise StructuredOutputError(f"invalid JSON schema at {where}: {e.message}",
                                    param=param) from None
    for path, message in _problems(schema, "#"):
        raise StructuredOutputError(f"JSON schema {message} at {path}; structured outputs can "
                                    "only enforce what the grammar expresses, so it is refused "
                                    "rather than ignored", param=param)


def _problems(node: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        yield path, f"has a {type(node).__name__} where a schema (an object) belongs"
        return
    for key in node:
        if key in _ANNOTATIONS:
            continue
        if key not in _ENFORCED:
            yield path, f"keyword {key!r} is not supported"
            return
    if "multipleOf" in node:
        if node.get("type") != "integer":
            yield path, "keyword 'multipleOf' is only supported with \"type\": \"integer\""
        bounds = sorted(_BOUNDS & node.keys())
        if bounds:
            yield path, f"keyword 'multipleOf' cannot be combined with {bounds[0]!r}"
    shaped = [k for k in ("pattern", "format") if k in node]
    lengths = sorted(_LENGTHS & node.keys())
    if shaped and lengths:
        yield path, f"keyword {lengths[0]!r} cannot be combined with {shaped[0]!r}"
    pattern = node.get("pattern")
    if isinstance(pattern, str) and _LOOKAROUND.search(pattern):
        yield path, "a lookahead or lookbehind in 'pattern' is not supported"
    required = node.get("required") or []
    if node.get("additionalProperties", False) is False and "patternProperties" not in node:
        missing = [r for r in required if r not in (node.get("properties") or {})]
        if missing:
            yield path, (f"requires {missing[0]!r}, which is not in its properties (structured "
                         "outputs allow no other properties)")
    if "allOf" in node and len(node["allOf"]) != 1:
        yield path, "keyword 'allOf' is only supported with one subschema (merge them)"
    fmt = node.get("format")
    if fmt is not None and fmt not in FORMATS:
        yield path, f"string format {fmt!r} is not supported (supported: {sorted(FORMATS)})"
    for key in _SUBSCHEMA_MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for name, child in sub.items():
                yield from _problems(child, f"{path}/{key}/{name}")
    for key in _SUBSCHEMA_LISTS:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, child in enumerate(sub):
                yield from _problems(child, f"{path}/{key}/{i}")
    for key in _SUBSCHEMAS:
        if key in node:
            yield from _problems(node[key], f"{path}/{key}")
