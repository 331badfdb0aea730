"""The LoRA slots' memory comes out of the KV cache's budget: their exact bytes on the tiny Llama,
the CPU rule's blocks with and without them, the GPU rule's message and log naming them."""
from __future__ import annotations

import logging

import pytest

from kvmesh.engine import engine as engine_mod
from kvmesh.engine.gpu_memory import DeviceMemory, kv_cache_bytes, log_kv_budget
from kvmesh.engine.llm import LLM
from kvmesh.engine.lora.memory import slot_bytes

MIB = 1 << 20
# The tiny Llama (tests/support/lora_adapters.py): hidden 64, intermediate 96, 2 layers, 4 heads
# and 2 KV heads of 16. Per layer and slot, parts x R x (in + out) elements:
#   q/k/v 3R x (64 + 128), o R x (64 + 64), gate/up 2R x (64 + 192), down R x (96 + 64)
PER_LAYER_PER_R = 3 * 192 + 128 + 2 * 256 + 160          # 1376
SLOTS_2_RANK_16_F32 = 2 * 16 * PER_LAYER_PER_R * 2 * 4    # 2 slots, R 16, 2 layers, 4 bytes: 352,256


def _engine(base, monkeypatch, **lora):
    # 8 MiB free, half of it the KV cache's; no packed weight copies: the numbers are exact
    monkeypatch.setattr(engine_mod, "free_memory", lambda device: 8 * MIB)
    monkeypatch.setattr(engine_mod, "packed_copy_bytes", lambda model: 0)
    return LLM(str(base), dtype="float32", device="cpu", block_size=4, max_num_seqs=256,
               kv_cache_memory_fraction=0.5, **lora).engine


def test_the_slots_bytes_are_every_sites_a_and_b(llama_base, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="kvmesh.engine")
    eng = _engine(llama_base, monkeypatch, enable_lora=True, max_loras=2, max_lora_rank=16)
    assert slot_bytes(eng.lora.targets) == SLOTS_2_RANK_16_F32 == 352_256
    # a block: 2 layers x K and V x 4 tokens x 2 heads x 16 x 4 bytes = 2,048 bytes
    assert eng.block_bytes == 2048
    assert eng.kv_manager.num_gpu_blocks == (4 * MIB - 352_256) // 2048 == 1876
    assert "LoRA slots: 0.3 MiB (--max-loras 2 x --max-lora-rank 16, every site's A and B) taken " \
           "from the KV cache's 4.0 MiB -> 1876 blocks" in caplog.text


def test_without_lora_the_cache_takes_the_whole_share(llama_base, monkeypatch):
    eng = _engine(llama_base, monkeypatch)
    assert eng.lora is None
    assert eng.kv_manager.num_gpu_blocks == 4 * MIB // 2048 == 2048


def test_slots_larger_than_the_share_leave_no_cache_and_say_so(llama_base, monkeypatch):
    # 64 slots of rank 64: 64 x 64 x 1376 x 2 x 4 bytes = 45.1 MB, over the 4 MiB share
    with pytest.raises(ValueError, match=r"no memory left for the KV cache.*lower --max-loras or "
                                         r"--max-lora-rank \(the LoRA slots take 43\.0 MiB\)"):
        _engine(llama_base, monkeypatch, enable_lora=True, max_loras=64, max_lora_rank=64)


def test_the_gpu_rule_counts_the_slots_in_use_and_names_them(caplog):
    gib = 1 << 30
    # 0.5 GiB of slots allocated before the profile are part of the 16.5 GiB in use
    mem = DeviceMemory(total=80 * gib, in_use=16 * gib + gib // 2, weights=15 * gib,
                       activation_peak=2 * gib, graph_pool=gib, lora_slots=gib // 2)
    assert kv_cache_bytes(mem, 0.9) == 72 * gib - 19 * gib - gib // 2
    caplog.set_level(logging.INFO, logger="kvmesh.engine")
    log_kv_budget(mem, 0.9, 1000, 16)
    assert "in use 16896 MiB (weights 15360 MiB, LoRA slots 512 MiB)" in caplog.text
    tight = DeviceMemory(total=10 * gib, in_use=8 * gib, weights=7 * gib, activation_peak=gib,
                         graph_pool=gib // 2, lora_slots=gib)
    with pytest.raises(ValueError, match=r"LoRA slots 1\.00 GiB.*lower --max-loras or --max-lora-rank"):
        kv_cache_bytes(tight, 0.9)
