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
from kvmesh.engine.models.llama import LlamaDecoderLayer, LlamaModel, attention_spec


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer with `block_sparse_moe` in place of `mlp` (HF's names)."""

    def __init__(self, config: ModelConfig, ops: ModuleType, layer: int):
        # NOTE: nn.Module's init, not Llama's: this layer has no dense `mlp` to build or load.
        nn.Module.__init__(self)
        h, moe = config.hidden_size, config.moe
        self.self_attn = Attention(h, attention_spec(config, layer), ops, qkv_bias=config.attention_bias,
                                   o_bias=config.o_proj_bias)
        self.block_sparse_moe = SparseMoeBlock(h, moe.intermediate_size, moe.num_experts, moe.top_k,
                                               moe.renormalize, ops, ("w1", "w3", "w2"))
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, ops)

    def feed_forward(self, hidden):
        return self.block_sparse_moe(hidden)


class MixtralForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, ops: ModuleType):
        if config.moe is None:
            raise ValueError("MixtralForCausalLM needs a config with MoE settings (num_local_experts)")
        super().__init__(config, LlamaModel(config, ops, lambda i: MixtralDecoderLayer(config, ops, i)))
