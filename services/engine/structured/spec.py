"""What a request's structured output must match, as plain data (no xgrammar, no torch)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# kind -> what `value` holds (canonical text, so equal specs have equal keys)
KINDS = {
    "json": "a JSON schema (canonical JSON text)",
    "json_object": "any JSON object (value is empty)",
    "regex": "a regular expression",
    "choice": "a JSON list of the allowed strings",
    "grammar": "an EBNF grammar (xgrammar's dialect, GBNF-like)",
    "tagged_json": 'a JSON object {"begin": text, "schema": schema, "end": text}',
}


class StructuredOutputError(ValueError):
    """A structured-output request xgrammar cannot serve; `param` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True, frozen=True)
class StructuredOutputSpec:
    kind: str          # one of KINDS
    value: str         # canonical text for the kind (see KINDS)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"unknown structured output kind {self.kind!r}; "
                                        f"expected one of {sorted(KINDS)}")
        if not isinstance(self.value, str):
            raise StructuredOutputError(f"structured output {self.kind} must be text")

    @property
    def key(self) -> tuple[str, str]:
        """The compile cache's key: equal specs compile once."""
        return (self.kind, self.value)

    # ---- constructors: each canonicalises its input ---------------------------------------
    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | bool) -> StructuredOutputSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError("a JSON schema must be an object")
        return cls("json", canonical_json(schema))

    @classmethod
    def json_object(cls) -> StructuredOutputSpec:
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputSpec:
        if not isinstance(pattern, str) or not pattern:
            raise StructuredOutputError("the regex must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutputSpec:
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
        return cls("choice", canonical_json(list(dict.fromkeys(choices))))

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutputSpec:
        if not isinstance(ebnf, str) or not ebnf.strip():
            raise StructuredOutputError("the grammar must be a non-empty EBNF string")
        return cls("grammar", ebnf)

    @classmethod
    def tagged_json(cls, begin: str, schema: dict[str, Any], end: str) -> StructuredOutputSpec:
        """`begin`, then JSON matching `schema`, then `end` (tool calls in a model's format)."""
        return cls("tagged_json", canonical_json({"begin": begin, "schema": schema, "end": end}))


def canonical_json(value: Any) -> str:
    """Compact JSON. NOTE: keys keep their order: a schema's property order is the order the
    output writes them in, so two schemas differing only in it are different specs."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
