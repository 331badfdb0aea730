"""ModelConfig for the newer families: HF's config variants read exactly, bad options named."""
from __future__ import annotations

import pytest

from kvmesh.engine.model_config import ModelConfig

BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
            vocab_size=512, intermediate_size=96)
S, F = "sliding_attention", "full_attention"


def cfg(arch: str, **kw) -> ModelConfig:
    return ModelConfig.from_hf_config({"architectures": [arch], **BASE, **kw})


def test_gemma3_legacy_config_fields():
    """google/gemma-3-1b-it style: rope_theta + rope_local_base_freq + sliding_window_pattern."""
    c = cfg("Gemma3ForCausalLM", num_hidden_layers=7, sliding_window=512, sliding_window_pattern=6,
            rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
            hidden_act="gelu", hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256)
    assert c.layer_types == (S, S, S, S, S, F, S)
    assert (c.rope_theta, c.local_rope_theta, c.rope_scaling) == (1e6, 1e4, {"rope_type": "linear", "factor": 8.0})
    assert (c.hidden_act, c.head_dim, c.tie_word_embeddings) == ("gelu_pytorch_tanh", 256, True)
    assert (c.attn_logit_softcapping, c.final_logit_softcapping, c.query_pre_attn_scalar) == (None, None, 256.0)


def test_gemma2_defaults_alternate_and_cap():
    c = cfg("Gemma2ForCausalLM", sliding_window=4096, head_dim=16)
    assert c.layer_types == (S, F, S, F) and c.sliding_window == 4096
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)


def test_qwen_windows_only_with_use_sliding_window():
    assert cfg("Qwen3ForCausalLM", sliding_window=4096, max_window_layers=2).layer_types == ()
    c = cfg("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert c.layer_types == (F, F, S, S) and c.sliding_window == 16


def test_mistral_without_window_is_full_attention():
    c = cfg("MistralForCausalLM", sliding_window=None)
    assert (c.sliding_window, c.layer_types) == (None, ())


def test_phi3_su_is_longrope_with_outer_original_max():
    factors = [1.0] * 8
    c = cfg("Phi3ForCausalLM", max_position_embeddings=1024, original_max_position_embeddings=128,
            rope_scaling={"type": "su", "short_factor": factors, "long_factor": factors})
    assert c.rope_scaling == {"rope_type": "longrope", "short_factor": factors, "long_factor": factors,
                              "original_max_position_embeddings": 128}


@pytest.mark.parametrize("arch,kw,match", [
    ("Gemma3ForCausalLM", dict(layer_types=[S, "chunked_attention", F, S], sliding_window=8),
     r"unsupported layer type\(s\) 'chunked_attention' for Gemma3ForCausalLM"),
    ("Gemma3ForCausalLM", dict(layer_types=[S, F], sliding_window=8), "layer_types has 2 entries for 4 layers"),
    ("MistralForCausalLM", dict(sliding_window=0), "sliding_window must be a positive number of tokens"),
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("Gemma2ForCausalLM", dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping must be positive"),
    ("Phi3ForCausalLM", dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 3,
                                            "long_factor": [1.0] * 8}),
     "short_factor has 3 entries, head_dim 16 needs 8"),
    ("Phi3ForCausalLM", dict(partial_rotary_factor=0.75), "partial_rotary_factor"),
    ("Gemma3ForCausalLM", dict(rope_parameters={"full_attention": {"rope_type": "default"},
                                                "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "RoPE scaling 'linear' on sliding-window layers is not supported"),
    ("Qwen3ForCausalLM", dict(hidden_act="relu"), r"unsupported hidden_act 'relu' for Qwen3ForCausalLM"),
])
def test_unsupported_options_are_named(arch, kw, match):
    with pytest.raises(ValueError, match=match):
        cfg(arch, **kw)


def test_model_type_without_architectures():
    c = ModelConfig.from_hf_config({"model_type": "gemma3_text", **BASE})
    assert c.architecture == "Gemma3ForCausalLM"
