"""Request body -> prompt token ids, exactly as an engine sees them (hashing: kvmesh.index.hashing).

The tokenizer and the message normalisation are the engines' own (`kvmesh.prompt`), loaded
without weights or torch (`kvmesh.prompt.sources.load_tokenizer`).
"""
from __future__ import annotations

import logging
from typing import Any

from kvmesh.prompt.messages import normalise_messages

logger = logging.getLogger("kvmesh.router")


def _first_prompt(prompt: Any) -> str | list[int] | None:
    """completions `prompt`: a string, token ids, or a batch of either (the first one routes)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        return _first_prompt(prompt[0])
    return None


def prompt_token_ids(tokenizer, endpoint: str, body: dict[str, Any]) -> list[int] | None:
    """The token ids the engine will see for this request, or None when they cannot be known
    (the request is then routed by load; the engine reports any error in the body itself)."""
    if tokenizer is None:
        return None
    try:
        if endpoint == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return None
            # NOTE: the body is raw JSON: normalise it here, as the API server's pydantic models
            # are absent (the engines' Tokenizer normalises again, idempotently). The tools are
            # rendered as the engine renders them (its template's way or prompt.tools').
            tools = body.get("tools")
            return tokenizer.apply_chat_template(
                normalise_messages(messages),
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                tools=tools if isinstance(tools, list) and tools else None)
        prompt = _first_prompt(body.get("prompt"))
        if isinstance(prompt, str):
            return tokenizer.encode(prompt) if prompt else None
        return prompt
    except Exception as e:  # noqa: BLE001 - a malformed body is the engine's to reject
        logger.debug("cannot tokenize the request for routing: %s", e)
        return None
