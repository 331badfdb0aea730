"""Gemma 3 (text): Gemma 2's layer plus per-head q/k norms ((1 + w) RMSNorm), no attention
soft-cap, one sliding-window layer pattern (default 5 local : 1 global) and a separate RoPE base
for the local layers (rope_local_base_freq; only the global layers' RoPE may be scaled)."""
from __future__ import annotations

from types import ModuleType
from typing import Any

from kvmesh.engine.layers.causal_lm import layer_window
from kvmesh.engine.model_config import ModelConfig
from kvmesh.engine.models.gemma2 import GemmaCausalLM, GemmaDecoderLayer, GemmaModel, gemma_attention_spec


def _layer(config: ModelConfig, ops: ModuleType, i: int) -> GemmaDecoderLayer:
    rope = "local" if layer_window(config, i) else "global"
    return GemmaDecoderLayer(config, ops, gemma_attention_spec(config, i, rope), qk_norm=True)


class Gemma3ForCausalLM(GemmaCausalLM):
    def __init__(self, config: ModelConfig, ops: ModuleType):
        super().__init__(config, GemmaModel(config, lambda i: _layer(config, ops, i)))

    def rope_tables(self) -> dict[str, tuple[float, dict[str, Any] | None]]:
        c = self.config
        return {"global": (c.rope_theta, c.rope_scaling), "local": (c.local_rope_theta or c.rope_theta, None)}
