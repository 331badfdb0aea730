"""A randomly initialised Qwen2-style model (QKV bias, tied embeddings, GQA), saved as an HF
directory by the test: the whole engine's greedy output equals transformers' on 16 prompts."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.loader import load_model
from kvmesh.engine.sampling_params import SamplingParams

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, smollm):
    cfg = Qwen2Config(vocab_size=smollm.config.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True, max_position_embeddings=512, rope_theta=10000.0,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():   # HF inits biases to 0 and norms to 1: make every tensor matter
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    path = tmp_path_factory.mktemp("models") / "tiny-qwen2"
    model.save_pretrained(path)
    smollm.tokenizer.hf.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def qwen2(qwen2_dir):
    path, _ = qwen2_dir
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert loaded.config.attention_bias and loaded.config.tie_word_embeddings
    assert loaded.config.num_key_value_heads == 2
    return loaded


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    shared = [rng.randrange(3, 40000) for _ in range(40)]
    out = [[rng.randrange(3, 40000) for _ in range(n)] for n in (1, 2, 5, 9, 16, 17, 31, 33, 64, 100)]
    out += [shared + [rng.randrange(3, 40000) for _ in range(n)] for n in (1, 3, 8, 15, 16, 29)]
    return out


@pytest.fixture(scope="module")
def expected(qwen2_dir, prompts, greedy_reference):
    _, hf = qwen2_dir
    return [greedy_reference(hf, p, NEW_TOKENS) for p in prompts]


def run(engine, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    done, preempted = {}, {"recompute": 0, "swap": 0}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        preempted["recompute"] += engine.last_stats.num_preempted_recompute
        preempted["swap"] += engine.last_stats.num_preempted_swap
    engine.kv_manager.check_invariants([])
    return [done[f"q{i}"] for i in range(len(prompts))], preempted


@pytest.mark.parametrize("cfg", [
    {},
    {"max_num_batched_tokens": 20, "block_size": 4},
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_model_len": 512},
    {"enable_prefix_caching": False},
    {"num_kv_blocks": 12, "max_model_len": 192, "preemption_mode": "recompute"},
    {"num_kv_blocks": 12, "max_model_len": 192, "preemption_mode": "swap", "swap_space": 0.01},
], ids=["default", "chunked-small-budget", "chunked-off", "no-prefix-cache", "recompute", "swap"])
def test_qwen2_engine_matches_transformers(qwen2, prompts, expected, cfg):
    cfg.setdefault("num_kv_blocks", 256)
    out, preempted = run(LLMEngine(EngineConfig(**cfg), loaded=qwen2), prompts)
    mode = cfg.get("preemption_mode")
    if mode is not None:                 # only the configured kind of preemption happened
        other = "swap" if mode == "recompute" else "recompute"
        assert preempted[mode] > 0 and preempted[other] == 0, preempted
    assert out == expected
