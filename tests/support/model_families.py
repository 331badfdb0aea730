"""Tiny random checkpoints of every supported family, one spec each, for tests/models/test_families.py.

A spec names the transformers config and model classes and the config kwargs that exercise the
family's peculiarities (explicit head_dim, q/k norms, windows, soft-caps, fused weights, RoPE
scaling). The model is float32, seeded, 2-4 layers of hidden 64 over a 512-token vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VOCAB = 512   # ids below 512 are real tokens of the SmolLM2 tokenizer copied beside the weights


@dataclass(frozen=True)
class FamilySpec:
    id: str                         # pytest id
    architecture: str               # what ModelConfig must read back
    config_cls: str                 # transformers class names
    model_cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    window: int = 0                 # the sliding window the spec sets (0: none); prompts outgrow it

    def build(self):
        import transformers

        cfg = getattr(transformers, self.config_cls)(**{**_COMMON, **self.kwargs})
        return getattr(transformers, self.model_cls)(cfg)


_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILIES = [
    FamilySpec("qwen3", "Qwen3ForCausalLM", "Qwen3Config", "Qwen3ForCausalLM",
               # NOTE: head_dim 32 != 64 / 4: q_proj is wider than hidden, o_proj narrower.
               dict(head_dim=32, tie_word_embeddings=True, rope_theta=1e6)),
]
