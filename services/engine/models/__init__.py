"""Model registry: HF architecture name -> model class."""
from __future__ import annotations

from torch import nn

from kvmesh.engine.model_config import SUPPORTED_ARCHITECTURES
from kvmesh.engine.models.llama import LlamaForCausalLM
from kvmesh.engine.models.mixtral import MixtralForCausalLM
from kvmesh.engine.models.qwen3_moe import Qwen3MoeForCausalLM

# NOTE: Qwen2 is Llama with q/k/v bias; ModelConfig.attention_bias carries the difference.
_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
assert set(_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(_REGISTRY)}") from None


__all__ = ["LlamaForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "get_model_class"]
