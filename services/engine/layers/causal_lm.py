"""The skeleton every family shares: embed -> N decoder layers -> final norm -> logits.

A family file (`kvmesh.engine.models.<family>`) builds its decoder layers and final norm and
overrides the few hooks where it differs (`embed`, `final_norm`, `rope_tables`). Every decoder
layer has one signature:

    layer(positions, hidden, residual, kv_cache, meta, cos_sin_caches) -> (hidden, residual)

where `residual` is the running residual stream for families that fuse the residual add into
the next norm (Llama style) and None for those that add it themselves (Gemma).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvmesh.engine.layers.attention import KVCache
from kvmesh.engine.layers.linear import linear
from kvmesh.engine.layers.quantized import QuantizedEmbedding, QuantizedLinear
from kvmesh.engine.layers.rope import build_cos_sin_cache
from kvmesh.engine.model_config import ModelConfig
from kvmesh.kernels.metadata import AttentionMetadata
from kvmesh.kernels.precision import at_least_float32


def layer_window(config: ModelConfig, layer: int) -> int:
    """The sliding window of `layer` (0: full attention), from the config's layer types."""
    if config.layer_types and config.layer_types[layer] == "sliding_attention":
        return int(config.sliding_window or 0)
    return 0


class CausalLM(nn.Module):
    """HF parameter names: `model.embed_tokens`, `model.layers.N...`, `model.norm`, `lm_head`."""

    tp_group = None     # tensor parallelism: lm_head holds a vocabulary shard (parallel/sharding.py)

    def __init__(self, config: ModelConfig, model: nn.Module):
        super().__init__()
        self.config = config
        self.model = model        # has embed_tokens, layers (nn.ModuleList), norm
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # NOTE: float32 whatever the model dtype, and not in the state dict; a model built on the
        # meta device gets real ones from `reset_rope_cache(device)`. `cos_sin_cache` is the
        # "global" table; others are `cos_sin_cache_<name>`.
        for name, table in self._build_rope_caches(None).items():
            self.register_buffer(_buffer_name(name), table, persistent=False)

    # ---- hooks a family may override ----------------------------------------------------------
    def rope_tables(self) -> dict[str, tuple[float, dict[str, Any] | None]]:
        """name -> (theta, scaling) of each cos/sin table the layers use (AttentionSpec.rope)."""
        return {"global": (self.config.rope_theta, self.config.rope_scaling)}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    # ---- shared ------------------------------------------------------------------------------
    def tie_weights(self) -> None:
        """Share embed_tokens' weight with lm_head when the config says so (call after assigning)."""
        if self.config.tie_word_embeddings:
            embed = self.model.embed_tokens
            if isinstance(embed, QuantizedEmbedding):
                # NOTE: a GGUF embedding served as blocks: the head multiplies the same bytes
                self.lm_head = QuantizedLinear.tied_to(embed)
            else:
                self.lm_head.weight = embed.weight

    def _build_rope_caches(self, device) -> dict[str, torch.Tensor]:
        c = self.config
        return {name: build_cos_sin_cache(c.head_dim, theta, scaling, c.max_position_embeddings, device)
                for name, (theta, scaling) in self.rope_tables().items()}

    def reset_rope_cache(self, device: torch.device | str) -> None:
        for name, table in self._build_rope_caches(device).items():
            setattr(self, _buffer_name(name), table)

    def forward(
        self,
        input_ids: torch.Tensor,        # [T] int64, the new tokens of all sequences, packed
        positions: torch.Tensor,        # [T] int64, absolute position of each token
        kv_caches: list[KVCache],       # one (k_cache, v_cache) per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:                  # [T, hidden]
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        tables = {name: getattr(self, _buffer_name(name)) for name in self.rope_tables()}
        hidden = self.embed(input_ids)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, tables)
        return self.final_norm(hidden, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[R, hidden] -> [R, vocab] float32, float64 for a float64 model (R: the rows to sample
        from, e.g. last token per seq).

        Tensor-parallel: the vocabulary shards are gathered on rank 0; other ranks get None."""
        logits = linear(hidden, self.lm_head.weight)
        if self.tp_group is not None:
            logits = self.tp_group.gather_columns(logits, self.config.vocab_size)
            if logits is None:
                return None
        cap = self.config.final_logit_softcapping
        if cap:
            # NOTE: Gemma 2: in the model dtype, as HF does, before the float32 upcast.
            logits = torch.tanh(logits / cap) * cap
        # NOTE: a float64 model keeps its precision up to the log-probs (exact agreement with
        # transformers' float64 forward, tests/engine/test_prompt_logprobs.py)
        return at_least_float32(logits)


def _buffer_name(table: str) -> str:
    return "cos_sin_cache" if table == "global" else f"cos_sin_cache_{table}"
