"""Request body -> prompt token ids, exactly as an engine sees them (hashing: kvmesh.index.hashing).

The tokenizer comes from the model path without loading weights: an HF directory's tokenizer.json,
or a GGUF file's converted tokenizer (cached under ${KVMESH_CACHE_DIR:-~/.cache/kvmesh}).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvmesh.router")


def load_tokenizer(model: str | None, tokenizer: str | None = None):
    """A `Tokenizer` for `tokenizer` (a directory) or `model` (directory, .gguf file, None or
    the built-in model's name). Raises FileNotFoundError / ValueError when there is none."""
    from kvmesh.engine.tokenizer import Tokenizer  # noqa: PLC0415 (transformers is slow to import)

    if tokenizer:
        return Tokenizer.from_dir(Path(tokenizer).expanduser())
    from kvmesh.engine import loader  # noqa: PLC0415 (imports torch)

    if not model or model == loader.BUILTIN_MODEL_NAME:
        path = loader.builtin_model_path()
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"model {model!r} is neither a directory nor a .gguf file here; pass the model "
                "path (or --tokenizer DIR) so the router hashes prompts like the engines do")
    if path.is_dir():
        return Tokenizer.from_dir(path)
    from kvmesh.engine.models.gguf import GGUFFile  # noqa: PLC0415

    return Tokenizer.from_dir(GGUFFile(path).tokenizer_dir(loader.cache_dir()))


def _first_prompt(prompt: Any) -> str | list[int] | None:
    """completions `prompt`: a string, token ids, or a batch of either (the first one routes)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        return _first_prompt(prompt[0])
    return None


def _template_message(m: dict[str, Any]) -> dict[str, Any]:
    """The message as the engine's API server renders it (protocol.ChatMessage.as_template_dict):
    `developer` is `system`, text parts are joined by newlines, no content is ""."""
    role = m.get("role")
    content = m.get("content")
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    out = {"role": "system" if role == "developer" else role, "content": content or ""}
    if m.get("name"):
        out["name"] = m["name"]
    return out


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
            return tokenizer.apply_chat_template(
                [_template_message(m) for m in messages],
                add_generation_prompt=bool(body.get("add_generation_prompt", True)))
        prompt = _first_prompt(body.get("prompt"))
        if isinstance(prompt, str):
            return tokenizer.encode(prompt) if prompt else None
        return prompt
    except Exception as e:  # noqa: BLE001 - a malformed body is the engine's to reject
        logger.debug("cannot tokenize the request for routing: %s", e)
        return None
