"""Mistral: the Llama decoder; a config `sliding_window` makes every layer attend to the last
W positions (ModelConfig.layer_types, read by layers.causal_lm.layer_window)."""
from __future__ import annotations

from kvmesh.engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """HF MistralForCausalLM: Llama names, no biases, optional explicit head_dim and window."""
