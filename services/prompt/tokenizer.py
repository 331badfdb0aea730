"""Tokenizer: a transformers fast tokenizer built from tokenizer.json + tokenizer_config.json.

We build `PreTrainedTokenizerFast` directly from the files (no AutoTokenizer class lookup, no hub),
so an HF directory and a converted GGUF cache directory load the same way in ~0.1 s.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from kvmesh.common.model_files import ModelFileNotFoundError
from kvmesh.prompt.messages import normalise_messages
from kvmesh.prompt.tools import (template_renders_tool_calls, template_renders_tools,
                                 with_default_tools)

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encode / decode / chat template, plus the ids that end generation."""

    def __init__(self, hf: PreTrainedTokenizerFast, extra_eos_token_ids: tuple[int, ...] = ()):
        self.hf = hf  # the underlying tokenizer (the detokenizer uses it directly)
        own = () if hf.eos_token_id is None else (int(hf.eos_token_id),)
        # NOTE: chat models often stop on a turn-end token (config / generation_config eos) that
        # differs from the tokenizer's eos; every one of them ends a sequence.
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(own + tuple(extra_eos_token_ids)))

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_token_ids: tuple[int, ...] = ()) -> "Tokenizer":
        """Load `tokenizer.json` (required), `tokenizer_config.json` and `chat_template.jinja`."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelFileNotFoundError(f"missing tokenizer.json in {path}")
        cfg: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"malformed tokenizer_config.json in {path}: {e}") from None
        kwargs: dict[str, Any] = {}
        for key in _SPECIAL_KEYS:
            if cfg.get(key) is not None:
                kwargs[key] = _token_text(cfg[key])
        extra = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens")
        if isinstance(extra, list) and extra:
            kwargs["additional_special_tokens"] = [_token_text(t) for t in extra]
        template = _chat_template(cfg, path)
        if template is not None:
            kwargs["chat_template"] = template
        if cfg.get("model_max_length") is not None:
            kwargs["model_max_length"] = cfg["model_max_length"]
        try:
            hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_file), **kwargs)
        except Exception as e:  # the tokenizers library raises plain Exception on bad JSON
            raise ValueError(f"cannot load tokenizer {tok_file}: {e}") from e
        return cls(hf, extra_eos_token_ids)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(ids)

    # ------------------------------------------------------------------ chat

    @property
    def chat_template(self) -> str | None:
        return self.hf.chat_template

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    documents: list[dict[str, Any]] | None = None) -> str:
        """The chat template applied to `messages` (normalised: see prompt.messages), as text.
        `tools` and `documents` reach the template as its `tools` / `documents` variables; a
        template that does not know tools (or tool calls) gets the default rendering instead
        (prompt.tools: a system-prompt section, <tool_call> / <tool_response> blocks)."""
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template (no 'chat_template' in "
                             "tokenizer_config.json, no chat_template.jinja); use a plain completion prompt")
        messages = normalise_messages(messages)
        template = self.hf.chat_template
        inline_tools = bool(tools) and not template_renders_tools(template)
        inline_calls = not template_renders_tool_calls(template)
        if inline_tools or (inline_calls and _has_tool_turns(messages)):
            # NOTE: the template cannot render them: the default rendering (prompt.tools)
            messages = with_default_tools(messages, tools, inline_tools, inline_calls)
            if inline_tools:
                tools = None
        text = self.hf.apply_chat_template(
            messages, tools=tools or None, documents=documents,
            add_generation_prompt=add_generation_prompt, tokenize=False)
        return text if isinstance(text, str) else text[0]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered chat (the template carries its own special tokens)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                documents=documents)
        return self.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ ids

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included (the model's may be padded larger)."""
        return len(self.hf)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf.all_special_ids)


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def _token_text(token: Any) -> str:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    return token["content"] if isinstance(token, dict) else str(token)


def _chat_template(cfg: dict[str, Any], path: Path) -> str | None:
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    return template

