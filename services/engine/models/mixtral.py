"""Mixtral: Llama attention with a sparse mixture-of-experts MLP in every layer.

    embed -> N x [ rms_norm -> attention (paged; a sliding window if the config sets one)
                   (+res) rms_norm -> block_sparse_moe: router -> softmax -> top-k, renormalised
                                      -> sum_k w_k * w2_e(silu(w1_e(x)) * w3_e(x)) ] -> (+res) rms_norm -> lm_head

HF parameter names (`model.layers.N.block_sparse_moe.gate.weight`,
`...block_sparse_moe.experts.E.w1.weight`), so an HF checkpoint loads as is. Attention, norms and
the skeleton are the shared layers; only the decoder layer's MLP (and its name) differ from Llama.
"""
from __future__ import annotations

from types import ModuleType

from torch import nn

from kvmesh.engine.layers.attention import Attention
from kvmesh.engine.layers.causal_lm import CausalLM
from kvmesh.engine.layers.moe import SparseMoeBlock
from kvmesh.engine.layers.norm import RMSNorm
from kvmesh.engine.model_config import ModelConfig
from kvmesh.engine.models.llama import LlamaModel, attention_spec


class MixtralDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModuleType, layer: int):
        super().__init__()
        h, moe = config.hidden_size, config.moe
        self.self_attn = Attention(h, attention_spec(config, layer), ops, qkv_bias=config.attention_bias,
                                   o_bias=config.o_proj_bias)
        self.block_sparse_moe = SparseMoeBlock(h, moe.intermediate_size, moe.num_experts, moe.top_k,
                                               moe.renormalize, ops, ("w1", "w3", "w2"))
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin_caches):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin_caches[self.self_attn.spec.rope])
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.block_sparse_moe(hidden), residual


class MixtralForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, ops: ModuleType):
        if config.moe is None:
            raise ValueError("MixtralForCausalLM needs a config with MoE settings (num_local_experts)")
        super().__init__(config, LlamaModel(config, ops, lambda i: MixtralDecoderLayer(config, ops, i)))
