"""The one table of supported architectures: HF `architectures[0]` -> (module, class).

Adding a family is one line here (plus its module under `kvmesh.engine.models`, and the fields
it needs in ModelConfig). Classes are imported lazily, so ModelConfig can read the names without
importing torch modules (and without an import cycle).
"""
from __future__ import annotations

import importlib

from torch import nn

# NOTE: Qwen2 and Mistral are the Llama decoder: ModelConfig.attention_bias (Qwen2) and
# ModelConfig.sliding_window (Mistral) carry the differences.
MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}

# HF `model_type` -> architecture, for configs without an `architectures` list.
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "smollm": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        module, name = MODELS[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(MODELS)}") from None
    return getattr(importlib.import_module(f"kvmesh.engine.models.{module}"), name)
