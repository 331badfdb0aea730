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
    expect: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields as loaded

    def build(self):
        import transformers

        cfg = getattr(transformers, self.config_cls)(**{**_COMMON, **self.kwargs})
        return getattr(transformers, self.model_cls)(cfg)


_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)

S, F = "sliding_attention", "full_attention"

FAMILIES = [
    FamilySpec("qwen3", "Qwen3ForCausalLM", "Qwen3Config", "Qwen3ForCausalLM",
               # NOTE: head_dim 32 != 64 / 4: q_proj is wider than hidden, o_proj narrower.
               dict(head_dim=32, tie_word_embeddings=True, rope_theta=1e6),
               expect=dict(head_dim=32, tie_word_embeddings=True, attention_bias=False, sliding_window=None,
                           layer_types=())),
    FamilySpec("mistral-window", "MistralForCausalLM", "MistralConfig", "MistralForCausalLM",
               dict(head_dim=24, sliding_window=8, tie_word_embeddings=False), window=8,
               expect=dict(head_dim=24, sliding_window=8, layer_types=(S, S))),
    FamilySpec("gemma2", "Gemma2ForCausalLM", "Gemma2Config", "Gemma2ForCausalLM",
               # NOTE: caps near the scores' and logits' size, so tanh bends them; layers 0 and 2
               # are local (HF's default alternation), 1 and 3 global.
               dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                    attn_logit_softcapping=3.0, final_logit_softcapping=5.0, rope_theta=10000.0),
               window=8,
               expect=dict(hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=24.0, sliding_window=8,
                           layer_types=(S, F, S, F), attn_logit_softcapping=3.0,
                           final_logit_softcapping=5.0, tie_word_embeddings=True)),
    FamilySpec("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                 "sliding_attention"],
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
               window=8,
               expect=dict(layer_types=(S, S, F, S), rope_theta=1e6, local_rope_theta=1e4,
                           rope_scaling={"rope_type": "linear", "factor": 2.0},
                           attn_logit_softcapping=None, final_logit_softcapping=None)),
    FamilySpec("phi3-longrope-window", "Phi3ForCausalLM", "Phi3Config", "Phi3ForCausalLM",
               # NOTE: prompts + outputs stay under original_max_position_embeddings (64), where
               # HF uses the short factors for every position (see layers/rope.py).
               dict(sliding_window=8, original_max_position_embeddings=64, tie_word_embeddings=False,
                    rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                                  "long_factor": [2.0 + i for i in range(8)]}),
               window=8,
               expect=dict(sliding_window=8, layer_types=(S, S), rope_theta=10000.0)),
]
