"""Gemma 2: sandwich norms, GeGLU, (1 + w) RMSNorm, scaled embeddings, soft-capping, alternating
sliding-window (even layers) and global layers.

    embed * sqrt(hidden) -> N x [ h += post_attn_norm(attn(input_norm(h)))
                                  h += post_ff_norm(mlp(pre_ff_norm(h))) ] -> norm -> lm_head
                                                                                -> cap * tanh(/cap)
Attention: softmax scale query_pre_attn_scalar ** -0.5, scores soft-capped (attn_logit_softcapping)
before the mask; the window comes from layer_types. Gemma 3 reuses this layer (gemma3.py).
"""
from __future__ import annotations

from functools import partial
from types import ModuleType

import torch
from torch import nn

from kvmesh.engine.layers.attention import Attention, AttentionSpec
from kvmesh.engine.layers.causal_lm import CausalLM, layer_window
from kvmesh.engine.layers.mlp import GatedMLP
from kvmesh.engine.layers.norm import GemmaRMSNorm
from kvmesh.engine.model_config import ModelConfig


def gemma_attention_spec(config: ModelConfig, layer: int, rope: str = "global") -> AttentionSpec:
    return AttentionSpec(num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                         head_dim=config.head_dim, scale=config.query_pre_attn_scalar ** -0.5,
                         sliding_window=layer_window(config, layer),
                         softcap=config.attn_logit_softcapping or 0.0, rope=rope)


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norms around attention and MLP; the residual adds are explicit."""

    def __init__(self, config: ModelConfig, ops: ModuleType, spec: AttentionSpec, qk_norm: bool = False):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(h, spec, ops, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                                   qk_norm=partial(GemmaRMSNorm, eps=eps) if qk_norm else None)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin_caches):
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta,
                              cos_sin_caches[self.self_attn.spec.rope])
        hidden = hidden + self.post_attention_layernorm(attn)
        hidden = hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        return hidden, None


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, make_layer):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaCausalLM(CausalLM):
    """Shared by Gemma 2 and 3: embeddings scaled by sqrt(hidden), a plain final norm."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        emb = self.model.embed_tokens(input_ids)
        # NOTE: HF rounds sqrt(hidden) to the weight dtype first (bf16: 48.0 for hidden 2304).
        return emb * torch.tensor(self.config.hidden_size ** 0.5, dtype=emb.dtype)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.model.norm(hidden)


class Gemma2ForCausalLM(GemmaCausalLM):
    def __init__(self, config: ModelConfig, ops: ModuleType):
        super().__init__(config, GemmaModel(
            config, lambda i: GemmaDecoderLayer(config, ops, gemma_attention_spec(config, i))))
