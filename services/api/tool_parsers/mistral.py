"""Mistral tool calls: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`; text before the
marker is content. `[TOOL_CALLS]` is a special token of Mistral's tokenizers, so the output is
detokenized with special tokens kept."""
from __future__ import annotations

from typing import Any

from kvmesh.api.tool_parsers.base import ToolParser, call_schema, held_back
from kvmesh.engine.structured.spec import StructuredOutputSpec

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def regions(self, text: str, final: bool) -> tuple[str, int | None]:
        i = text.find(MARKER)
        if i >= 0:
            return text[:i], i + len(MARKER)
        return (text if final else text[:len(text) - held_back(text, MARKER)]), None

    def constrained(self, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutputSpec:
        schema: dict[str, Any] = {"type": "array", "items": call_schema(tools, "arguments"),
                                  "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return StructuredOutputSpec.tagged_json(MARKER, schema, "")
