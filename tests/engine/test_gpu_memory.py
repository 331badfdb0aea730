"""The KV cache's share of a GPU (vLLM's --gpu-memory-utilization arithmetic), with the device's
numbers given: no GPU here."""
from __future__ import annotations

import pytest

from kvmesh.engine.gpu_memory import DeviceMemory, kv_cache_bytes

GIB = 1 << 30


def test_the_kv_cache_gets_the_rest_of_the_budget():
    # an 80 GiB device at 0.9: 72 GiB; 16 GiB in use (15 of weights), 2 GiB of activations,
    # 1 GiB of graphs: 53 GiB for the KV cache
    mem = DeviceMemory(total=80 * GIB, in_use=16 * GIB, weights=15 * GIB,
                       activation_peak=2 * GIB, graph_pool=1 * GIB)
    assert kv_cache_bytes(mem, 0.9) == 72 * GIB - 19 * GIB
    assert kv_cache_bytes(mem, 0.5) == 40 * GIB - 19 * GIB


def test_an_8b_model_on_80_gb_holds_over_300k_tokens():
    # Llama-3-8B shape in bf16: 32 layers x 2 x 8 KV heads x 128 x 2 bytes = 128 KiB per token
    per_token = 32 * 2 * 8 * 128 * 2
    mem = DeviceMemory(total=80 * 10**9, in_use=16_600_000_000, weights=16_060_000_000,
                       activation_peak=1_500_000_000, graph_pool=700_000_000)
    assert kv_cache_bytes(mem, 0.9) == 53_200_000_000      # 72e9 - 16.6e9 - 1.5e9 - 0.7e9
    assert kv_cache_bytes(mem, 0.9) // per_token == 405_883


def test_nothing_left_says_what_to_change():
    mem = DeviceMemory(total=10 * GIB, in_use=8 * GIB, weights=7 * GIB,
                       activation_peak=GIB, graph_pool=GIB // 2)
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization.*--num-kv-blocks"):
        kv_cache_bytes(mem, 0.9)


def test_the_engine_sizes_a_cuda_cache_from_the_profile(smollm, monkeypatch):
    """The engine's CUDA branch: the profile's numbers in, blocks out (the profile run itself
    needs a GPU: it is replaced here, and the device is reported as cuda)."""
    import dataclasses

    import torch

    from kvmesh.common.config import EngineConfig
    from kvmesh.engine import engine as engine_mod

    seen = {}

    def fake_profile(model, num_layers, block_size, kv_heads, head_dim, dtype, device,
                     max_num_tokens, max_num_seqs, largest_graph):
        seen.update(tokens=max_num_tokens, seqs=max_num_seqs, graph=largest_graph, dtype=dtype)
        return DeviceMemory(total=4 * GIB, in_use=GIB, weights=GIB // 2,
                            activation_peak=GIB // 4, graph_pool=GIB // 4)

    monkeypatch.setattr(engine_mod, "profile_device_memory", fake_profile)
    eng = engine_mod.LLMEngine.__new__(engine_mod.LLMEngine)
    eng.config = EngineConfig(max_num_seqs=16, max_model_len=1 << 20, max_num_batched_tokens=512,
                              gpu_memory_utilization=0.5)
    eng.loaded = dataclasses.replace(smollm, device=torch.device("cuda"), attention_backend="triton")
    eng.executor = None
    eng.lora = None
    eng.block_bytes = 1 << 20
    eng.cache_dtype = torch.float8_e4m3fn         # the profile runs with the cache's dtype
    assert eng._num_gpu_blocks() == (2 * GIB - GIB - GIB // 2) // (1 << 20)
    assert seen == {"tokens": 512, "seqs": 16, "graph": 16, "dtype": torch.float8_e4m3fn}
