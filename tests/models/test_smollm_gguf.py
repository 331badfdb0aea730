"""The built-in SmolLM2 GGUF: our loader + paged forward vs transformers loading the same file."""
from __future__ import annotations

import torch


NEW_TOKENS = 20
TEXT_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def test_builtin_load_result(smollm, builtin_path):
    c = smollm.config
    assert smollm.name == "SmolLM2-135M-Instruct"
    assert smollm.path == builtin_path
    assert (smollm.dtype, smollm.device.type) == (torch.float32, "cpu")
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (
        "LlamaForCausalLM", 30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.rope_scaling, c.tie_word_embeddings) == (49152, 100000.0, None, True)
    assert 2 in c.eos_token_ids and 2 in smollm.tokenizer.eos_token_ids
    model = smollm.model
    assert not model.training
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert model.cos_sin_cache.dtype == torch.float32


def test_weights_identical_to_transformers(smollm, hf_smollm):
    """Dequantization and the inverse Q/K permutation reproduce transformers' tensors exactly."""
    ref = hf_smollm.state_dict()
    ours = dict(smollm.model.named_parameters())
    assert set(ours) == set(ref) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name


def test_paged_generation_matches_transformers(smollm, hf_smollm, chat_prompts, paged_generate, hf_greedy_logits,
                                              assert_close_to_scale):
    tok = smollm.tokenizer
    prompts = [tok.apply_chat_template(m) for m in chat_prompts] + [tok.encode(TEXT_PROMPT)]
    # NOTE: chunk 16 < prompt lengths (~30-45), so steps mix prefill chunks with decodes.
    ours = paged_generate(smollm.model, prompts, NEW_TOKENS, block_size=16, prefill_chunk=16)
    for prompt, got in zip(prompts, ours):
        ref_prompt_logits, ref_tokens, ref_gen_logits = hf_greedy_logits(hf_smollm, prompt, NEW_TOKENS)
        assert got["tokens"] == ref_tokens, (tok.decode(got["tokens"]), tok.decode(ref_tokens))
        assert_close_to_scale(got["prompt_logits"], ref_prompt_logits)
        assert_close_to_scale(got["gen_logits"], ref_gen_logits)
    answer = tok.decode(ours[0]["tokens"], skip_special_tokens=True)
    assert "Paris" in answer


def test_bfloat16_logits_within_bf16_tolerance_of_transformers_bf16(builtin_path, hf_smollm, chat_prompts,
                                                                    paged_generate, hf_greedy_logits):
    """kvmesh in bfloat16 (the C++ kernels where this CPU builds them) beside transformers' bf16
    forward of the same GGUF: prompt logits (prefill chunks mixed with decodes) close to it, and no
    further from the float32 truth than transformers' own bf16 logits are."""
    from transformers import AutoModelForCausalLM

    from kvmesh.engine.loader import load_model
    ours = load_model(None, dtype="bfloat16", device="cpu", quantization="none")     # the dense bf16 path
    assert all(p.dtype == torch.bfloat16 for p in ours.model.parameters())
    hf16 = AutoModelForCausalLM.from_pretrained(str(builtin_path.parent), gguf_file=builtin_path.name,
                                                dtype=torch.bfloat16).eval()
    tok = ours.tokenizer
    prompts = [tok.apply_chat_template(chat_prompts[0]), tok.encode(TEXT_PROMPT)]
    got = paged_generate(ours.model, prompts, 1, block_size=16, prefill_chunk=16)
    for prompt, g in zip(prompts, got):
        ref16, _, _ = hf_greedy_logits(hf16, prompt, 1)
        ref32, _, _ = hf_greedy_logits(hf_smollm, prompt, 1)
        ours_logits = g["prompt_logits"]
        assert ours_logits.dtype == torch.float32          # logits upcast for sampling
        scale = float(ref32.abs().max())
        ours_err = float((ours_logits - ref32).abs().mean())
        hf_err = float((ref16 - ref32).abs().mean())
        # bf16 keeps 8 bits of mantissa: over 30 layers transformers' own bf16 logits sit ~4 %
        # of the logit scale (max) from its float32 ones; ours are held to the same distance
        assert float((ours_logits - ref16).abs().max()) <= 0.08 * scale
        assert ours_err <= 1.5 * hf_err, (ours_err, hf_err)
        agree = float((ours_logits.argmax(-1) == ref16.argmax(-1)).float().mean())
        assert agree >= 0.9, agree
