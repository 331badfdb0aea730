"""ToolParser: one model format of tool calls. A format only says where its calls are
(`regions`); reading them whole (`extract`) and as deltas (`ToolStream`) is shared.

Arguments are the raw JSON text the model wrote for them, both whole and streamed, so the
streamed pieces always join to the non-streamed string.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvmesh.api.tool_parsers.json_scan import object_spans
from kvmesh.engine.structured.spec import StructuredOutputSpec

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_DECODER = json.JSONDecoder()


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str            # JSON text of the arguments, as the model wrote it

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class Extracted:
    content: str | None        # the text outside the calls (None when only calls were written)
    calls: list[ToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    name: ClassVar[str]
    args_keys: ClassVar[tuple[str, ...]] = ("arguments",)   # the key holding the arguments
    # the format's marker is a special token: the detokenizer must keep special tokens
    needs_special_tokens: ClassVar[bool] = False

    def regions(self, text: str, final: bool) -> tuple[str, int | None]:
        """(content, calls_start): the content safe to show (a possible partial marker at the
        end is held back unless `final`), and where the calls begin (None: no calls yet)."""
        raise NotImplementedError

    def constrained(self, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutputSpec:
        """A spec whose outputs are calls to one of `tools` in this format, arguments valid."""
        raise NotImplementedError

    # ---- shared -----------------------------------------------------------------------------
    def extract(self, text: str) -> Extracted:
        """The calls of a finished output; unparsable calls leave the whole text as content."""
        content, start = self.regions(text, final=True)
        if start is None:
            return Extracted(text, [])
        calls = []
        for s, e in object_spans(text, start):
            call = self._read_call(text[s:e] if e is not None else text[s:])
            if call is None or e is None:
                return Extracted(text, [])
            calls.append(ToolCall(new_call_id(), *call))
        if not calls:
            return Extracted(text, [])
        return Extracted(content if content.strip() else None, calls)

    def _read_call(self, body: str) -> tuple[str, str] | None:
        """(name, arguments JSON text) of a complete call object, or None."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        span = self.arguments_span(body)
        if span is None:
            return obj["name"], "{}"           # a call without arguments
        a, b = span
        return (obj["name"], body[a:b]) if b is not None else None

    def arguments_span(self, body: str) -> tuple[int, int | None] | None:
        """Where the arguments' JSON text starts in a call object (maybe partial), and where it
        ends (None while incomplete); None before the key has appeared."""
        m = re.search(r'"(' + "|".join(self.args_keys) + r')"\s*:\s*', body)
        if m is None:
            return None
        a = m.end()
        if a >= len(body):
            return a, None
        try:
            _, b = _DECODER.raw_decode(body, a)
        except json.JSONDecodeError:
            return a, None
        return a, b


def call_schema(tools: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    """JSON schema of one call object {"name": ..., args_key: {...}} to one of `tools`."""
    options = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        options.append({"type": "object",
                        "properties": {"name": {"const": fn["name"]}, args_key: params},
                        "required": ["name", args_key]})
    return options[0] if len(options) == 1 else {"anyOf": options}


@dataclass(slots=True)
class _StreamedCall:
    id: str
    name_sent: bool = False
    args_sent: int = 0         # characters of the arguments text already sent


@dataclass(slots=True)
class ToolStream:
    """One choice's streamed output as OpenAI chat deltas: content, then tool_calls deltas
    (index, id, type and name once; the arguments text in pieces)."""
    parser: ToolParser
    text: str = ""
    content_sent: int = 0
    calls: list[_StreamedCall] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return any(c.name_sent for c in self.calls)

    def feed(self, delta: str, final: bool = False) -> list[dict[str, Any]]:
        """The deltas that `delta` (new text) makes safe to send; `final`: the output ended."""
        self.text += delta
        out: list[dict[str, Any]] = []
        content, start = self.parser.regions(self.text, final)
        pending = content[self.content_sent:]
        # NOTE: whitespace before a call is not content; it is sent once real text follows
        if pending and (content.strip() or (final and start is None)):
            out.append({"content": pending})
            self.content_sent = len(content)
        if start is not None:
            out.extend(self._call_deltas(start))
        return out

    def _call_deltas(self, start: int) -> list[dict[str, Any]]:
        deltas = []
        for i, (s, e) in enumerate(object_spans(self.text, start)):
            body = self.text[s:e] if e is not None else self.text[s:]
            if i == len(self.calls):
                self.calls.append(_StreamedCall(new_call_id()))
            call = self.calls[i]
            if not call.name_sent:
                m = _NAME.search(body)
                if m is None:
                    continue
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except json.JSONDecodeError:
                    continue
                call.name_sent = True
                deltas.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                               "function": {"name": name, "arguments": ""}}]})
            span = self.parser.arguments_span(body)
            if span is None:
                continue
            a, b = span
            args = body[a:b] if b is not None else body[a:]
            if len(args) > call.args_sent:
                deltas.append({"tool_calls": [{"index": i, "function": {
                    "arguments": args[call.args_sent:]}}]})
                call.args_sent = len(args)
        return deltas


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
