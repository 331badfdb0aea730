"""Mixtral: Llama attention with a sparse mixture-of-experts MLP in every layer.

    embed -> N x [ rms_norm -> LlamaAttention (paged)
                   (+res) rms_norm -> block_sparse_moe: router -> softmax -> top-k, renormalised
                                      -> sum_k w_k * w2_e(silu(w1_e(x)) * w3_e(x)) ] -> (+res) rms_norm -> lm_head

HF parameter names (`model.layers.N.block_sparse_moe.gate.weight`,
`...block_sparse_moe.experts.E.w1.weight`), so an HF checkpoint loads as is. Attention, norms,
RoPE, forward and logits are Llama's; only the decoder layer's MLP differs.
"""
from __future__ import annotations

from types import ModuleType

from torch import nn

from kvmesh.engine.model_config import ModelConfig
from kvmesh.engine.models.llama import LlamaAttention, LlamaForCausalLM, RMSNorm, build_cos_sin_cache
from kvmesh.engine.models.moe import SparseMoeBlock


class MixtralDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModuleType):
        super().__init__()
        moe = config.moe
        self.self_attn = LlamaAttention(config, ops)
        self.block_sparse_moe = SparseMoeBlock(config.hidden_size, moe.intermediate_size, moe.num_experts,
                                               moe.top_k, moe.renormalize, ops, ("w1", "w3", "w2"))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin_cache):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.block_sparse_moe(hidden), residual


class MixtralModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModuleType):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MixtralDecoderLayer(config, ops) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral with HF parameter names; forward, logits and weight tying are Llama's."""

    def __init__(self, config: ModelConfig, ops: ModuleType):
        if config.moe is None:
            raise ValueError("MixtralForCausalLM needs a config with MoE settings (num_local_experts)")
        # NOTE: nn.Module's __init__, not Llama's: Llama's would build dense decoder layers
        # (and their full-size MLP weights) only for them to be replaced.
        nn.Module.__init__(self)
        self.config = config
        self.model = MixtralModel(config, ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(config), persistent=False)
