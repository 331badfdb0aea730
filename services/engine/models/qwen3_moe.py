"""Qwen3-MoE: Qwen3's decoder layer (per-head q/k RMSNorm, explicit head_dim) with sparse MoE MLPs.

    embed -> N x [ rms_norm -> attention with q_norm / k_norm -> (+res) rms_norm -> mlp ]
           -> (+res) rms_norm -> lm_head

    mlp = SparseMoeBlock (router -> softmax -> top-k -> renormalise if norm_topk_prob) on the
          layers in ModelConfig.moe.sparse_layers (HF: not in mlp_only_layers and
          (i + 1) % decoder_sparse_step == 0), the dense gated MLP (intermediate_size) elsewhere.

No shared expert (that is Qwen2-MoE). HF parameter names (`model.layers.N.mlp.gate.weight`,
`model.layers.N.mlp.experts.E.gate_proj.weight`, `...self_attn.q_norm.weight`).
"""
from __future__ import annotations

from types import ModuleType

from torch import nn

from kvmesh.engine.layers.causal_lm import CausalLM
from kvmesh.engine.layers.moe import SparseMoeBlock
from kvmesh.engine.model_config import ModelConfig
from kvmesh.engine.models.llama import LlamaModel
from kvmesh.engine.models.qwen3 import qwen3_decoder_layer


def qwen3_moe_decoder_layer(config: ModelConfig, ops: ModuleType, layer: int) -> nn.Module:
    decoder = qwen3_decoder_layer(config, ops, layer)
    moe = config.moe
    if layer in moe.sparse_layers:
        # NOTE: HF Qwen3-MoE rounds the routing weights to the model dtype (round_weights).
        decoder.mlp = SparseMoeBlock(config.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k,
                                     moe.renormalize, ops, round_weights=True)
    return decoder


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, ops: ModuleType):
        if config.moe is None:
            raise ValueError("Qwen3MoeForCausalLM needs a config with MoE settings (num_experts)")
        super().__init__(config, LlamaModel(config, ops, lambda i: qwen3_moe_decoder_layer(config, ops, i)))
