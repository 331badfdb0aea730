"""Llama 3.x JSON tool calls: the whole output is `{"name": "f", "parameters": {...}}` (maybe after
`<|python_tag|>`), several calls joined by "; ". Output that does not start so is content."""
from __future__ import annotations

from typing import Any

from kvmesh.api.tool_parsers.base import ToolParser, call_schema
from kvmesh.engine.structured.spec import StructuredOutputSpec

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    args_keys = ("parameters", "arguments")

    def regions(self, text: str, final: bool) -> tuple[str, int | None]:
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        if stripped.startswith(PYTHON_TAG):
            return "", lead + len(PYTHON_TAG)
        if stripped.startswith("{"):
            return "", lead
        if not final and (not stripped or PYTHON_TAG.startswith(stripped)):
            return "", None                    # NOTE: not known yet whether it is a call
        return text, None

    def constrained(self, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutputSpec:
        return StructuredOutputSpec.json_schema(call_schema(tools, "parameters"))
