"""OpenAI chat messages -> the plain dicts a chat template renders.

The one normalisation of the API server, the offline `LLM.chat` and the router: if two of them
rendered a message differently, the router's block hashes would never match an engine's.
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

Message = dict[str, Any]


def normalise_message(message: Mapping[str, Any]) -> Message:
    """`developer` becomes `system` (templates know only system), text content parts are joined
    by newlines, no content is "" and an empty name is dropped; other keys (tool calls, tool call
    ids, ...) pass through to the template, except those set to null; a tool call's `arguments`
    JSON string becomes the object templates expect. Idempotent. ValueError for a non-text
    content part."""
    if not isinstance(message, Mapping):
        raise ValueError(f"a chat message must be an object, got {type(message).__name__}")
    role = message.get("role")
    out: Message = {"role": "system" if role == "developer" else role,
                    "content": _content_text(message.get("content"))}
    if message.get("name"):
        out["name"] = message["name"]
    for key, value in message.items():
        if key not in ("role", "content", "name") and value is not None:
            out[key] = value
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [_call_with_object_arguments(c) for c in out["tool_calls"]]
    return out


def _call_with_object_arguments(call: Any) -> Any:
    """NOTE: OpenAI sends a call's arguments as JSON text; chat templates (Qwen, Llama, Hermes)
    write `arguments | tojson`, which would quote the text again."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    args = call["function"].get("arguments")
    if not isinstance(args, str):
        return call
    try:
        parsed = json.loads(args)
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**call["function"], "arguments": parsed}}


def normalise_messages(messages: Iterable[Mapping[str, Any]]) -> list[Message]:
    return [normalise_message(m) for m in messages]


def _content_text(content: Any) -> Any:
    """OpenAI content parts ([{"type": "text", "text": ...}]) -> one string, as templates expect."""
    if content is None:
        return ""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"unsupported message content part {kind!r}; only 'text' parts are supported")
        texts.append(part.get("text", ""))
    return "\n".join(texts)
