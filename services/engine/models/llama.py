"""Llama-family decoder (Llama, SmolLM2, Qwen2) over the paged KV cache.

One packed batch per forward: the new tokens of every sequence, concatenated ([T] ids and
positions), attend to their context through the per-layer paged caches described by `meta`.
Parameter names are HF's (`model.layers.N.self_attn.q_proj.weight`, ...), so an HF state dict
loads as is. The building blocks live in `kvmesh.engine.layers`; Qwen3, Mistral and Phi-3 reuse
this decoder layer with their own switches.

    embed -> N x [ rms_norm -> attention (q,k,v proj -> rope -> paged cache -> o_proj)
                   (+res) rms_norm -> down(silu(gate(x)) * up(x)) ] -> (+res) rms_norm -> lm_head
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch
from torch import nn

from kvmesh.engine.layers import rope
from kvmesh.engine.layers.attention import Attention, AttentionSpec
from kvmesh.engine.layers.causal_lm import CausalLM, layer_window
from kvmesh.engine.layers.mlp import GatedMLP
from kvmesh.engine.layers.norm import RMSNorm
from kvmesh.engine.model_config import ModelConfig


def build_cos_sin_cache(config: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """[max_positions, head_dim] float32 cos/sin table of `config`'s (global) RoPE."""
    return rope.build_cos_sin_cache(config.head_dim, config.rope_theta, config.rope_scaling,
                                    config.max_position_embeddings, device)


def attention_spec(config: ModelConfig, layer: int) -> AttentionSpec:
    """The Llama-style spec: head_dim ** -0.5 scale, the layer's window, no soft-cap."""
    return AttentionSpec(num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                         head_dim=config.head_dim, scale=config.head_dim ** -0.5,
                         sliding_window=layer_window(config, layer))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder layer; the residual add is fused into the next RMSNorm."""

    def __init__(self, config: ModelConfig, ops: ModuleType, layer: int, *,
                 qk_norm: Callable[[int], nn.Module] | None = None, fused_weights: bool = False):
        super().__init__()
        h = config.hidden_size
        self.self_attn = Attention(h, attention_spec(config, layer), ops, qkv_bias=config.attention_bias,
                                   o_bias=config.o_proj_bias, qk_norm=qk_norm, fused_qkv=fused_weights)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act, bias=config.mlp_bias,
                            fused_gate_up=fused_weights)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin_caches):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin_caches[self.self_attn.spec.rope])
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's MLP (a mixture of experts in Mixtral, which shares the rest)."""
        return self.mlp(hidden)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModuleType,
                 make_layer: Callable[[int], nn.Module] | None = None):
        super().__init__()
        make_layer = make_layer or (lambda i: LlamaDecoderLayer(config, ops, i))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class LlamaForCausalLM(CausalLM):
    """Llama / SmolLM2 / Qwen2 (q/k/v bias) with HF parameter names."""

    def __init__(self, config: ModelConfig, ops: ModuleType):
        super().__init__(config, LlamaModel(config, ops))
