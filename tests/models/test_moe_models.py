"""Mixture-of-experts families: config parsing, the stacked expert weights, logits against transformers."""
from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_model
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from kvmesh.engine.loader import load_model
from kvmesh.engine.model_config import ModelConfig

PROMPTS = [[1, 5, 17, 200, 31, 9, 44], list(range(100, 141)), [7]]


def _base(**kw):
    return {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 300,
            "intermediate_size": 96, **kw}


@pytest.mark.parametrize("cfg,want", [
    (_base(architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2),
     (8, 2, 96, True, (0, 1, 2, 3))),
    (_base(model_type="mixtral", num_local_experts=4, num_experts_per_tok=1), (4, 1, 96, True, (0, 1, 2, 3))),
    (_base(architectures=["Qwen3MoeForCausalLM"], num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
           norm_topk_prob=True), (16, 4, 32, True, (0, 1, 2, 3))),
    (_base(model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
           decoder_sparse_step=2), (16, 4, 32, False, (1, 3))),
    (_base(architectures=["Qwen3MoeForCausalLM"], num_local_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3]), (8, 2, 32, False, (1,))),
    (_base(architectures=["Qwen3MoeForCausalLM"], num_experts=0, num_experts_per_tok=2), (0, 2, 96, False, ())),
])
def test_moe_config_parsing(cfg, want):
    moe = ModelConfig.from_hf_config(cfg).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize, moe.sparse_layers) == want


def test_dense_families_have_no_moe_config():
    assert ModelConfig.from_hf_config(_base(architectures=["LlamaForCausalLM"])).moe is None


@pytest.mark.parametrize("cfg,match", [
    (_base(architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=5), "between 1"),
    (_base(architectures=["MixtralForCausalLM"], num_experts_per_tok=2), "num_experts"),
])
def test_bad_moe_configs_fail_at_load(cfg, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(cfg)


@pytest.mark.parametrize("arch,use,want", [
    ("MixtralForCausalLM", None, 128),       # Mixtral: a sliding_window applies to every layer
    ("Qwen3MoeForCausalLM", False, None),    # Qwen3-MoE: only with use_sliding_window
    ("Qwen3MoeForCausalLM", True, 128),
])
def test_moe_sliding_window_follows_hf(arch, use, want):
    extra = {} if use is None else {"use_sliding_window": use}
    c = ModelConfig.from_hf_config(_base(architectures=[arch], num_experts=4, num_experts_per_tok=2,
                                         sliding_window=128, max_position_embeddings=4096, **extra))
    assert c.sliding_window == want
    assert c.layer_types == (("sliding_attention",) * 4 if want else ())


@pytest.fixture
def tiny_mixtral(tmp_path):
    cfg = MixtralConfig(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                        tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = MixtralForCausalLM(cfg)
    return save_tiny_model(hf, tmp_path / "tiny-mixtral", seed=4), hf


def test_mixtral_logits_match_transformers(tiny_mixtral, paged_generate, hf_greedy_logits, assert_close_to_scale):
    path, hf = tiny_mixtral
    loaded = load_model(str(path), dtype="float32", device="cpu")
    ours = paged_generate(loaded.model, PROMPTS, 8, block_size=4, prefill_chunk=8, seed=5)
    for prompt, got in zip(PROMPTS, ours):
        ref_prompt, ref_tokens, ref_gen = hf_greedy_logits(hf, prompt, 8)
        assert got["tokens"] == ref_tokens
        assert_close_to_scale(got["prompt_logits"], ref_prompt)
        assert_close_to_scale(got["gen_logits"], ref_gen)
    # the experts' parameters are views of the two stacked buffers the kernels read
    moe = loaded.model.model.layers[1].block_sparse_moe
    w13, w2 = moe.stacked_weights()
    assert w13.shape == (4, 96, 64) and w2.shape == (4, 64, 48)
    e2 = moe.experts[2]
    assert e2.w1.weight.data_ptr() == w13[2].data_ptr() and e2.w2.weight.data_ptr() == w2[2].data_ptr()
    assert e2.w3.weight.data_ptr() == w13[2, 48:].data_ptr()
    assert moe.stacked_weights()[0] is w13                  # built once
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight


def test_mixtral_on_the_triton_backend(tiny_mixtral, paged_generate, assert_close_to_scale):
    """Every op through the Triton kernels (the interpreter here), fused MoE included."""
    path, _ = tiny_mixtral
    ref = load_model(str(path), dtype="float32", device="cpu", attention_backend="reference")
    tri = load_model(str(path), dtype="float32", device="cpu", attention_backend="triton")
    assert tri.attention_backend == "triton"
    want = paged_generate(ref.model, PROMPTS[:2], 2, block_size=16, prefill_chunk=32)
    got = paged_generate(tri.model, PROMPTS[:2], 2, block_size=16, prefill_chunk=32)
    for g, w in zip(got, want):
        assert g["tokens"] == w["tokens"]
        assert_close_to_scale(g["prompt_logits"], w["prompt_logits"])


def test_qwen3_moe_logits_match_transformers(tmp_path, paged_generate, hf_greedy_logits, assert_close_to_scale):
    """4 layers: layer 1 dense (mlp_only_layers), 0 / 2 / 3 sparse; top-k weights not renormalised;
    explicit head_dim (32) with 4 heads on hidden 64; MQA."""
    cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                         num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1],
                         decoder_sparse_step=1, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(cfg)
    path = save_tiny_model(hf, tmp_path / "tiny-qwen3-moe", seed=6)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    layers = loaded.model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["SparseMoeBlock", "GatedMLP", "SparseMoeBlock",
                                                              "SparseMoeBlock"]
    assert not layers[0].mlp.renormalize and layers[0].mlp.top_k == 3 and loaded.config.head_dim == 32
    ours = paged_generate(loaded.model, PROMPTS, 8, block_size=4, prefill_chunk=8, seed=7)
    for prompt, got in zip(PROMPTS, ours):
        ref_prompt, ref_tokens, ref_gen = hf_greedy_logits(hf, prompt, 8)
        assert got["tokens"] == ref_tokens
        assert_close_to_scale(got["prompt_logits"], ref_prompt)
        assert_close_to_scale(got["gen_logits"], ref_gen)
