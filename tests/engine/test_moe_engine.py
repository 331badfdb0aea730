"""Tiny random mixture-of-experts models (Mixtral, Qwen3-MoE) saved as HF directories by the test:
the whole engine's greedy output equals transformers' (float32) token for token on 12 prompts of
mixed lengths, under chunked prefill, prefix caching and preemption (recompute and swap)."""
from __future__ import annotations

import random

import pytest
import torch
from tiny_models import save_tiny_model
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.loader import load_model
from kvmesh.engine.sampling_params import SamplingParams

NEW_TOKENS = 10
VOCAB = 320


def _mixtral():
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                        num_experts_per_tok=2, max_position_embeddings=512, rope_theta=10000.0,
                        bos_token_id=1, eos_token_id=2)
    return MixtralForCausalLM(cfg)


def _qwen3_moe():
    # layer 0 dense (mlp_only_layers), layer 1 sparse; explicit head_dim != hidden / heads
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[0], max_position_embeddings=512, rope_theta=10000.0,
                         bos_token_id=1, eos_token_id=2)
    return Qwen3MoeForCausalLM(cfg)


FAMILIES = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = FAMILIES[request.param]().eval()
    path = save_tiny_model(hf, tmp_path_factory.mktemp("models") / f"tiny-{request.param}")
    loaded = load_model(str(path), dtype="float32", device="cpu")
    return request.param, hf, loaded


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    shared = [rng.randrange(3, VOCAB) for _ in range(24)]
    out = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 3, 8, 13, 21, 40, 70)]
    out += [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 4, 9, 16, 30)]
    return out


@pytest.fixture(scope="module")
def expected(family, prompts, greedy_reference):
    _, hf, _ = family
    return [greedy_reference(hf, p, NEW_TOKENS) for p in prompts]


def run(engine, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    done, cached, preempted = {}, 0, {"recompute": 0, "swap": 0}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
                cached += out.num_cached_tokens
        preempted["recompute"] += engine.last_stats.num_preempted_recompute
        preempted["swap"] += engine.last_stats.num_preempted_swap
    engine.kv_manager.check_invariants([])
    return [done[f"q{i}"] for i in range(len(prompts))], cached, preempted


@pytest.mark.parametrize("cfg", [
    {"max_num_batched_tokens": 20, "block_size": 4},
    {"num_kv_blocks": 16, "max_model_len": 128, "block_size": 8, "preemption_mode": "recompute"},
    {"num_kv_blocks": 16, "max_model_len": 128, "block_size": 8, "preemption_mode": "swap",
     "swap_space": 0.01},
], ids=["chunked-prefix-cache", "recompute", "swap"])
def test_moe_engine_matches_transformers(family, prompts, expected, cfg):
    name, _, loaded = family
    assert loaded.config.moe is not None
    assert loaded.config.architecture == {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[name]
    cfg.setdefault("num_kv_blocks", 256)
    out, cached, preempted = run(LLMEngine(EngineConfig(**cfg), loaded=loaded), prompts)
    mode = cfg.get("preemption_mode")
    if mode is None:
        assert cached > 0                     # the shared prefix was served from the cache
    else:                                     # only the configured kind of preemption happened
        other = "swap" if mode == "recompute" else "recompute"
        assert preempted[mode] > 0 and preempted[other] == 0, preempted
    assert out == expected
