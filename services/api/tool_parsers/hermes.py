"""Hermes / Qwen2 / Qwen3 tool calls: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`,
one block per call; text before the first block is content."""
from __future__ import annotations

from typing import Any

from kvmesh.api.tool_parsers.base import ToolParser, call_schema, held_back
from kvmesh.engine.structured.spec import StructuredOutputSpec

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def regions(self, text: str, final: bool) -> tuple[str, int | None]:
        i = text.find(START)
        if i >= 0:
            return text[:i], i + len(START)
        return (text if final else text[:len(text) - held_back(text, START)]), None

    def constrained(self, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutputSpec:
        # NOTE: exactly one call: a grammar repeating a JSON schema is not expressible by
        # concatenation alone; one call satisfies `required` and a named function alike.
        return StructuredOutputSpec.tagged_json(f"{START}\n", call_schema(tools, "arguments"),
                                                f"\n{END}")
