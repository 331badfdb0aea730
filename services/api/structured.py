"""Structured-output request fields -> one StructuredOutputSpec (or none).

OpenAI's `response_format` ({"type": "json_object"}, {"type": "json_schema", "json_schema": {...}}),
vLLM's `structured_outputs` ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}) and
its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields. A request
may set one constraint; two are a 400 naming both.
"""
from __future__ import annotations

from typing import Any

from kvmesh.engine.structured.spec import StructuredOutputError, StructuredOutputSpec
from pydantic import BaseModel, ConfigDict, Field


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str = Field(pattern=r"^(text|json_object|json_schema)$")
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` object: set exactly one of its constraints."""
    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """Mixed into the completions and chat request models."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_spec(self) -> tuple[StructuredOutputSpec, str] | None:
        """(spec, the field it came from), None without a constraint; StructuredOutputError
        (a 400 naming the field) for two constraints or a malformed one."""
        found = [(field, builder) for field, builder in self._constraints() if builder is not None]
        if len(found) > 1:
            names = " and ".join(field for field, _ in found)
            raise StructuredOutputError(f"give at most one structured output constraint, got "
                                        f"{names}", param=found[1][0])
        if not found:
            return None
        field, builder = found[0]
        try:
            return builder(), field
        except StructuredOutputError as e:
            raise StructuredOutputError(str(e), param=field) from None

    def _constraints(self):
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            yield "response_format", StructuredOutputSpec.json_object
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise StructuredOutputError("response_format json_schema needs "
                                            "json_schema.schema", param="response_format")
            schema = rf.json_schema.json_schema
            yield "response_format", lambda: StructuredOutputSpec.json_schema(schema)
        so = self.structured_outputs
        if so is not None:
            parts = [(f"structured_outputs.{name}", b) for name, b in _vllm_builders(so)]
            if not parts:
                raise StructuredOutputError("structured_outputs needs one of json, regex, "
                                            "choice, grammar or json_object",
                                            param="structured_outputs")
            yield from parts
        for field, value, make in (
                ("guided_json", self.guided_json, StructuredOutputSpec.json_schema),
                ("guided_regex", self.guided_regex, StructuredOutputSpec.regex),
                ("guided_choice", self.guided_choice, StructuredOutputSpec.choice),
                ("guided_grammar", self.guided_grammar, StructuredOutputSpec.grammar)):
            if value is not None:
                yield field, (lambda make=make, value=value: make(value))


def _vllm_builders(so: StructuredOutputsParams):
    if so.json_ is not None:
        yield "json", lambda: StructuredOutputSpec.json_schema(so.json_)
    if so.regex is not None:
        yield "regex", lambda: StructuredOutputSpec.regex(so.regex)
    if so.choice is not None:
        yield "choice", lambda: StructuredOutputSpec.choice(so.choice)
    if so.grammar is not None:
        yield "grammar", lambda: StructuredOutputSpec.grammar(so.grammar)
    if so.json_object:
        yield "json_object", StructuredOutputSpec.json_object
