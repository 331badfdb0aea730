"""Qwen3: the Llama decoder plus a per-head RMSNorm on q and k (before RoPE).

HF Qwen3 differs from Qwen2 in exactly that norm, in having no q/k/v bias (attention_bias,
default False) and in an explicit head_dim that need not be hidden / heads (ModelConfig reads it).
"""
from __future__ import annotations

from functools import partial
from types import ModuleType

from kvmesh.engine.layers.causal_lm import CausalLM
from kvmesh.engine.layers.norm import RMSNorm
from kvmesh.engine.model_config import ModelConfig
from kvmesh.engine.models.llama import LlamaDecoderLayer, LlamaModel


def qwen3_decoder_layer(config: ModelConfig, ops: ModuleType, layer: int) -> LlamaDecoderLayer:
    """Shared with Qwen3-MoE, whose layers differ only in the MLP."""
    qk_norm = partial(RMSNorm, eps=config.rms_norm_eps, ops=ops)
    return LlamaDecoderLayer(config, ops, layer, qk_norm=qk_norm)


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, ops: ModuleType):
        super().__init__(config, LlamaModel(config, ops, lambda i: qwen3_decoder_layer(config, ops, i)))
