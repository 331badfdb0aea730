"""A real LLMEngine feeding the publisher: the Redis index equals the engine's prefix cache, and the
router hashes prompts exactly as the engine does."""
from __future__ import annotations

import random


from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.index.publisher import KVEventPublisher, publish_engine_state
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.index.hashing import prompt_block_hashes
from kvmesh.prompt.sources import load_tokenizer
from kvmesh.router.prompt import prompt_token_ids

from index_helpers import NS, SVC, index_call, wait_until

POD = "engine-0"


def publisher_for(engine: LLMEngine, url: str, pod: str = POD) -> KVEventPublisher:
    """What the engine server does: the publisher observes the engine."""
    pub = KVEventPublisher(url, pod, engine.model_name, "http://127.0.0.1:8000", NS, SVC,
                           flush_interval_s=0.01, heartbeat_interval_s=0.1, heartbeat_ttl_s=2.0,
                           snapshot_fn=engine.cached_blocks)
    engine.add_observer(pub)
    return pub


def step_and_publish(engine: LLMEngine, pub: KVEventPublisher) -> None:
    """One step; the engine hands its events and load to the observing publisher."""
    engine.step()


def engine_view(engine: LLMEngine) -> dict[str, set[bytes]]:
    cached = set(engine.kv_manager.pool.cached)
    return {POD: cached} if cached else {}


def test_index_equals_engine_cache_through_a_random_run_and_a_redis_restart(smollm,
                                                                              redis_server):
    """Adds, aborts, evictions from a 14-block cache, a prefix-cache reset, and Redis killed and
    restarted (empty) mid-run: the index equals the engine's cached hashes at each check."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=14, block_size=4, max_model_len=48, enable_kv_events=True,
                                    max_num_seqs=4, swap_space=0), loaded=smollm)
    pub = publisher_for(engine, redis_server.url)
    rng = random.Random(5)
    prefixes = [[rng.randrange(100, 5000) for _ in range(12)] for _ in range(3)]
    evictions = 0
    try:
        for it in range(14):
            if it == 6:
                # drain, check, then reset the prefix cache (the engine's AllBlocksCleared)
                while engine.has_unfinished_requests():
                    step_and_publish(engine, pub)
                assert pub.flush(timeout=10)
                assert index_call(redis_server.url, "dump", engine.model_name) == \
                    engine_view(engine)
                assert engine_view(engine) and engine.reset_prefix_cache()
                publish_engine_state(pub, engine)
                assert pub.flush(timeout=10)
                assert index_call(redis_server.url, "dump", engine.model_name) == {}
                redis_server.stop()
            if it == 10:
                redis_server.start()
            for _ in range(rng.randrange(1, 4)):
                prompt = rng.choice(prefixes)[:rng.randrange(4, 13)] + [
                    rng.randrange(100, 5000) for _ in range(rng.randrange(0, 14))]
                engine.add_request(f"r{it}-{len(engine._groups)}", prompt,
                                   SamplingParams(max_tokens=rng.randrange(1, 3), ignore_eos=True))
            if rng.random() < 0.2:
                engine.abort_request(rng.choice(sorted(engine._groups)))
            if engine.has_unfinished_requests():
                before = engine.kv_manager.stats.blocks_evicted
                step_and_publish(engine, pub)
                evictions += engine.kv_manager.stats.blocks_evicted > before
        while engine.has_unfinished_requests():
            step_and_publish(engine, pub)
        assert pub.flush(timeout=10)
        assert index_call(redis_server.url, "dump", engine.model_name) == engine_view(engine)
        assert evictions > 0 and engine_view(engine)
        assert pub.redis_errors > 0 and pub.resyncs >= 2 and pub.events_published > 0
        assert wait_until(lambda: index_call(redis_server.url, "live_pods")[POD].running == 0)
    finally:
        pub.close()
    assert index_call(redis_server.url, "dump", engine.model_name) == {}


def _random_requests(engine: LLMEngine, rng: random.Random, prefixes: list[list[int]],
                     tag: str) -> None:
    for i in range(rng.randrange(1, 4)):
        prompt = rng.choice(prefixes)[:rng.randrange(4, 13)] + [
            rng.randrange(100, 5000) for _ in range(rng.randrange(0, 14))]
        engine.add_request(f"{tag}-{i}", prompt,
                           SamplingParams(max_tokens=rng.randrange(1, 3), ignore_eos=True))


def test_index_equals_each_pods_cache_with_two_pods_and_a_crashed_pod_restarting(smollm,
                                                                                 redis_server):
    """Two pods share prefixes; pod-a crashes (no cleanup) and a new pod-a starts with an empty
    cache: on start it clears what the old one left, and pod-b's entries are untouched."""
    def make() -> LLMEngine:
        return LLMEngine(EngineConfig(num_kv_blocks=14, block_size=4, max_model_len=48,
                                      enable_kv_events=True, max_num_seqs=4, swap_space=0),
                         loaded=smollm)

    def drain_and_check(engines: dict[str, LLMEngine], pubs: dict[str, KVEventPublisher]):
        for pod, e in engines.items():
            while e.has_unfinished_requests():
                step_and_publish(e, pubs[pod])
            assert pubs[pod].flush(timeout=10)
        want = {pod: set(e.kv_manager.pool.cached) for pod, e in engines.items()
                if e.kv_manager.pool.cached}
        assert index_call(redis_server.url, "dump", model) == want
        return want

    engines = {"pod-a": make(), "pod-b": make()}
    model = engines["pod-a"].model_name
    pubs = {pod: publisher_for(e, redis_server.url, pod) for pod, e in engines.items()}
    rng = random.Random(11)
    prefixes = [[rng.randrange(100, 5000) for _ in range(12)] for _ in range(3)]
    try:
        for it in range(8):
            for pod, e in engines.items():
                _random_requests(e, rng, prefixes, f"{pod}-{it}")
                step_and_publish(e, pubs[pod])
        before = drain_and_check(engines, pubs)
        assert set(before) == {"pod-a", "pod-b"}
        assert before["pod-a"] & before["pod-b"]           # the pods hold shared blocks

        pubs["pod-a"].close(clear=False)                     # crashed: entries left behind
        assert index_call(redis_server.url, "dump", model) == before
        engines["pod-a"] = make()
        pubs["pod-a"] = publisher_for(engines["pod-a"], redis_server.url, "pod-a")
        assert pubs["pod-a"].flush(timeout=10)
        assert index_call(redis_server.url, "dump", model) == {"pod-b": before["pod-b"]}
        for it in range(4):
            _random_requests(engines["pod-a"], rng, prefixes, f"again-{it}")
            step_and_publish(engines["pod-a"], pubs["pod-a"])
        after = drain_and_check(engines, pubs)
        assert after["pod-b"] == before["pod-b"] and after["pod-a"]
    finally:
        for pub in pubs.values():
            pub.close()
    assert index_call(redis_server.url, "dump", model) == {}


