"""Tool-call output parsers, chosen by `kvmesh serve --tool-call-parser`.

    base.py         ToolCall, ToolParser: split the text into content and JSON call bodies;
                    extract (whole text) and the streaming deltas, shared by every format
    json_scan.py    spans of the top-level JSON values in partial text (string- and depth-aware)
    hermes.py       <tool_call>{"name": ..., "arguments": {...}}</tool_call>  (Qwen2/3, Hermes)
    llama3_json.py  {"name": ..., "parameters": {...}}; several joined by ";"  (Llama 3.x)
    mistral.py      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]      (Mistral)

`auto` picks one from the chat template's text (see `parser_for_template`).
"""
from __future__ import annotations

from kvmesh.api.tool_parsers.base import ToolCall, ToolParser, ToolStream
from kvmesh.api.tool_parsers.hermes import HermesToolParser
from kvmesh.api.tool_parsers.llama3_json import Llama3JsonToolParser
from kvmesh.api.tool_parsers.mistral import MistralToolParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}
CHOICES = ("auto", *PARSERS)


def parser_for_template(chat_template: str | None) -> type[ToolParser]:
    """The format a chat template teaches its model. NOTE: templates without tools get the
    renderer's default Hermes-style tools section (kvmesh.prompt.tools), so hermes is the default."""
    text = chat_template or ""
    if "[TOOL_CALLS]" in text:
        return MistralToolParser
    if "<|python_tag|>" in text or "ipython" in text:
        return Llama3JsonToolParser
    return HermesToolParser


def get_tool_parser(name: str, chat_template: str | None) -> ToolParser:
    """The parser for `--tool-call-parser NAME` (auto: from the chat template)."""
    if name == "auto":
        return parser_for_template(chat_template)()
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(CHOICES)}") from None


__all__ = ["CHOICES", "PARSERS", "ToolCall", "ToolParser", "ToolStream", "get_tool_parser",
           "parser_for_template"]
