"""How many KV blocks the engine takes from the free memory when --num-kv-blocks is unset."""
from __future__ import annotations


def test_the_kv_cache_leaves_room_for_the_reordered_weights(smollm, monkeypatch):
    """On CPU the projections' reordered weight copies are built on the first forward, after the
    KV cache is sized from the free memory: their bytes are taken off first."""
    from kvmesh.common.config import EngineConfig
    from kvmesh.engine import engine as engine_mod
    from kvmesh.kernels.linear import packed_copy_bytes

    copies = packed_copy_bytes(smollm.model)
    assert copies > 0
    monkeypatch.setattr(engine_mod, "free_memory", lambda device: copies + (1 << 30))
    cfg = EngineConfig(kv_cache_memory_fraction=0.5, max_num_seqs=4096, max_model_len=8192)
    eng = engine_mod.LLMEngine(cfg, loaded=smollm)
    assert eng.kv_manager.pool.num_blocks == (1 << 29) // eng.block_bytes
