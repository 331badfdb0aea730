"""Which of a model repository's files a model needs: the allow-list every fetch applies.

As vLLM and KServe do, only the files the engine reads are fetched (no .bin / .pth duplicates,
no ONNX exports, no README images): the config, the weights, the tokenizer, the chat template
and the generation config (and a LoRA adapter's adapter_config.json).
"""
from __future__ import annotations

from fnmatch import fnmatchcase

ALLOW_PATTERNS = (
    "config*.json",                   # config.json (and e.g. config_sentence_transformers.json)
    "*.safetensors",
    "*.safetensors.index.json",       # the shard index of a sharded checkpoint
    "tokenizer*",                     # tokenizer.json, tokenizer_config.json, tokenizer.model
    "special_tokens_map.json",
    "chat_template*",                 # chat_template.jinja / chat_template.json
    "generation_config.json",
    "*.gguf",
    "adapter_config.json",            # a PEFT LoRA adapter's (its weights: *.safetensors)
)


def wanted(name: str) -> bool:
    """Whether the file `name` (relative to the model directory) is one the model needs; only
    top-level files: the loader reads no sub-folder."""
    return "/" not in name and any(fnmatchcase(name, p) for p in ALLOW_PATTERNS)