def test_router_hashes_equal_engine_hashes(smollm, redis_server):
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=16, max_model_len=512,
                                    enable_kv_events=True),
                       loaded=smollm)
    pub = publisher_for(engine, redis_server.url)
    router_tok = load_tokenizer(None)          # the router's light path: no weights
    messages = [{"role": "system", "content": "You are a terse assistant. " * 8},
                {"role": "user", "content": "Name three prime numbers."}]
    text = "The quick brown fox jumps over the lazy dog. " * 6
    try:
        chat_ids = engine.tokenizer.apply_chat_template(messages)   # what the API server sends
        engine.add_request("chat", chat_ids, SamplingParams(max_tokens=1), cache_salt="tenant-1")
        engine.add_request("text", text, SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            step_and_publish(engine, pub)
        assert pub.flush()
        cached = set(engine.kv_manager.pool.cached)
        cases = [("chat", {"model": engine.model_name, "messages": messages,
                           "cache_salt": "tenant-1"}, chat_ids),
                 ("completion", {"model": engine.model_name, "prompt": text},
                  engine.tokenizer.encode(text))]
        for endpoint, body, engine_ids in cases:
            ids = prompt_token_ids(router_tok, endpoint, body)
            assert ids == engine_ids
            hashes = prompt_block_hashes(ids, 16, engine.config.hash_seed, body.get("cache_salt"))
            assert len(hashes) == len(ids) // 16 >= 3
            assert set(hashes) <= cached
            assert index_call(redis_server.url, "lookup", engine.model_name,
                              hashes) == {POD: len(hashes)}
            salted = prompt_block_hashes(ids, 16, engine.config.hash_seed, "other-tenant")
            assert not set(salted) & cached
            assert index_call(redis_server.url, "lookup", engine.model_name, salted) == {}
        assert wait_until(lambda: POD in index_call(redis_server.url, "live_pods"))
    finally:
        pub.close()
