"""--kv-share redis: a second engine loads the first engine's prefix blocks instead of computing
them, and its greedy output is unchanged (real redis-server, real engines, separate KV caches)."""
from __future__ import annotations

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.index.kv_bytes import redis_kv_connector

NEW = 12
TEXT = ("The history of the Roman Empire spans many centuries, from the founding of the city to the "
        "fall of Constantinople. Its legacy includes law, language, architecture and roads. Historians "
        "often divide it into periods: the Kingdom, the Republic and the Empire. The")


def make_engine(smollm, url: str | None, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=512, **kw), loaded=smollm,
                     kv_connector=None if url is None else redis_kv_connector(url))


def run(engine: LLMEngine, prompt, salt=None):
    """Greedy tokens, prompt tokens the engine computed itself, tokens loaded from other pods."""
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                       cache_salt=salt)
    if engine.kv_share is not None:
        assert engine.kv_share.settle(10)     # the prefetch has answered before the first step
    tokens, scheduled, loaded = None, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        scheduled += engine.last_stats.num_scheduled_tokens
        loaded += engine.last_stats.external_hit_tokens
    return tokens, scheduled - (NEW - 1), loaded


def test_a_second_pod_reuses_the_first_pods_blocks_with_identical_output(smollm, redis_server,
                                                                          hf_greedy):
    prompt = smollm.tokenizer.encode(TEXT)
    full_blocks = len(prompt) // 16
    a = make_engine(smollm, redis_server.url)
    out_a, computed_a, loaded_a = run(a, prompt)
    a.kv_share.flush()
    assert (computed_a, loaded_a) == (len(prompt), 0)
    assert a.kv_share.blocks_stored == full_blocks >= 3
    keys = redis_server.client().keys("kvmesh:default/kvmesh:kv:*")
    assert len(keys) == full_blocks

    b = make_engine(smollm, redis_server.url)            # another pod: its own, empty KV cache
    out_b, computed_b, loaded_b = run(b, prompt)
    usable = (len(prompt) - 1) // 16 * 16                  # the last token is always computed
    assert loaded_b == usable and computed_b == len(prompt) - usable
    assert out_b == out_a == hf_greedy(prompt, NEW)
    b.kv_manager.check_invariants([])

    # a different tenant (cache salt) shares nothing
    c = make_engine(smollm, redis_server.url)
    out_c, computed_c, loaded_c = run(c, prompt, salt="tenant-b")
    assert (computed_c, loaded_c) == (len(prompt), 0) and out_c == out_a


def test_with_redis_down_the_engine_computes_locally(smollm, redis_server, hf_greedy):
    prompt = smollm.tokenizer.encode(TEXT)
    redis_server.stop()
    e = make_engine(smollm, redis_server.url)
    out, computed, loaded = run(e, prompt)
    e.kv_share.flush()
    assert (computed, loaded) == (len(prompt), 0)
    assert out == hf_greedy(prompt, NEW)
    assert e.kv_share.errors >= 1 and e.kv_share.blocks_stored == 0


def test_kv_bytes_are_keyed_by_the_weights_not_the_served_name(smollm, redis_server):
    import dataclasses

    import torch

    prompt = smollm.tokenizer.encode(TEXT)[:40]          # two full blocks
    quick = SamplingParams(temperature=0, max_tokens=1)

    def loaded_tokens(loaded) -> int:
        e = make_engine(loaded, redis_server.url)
        e.add_request("r", prompt, quick)
        assert e.kv_share.settle(10)
        e.step()
        e.kv_share.flush()
        e.kv_share.close()
        return e.last_stats.external_hit_tokens

    assert loaded_tokens(smollm) == 0                        # stores its two blocks
    renamed = dataclasses.replace(smollm, name="another-name")
    assert loaded_tokens(renamed) == 32                      # same weights, other name: shared
    # other weights, same name: never shared (one tensor changed, restored after)
    weight = dict(smollm.model.named_parameters())["model.norm.weight"]
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(1.01)
        assert loaded_tokens(smollm) == 0
    finally:
        with torch.no_grad():
            weight.copy_(saved)
