"""Random tiny Qwen2 / Llama checkpoints saved as HF directories: our loader + model vs transformers."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvmesh.engine.loader import load_model
from kvmesh.engine.model_config import ModelConfig
from kvmesh.engine.models.llama import build_cos_sin_cache
from tiny_models import randomize

VOCAB = 49152  # the SmolLM2 tokenizer's, copied into each directory
PROMPTS = [[1, 9690, 198, 2683, 359, 253, 5356], list(range(100, 141)), [5, 17, 400, 4000, 40000]]


def _save(model, path, copy_tokenizer):
    model.save_pretrained(path)  # safetensors; a tied lm_head is not written
    copy_tokenizer(path)
    return path


def _check_against_hf(path, hf_model, paged_generate, hf_greedy_logits, assert_close_to_scale, new_tokens=12):
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert loaded.name == path.name
    ours = paged_generate(loaded.model, PROMPTS, new_tokens, block_size=4, prefill_chunk=8, seed=3)
    for prompt, got in zip(PROMPTS, ours):
        ref_prompt, ref_tokens, ref_gen = hf_greedy_logits(hf_model, prompt, new_tokens)
        assert got["tokens"] == ref_tokens
        assert_close_to_scale(got["prompt_logits"], ref_prompt)
        assert_close_to_scale(got["gen_logits"], ref_gen)
    return loaded


@pytest.fixture
def tiny_qwen2(tmp_path, copy_tokenizer):
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=256, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    randomize(model, seed=1)
    return _save(model, tmp_path / "tiny-qwen2", copy_tokenizer), model


def test_qwen2_qkv_bias_tied_gqa(tiny_qwen2, paged_generate, hf_greedy_logits, assert_close_to_scale):
    path, hf_model = tiny_qwen2
    assert not (path / "model.safetensors").stat().st_size == 0
    loaded = _check_against_hf(path, hf_model, paged_generate, hf_greedy_logits, assert_close_to_scale)
    c = loaded.config
    assert (c.architecture, c.attention_bias, c.o_proj_bias, c.tie_word_embeddings) == (
        "Qwen2ForCausalLM", True, False, True)
    attn = loaded.model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert loaded.tokenizer.eos_token_ids[0] == 2


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},  # prompts stay inside the original context
], ids=lambda r: r["rope_type"])
def test_llama_rope_scaling_untied_mqa(tmp_path, copy_tokenizer, rope, paged_generate, hf_greedy_logits,
                                       assert_close_to_scale):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                      max_position_embeddings=128, rope_theta=50000.0, rope_scaling=dict(rope),
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    randomize(model, seed=2)
    path = _save(model, tmp_path / f"tiny-llama-{rope['rope_type']}", copy_tokenizer)
    loaded = _check_against_hf(path, model, paged_generate, hf_greedy_logits, assert_close_to_scale)
    c = loaded.config
    assert c.rope_scaling["rope_type"] == rope["rope_type"] and c.rope_theta == 50000.0
    assert c.num_key_value_heads == 1 and not c.tie_word_embeddings
    assert loaded.model.lm_head.weight is not loaded.model.model.embed_tokens.weight


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "dynamic", "factor": 2.0},
], ids=lambda r: (r or {}).get("rope_type", "default"))
def test_cos_sin_cache_is_bit_identical_to_hf(rope):
    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=512,
                         rope_theta=500000.0, rope_scaling=dict(rope) if rope else None)
    config = ModelConfig.from_hf_config(hf_cfg.to_dict())
    cache = build_cos_sin_cache(config)
    rotary = LlamaRotaryEmbedding(hf_cfg)
    x = torch.zeros(1, dtype=torch.float32)
    pos = torch.arange(512)[None]
    cos, sin = rotary(x, pos)
    half = config.head_dim // 2
    assert cache.shape[1] == config.head_dim
    assert torch.equal(cache[:512, :half], cos[0, :, :half])
    assert torch.equal(cache[:512, half:], sin[0, :, :half])
    if rope and rope["rope_type"] == "dynamic":
        # beyond the original context: each position uses the theta HF picks for a sequence ending there
        long = torch.arange(700)[None]
        cos, sin = LlamaRotaryEmbedding(hf_cfg)(x, long)
        assert cache.shape[0] == 1024
        assert torch.allclose(cache[699, :half], cos[0, 699, :half], atol=1e-6)
        assert torch.allclose(cache[699, half:], sin[0, 699, :half], atol=1e-6)


def test_bfloat16_load_keeps_rope_cache_float32(tiny_qwen2, paged_generate):
    path, _ = tiny_qwen2
    loaded = load_model(str(path), dtype="bfloat16", device="cpu")
    assert loaded.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert loaded.model.cos_sin_cache.dtype == torch.float32
    ref = load_model(str(path), dtype="float32", device="cpu")
    got = paged_generate(loaded.model, PROMPTS[:1], 1)[0]["prompt_logits"]
    want = paged_generate(ref.model, PROMPTS[:1], 1)[0]["prompt_logits"]
    assert got.dtype == torch.float32  # compute_logits upcasts
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())
