"""A GQA model in bfloat16 against itself in float32, on the CPU and (where there is one) a CUDA GPU.

On CUDA a bf16 prefill runs two attention routes: fresh chunks on torch's flash attention
(kernels/flash_prefill.py: varlen_attn, whose keywords differ between torch releases) and chunks
after a cached prefix on the Triton unified kernel; decodes on the paged decode kernel. Prompts of
120 / 100 / 90 tokens in chunks of 64 take both prefill routes, then four decode steps.
Measured on this model (CPU): bf16 rounding moves the log-probs by 0.066 on average (max 0.54);
the same float32 model with its prefill attention stripped of the causal mask, by 1.8-2.0 (max
7.6). The bounds sit between.
"""
from __future__ import annotations

import os

import pytest
import torch

from kvmesh.engine.loader import load_model
from tests.models.conftest import prompt_logprob_diffs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "0",
                                reason="needs a CUDA GPU and TRITON_INTERPRET=0 (the Triton kernels)")


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny_models import save_tiny_model
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return save_tiny_model(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("gqa"), seed=4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_bf16_matches_float32_through_every_attention_route(device, gqa_dir, paged_generate):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (120, 100, 90)]
    ref_model = load_model(str(gqa_dir), "float32", device="cpu", load_tokenizer=False).model
    model = load_model(str(gqa_dir), "bfloat16", device=device, load_tokenizer=False).model
    ref = paged_generate(ref_model, prompts, 4, block_size=16, prefill_chunk=64, seed=1)
    got = paged_generate(model, prompts, 4, block_size=16, prefill_chunk=64, seed=1)
    diffs = [prompt_logprob_diffs(got, ref, prompts)]
    for a, b in zip(got, ref):
        # the decode steps too: each step's log-probs of the reference's greedy token
        ga = torch.as_tensor(a["gen_logits"]).double().log_softmax(-1)
        gb = torch.as_tensor(b["gen_logits"]).double().log_softmax(-1)
        top = gb.argmax(-1, keepdim=True)
        diffs.append((ga.gather(1, top) - gb.gather(1, top)).abs().flatten())
    diff = torch.cat(diffs)
    print(f"bf16 on {device} vs float32: mean |log-prob difference| {diff.mean().item():.2e} "
          f"(max {diff.max().item():.2e}) over {diff.numel()} positions")
    assert diff.numel() == 307 + 12
    assert diff.mean().item() < 0.2 and diff.max().item() < 2.0
