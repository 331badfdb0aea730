"""Phi-3: the Llama decoder with fused checkpoint tensors (`qkv_proj`, `gate_up_proj`) and
longrope (`su`) RoPE scaling; a config `sliding_window` applies to every layer."""
from __future__ import annotations

from types import ModuleType

from kvmesh.engine.layers.causal_lm import CausalLM
from kvmesh.engine.model_config import ModelConfig
from kvmesh.engine.models.llama import LlamaDecoderLayer, LlamaModel


class Phi3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, ops: ModuleType):
        super().__init__(config, LlamaModel(
            config, ops, lambda i: LlamaDecoderLayer(config, ops, i, fused_weights=True)))
