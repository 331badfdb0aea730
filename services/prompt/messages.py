"""OpenAI chat messages -> the plain dicts a chat template renders.

The one normalisation of the API server, the offline `LLM.chat` and the router: if two of them
rendered a message differently, the router's block hashes would never match an engine's.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

Message = dict[str, Any]


def normalise_message(message: Mapping[str, Any]) -> Message:
    """`developer` becomes `system` (templates know only system), text content parts are joined
    by newlines, no content is "" and an empty name is dropped; other keys (tool calls, tool call
    ids, ...) pass through to the template. Idempotent. ValueError for a non-text content part."""
    if not isinstance(message, Mapping):
        raise ValueError(f"a chat message must be an object, got {type(message).__name__}")
    role = message.get("role")
    out: Message = {"role": "system" if role == "developer" else role,
                    "content": _content_text(message.get("content"))}
    if message.get("name"):
        out["name"] = message["name"]
    for key, value in message.items():
        if key not in ("role", "content", "name"):
            out[key] = value
    return out


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
