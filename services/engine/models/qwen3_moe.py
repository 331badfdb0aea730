"""Qwen3-MoE: Qwen3 attention (per-head q/k RMSNorm, explicit head_dim) with sparse MoE MLPs.

    embed -> N x [ rms_norm -> q,k,v proj -> q_norm, k_norm (per head) -> rope -> paged attention -> o_proj
                   (+res) rms_norm -> mlp ] -> (+res) rms_norm -> lm_head

    mlp = SparseMoeBlock (router -> softmax -> top-k -> renormalise if norm_topk_prob) on the
          layers in ModelConfig.moe.sparse_layers (HF: not in mlp_only_layers and
          (i + 1) % decoder_sparse_step == 0), the dense SiLU MLP (intermediate_size) elsewhere.

No shared expert (that is Qwen2-MoE). HF parameter names (`model.layers.N.mlp.gate.weight`,
`model.layers.N.mlp.experts.E.gate_proj.weight`, `...self_attn.q_norm.weight`).
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from kvmesh.engine.model_config import ModelConfig
from kvmesh.engine.models.llama import (LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm, _fused,
                                        build_cos_sin_cache)
from kvmesh.engine.models.moe import SparseMoeBlock
from kvmesh.kernels.linear import linear
from kvmesh.kernels.metadata import AttentionMetadata


class Qwen3Attention(LlamaAttention):
    """Llama attention plus an RMSNorm over each head's head_dim on q and k, before RoPE.

    NOTE: minimal, written before the shared Qwen3 attention layer existed; to be replaced by it.
    """

    def __init__(self, config: ModelConfig, ops: ModuleType):
        super().__init__(config, ops)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        w, b = _fused(self, (self.q_proj, self.k_proj, self.v_proj), "_qkv")
        if w is None:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        else:
            qkv = linear(x, w, b)                                     # [T, nq + 2 * nkv]
        q = self.q_norm(qkv[:, :nq].reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(qkv[:, nq:nq + nkv].reshape(t, self.num_kv_heads, self.head_dim))
        v = qkv[:, nq + nkv:].view(t, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotary_embedding(positions, q, k, cos_sin_cache)
        k_cache, v_cache = kv_cache
        self.ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        o = self.ops.paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, heads, d]
        return linear(o.reshape(t, nq), self.o_proj.weight, self.o_proj.bias)


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModuleType, layer: int):
        super().__init__()
        moe = config.moe
        self.self_attn = Qwen3Attention(config, ops)
        if layer in moe.sparse_layers:
            self.mlp = SparseMoeBlock(config.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k,
                                      moe.renormalize, ops, round_weights=True)
        else:
            self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin_cache):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3MoeModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModuleType):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(config, ops, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE with HF parameter names; forward, logits and weight tying are Llama's."""

    def __init__(self, config: ModelConfig, ops: ModuleType):
        if config.moe is None:
            raise ValueError("Qwen3MoeForCausalLM needs a config with MoE settings (num_experts)")
        # NOTE: nn.Module's __init__, not Llama's, which would build dense layers only to replace them.
        nn.Module.__init__(self)
        self.config = config
        self.model = Qwen3MoeModel(config, ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(config), persistent=False)
