"""The update side of a step, on a real Scheduler and KVCacheManager without a model: what
`update_from_output` does with a runner output besides appending tokens (prompt log-probs,
finished embeddings requests, grammar acceptance, the measured prefill rate), the grammar
bitmask `schedule()` builds, and the blocks `KVConnector.save_computed_prompts` offers."""
from __future__ import annotations

import pytest

from kvmesh.common.config import EngineConfig
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.kv_connector import KVConnector
from kvmesh.engine.pooling_params import PoolingParams
from kvmesh.engine.request import Logprob, Request, RequestStatus
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sched_output import ModelRunnerOutput
from kvmesh.engine.scheduler import Scheduler

PROMPT = [100 + i for i in range(10)]


def request(rid: str, prompt=PROMPT, **kw) -> Request:
    params = SamplingParams(max_tokens=4, prompt_logprobs=kw.pop("prompt_logprobs", None))
    return Request(rid, list(prompt), params, 0.0, eos_token_ids=(2,), max_model_len=128,
                   parent_id=rid, **kw)


def result(sampled=None, **kw) -> ModelRunnerOutput:
    return ModelRunnerOutput(sampled=sampled or {}, logprobs={}, **kw)


def test_the_prefill_rate_is_learnt_from_steps_of_at_least_64_tokens(harness):
    h = harness(num_blocks=64, block_size=4)
    h.add(100, max_tokens=3, rid="long")
    preemptor = h.sched.preemptor
    assert preemptor.recompute_tokens_per_s == 2000.0
    out = h.sched.schedule()
    assert out.num_scheduled_tokens == 100
    h.sched.update_from_output(out, result({"long": [7]}, model_time_s=0.025))   # 4000 tokens/s
    assert preemptor.recompute_tokens_per_s == pytest.approx(2400.0)
    out = h.sched.schedule()                         # one decode token: too few to measure
    h.sched.update_from_output(out, result({"long": [7]}, model_time_s=1.0))
    assert preemptor.recompute_tokens_per_s == pytest.approx(2400.0)


def test_prompt_logprobs_of_a_chunk_are_written_by_token_index(harness):
    h = harness(num_blocks=64, block_size=4)
    req = request("p", prompt_logprobs=0)
    h.sched.add_request(req)
    out = h.sched.schedule()
    entries = [{PROMPT[i]: Logprob(PROMPT[i], -float(i), i)} for i in (1, 2, 3)]
    touched = h.sched.update_from_output(out, result({"p": [7]},
                                                     prompt_logprobs={"p": (1, entries)}))
    assert touched == [req]
    assert req.prompt_logprobs[:5] == [None, *entries, None]


def test_a_pooled_request_finishes_with_its_prefill_and_frees_its_blocks(harness):
    h = harness(num_blocks=64, block_size=4)
    req = request("e", pooling=PoolingParams())
    h.sched.add_request(req)
    out = h.sched.schedule()
    assert [sr.request for sr in out.scheduled] == [req] and out.scheduled[0].sample
    touched = h.sched.update_from_output(out, result(pooled={"e": [0.6, 0.8]}))
    assert touched == []
    assert req.status == RequestStatus.FINISHED_STOPPED and req.num_output_tokens == 0
    assert h.sched.requests == {} and h.kv.num_free_blocks == 64
    h.sched.end_step(out)
    assert out.stats.blocks_freed == 3


@pytest.fixture(scope="module")
def structured():
    from kvmesh.engine.structured.manager import StructuredOutputManager
    from kvmesh.prompt.sources import load_tokenizer
    tok = load_tokenizer(None)
    manager = StructuredOutputManager(tok.hf, 49152, tok.eos_token_ids)
    yield manager, tok.hf
    manager.shutdown()


def constrained_scheduler(structured):
    from kvmesh.engine.structured.spec import StructuredOutputSpec as Spec
    manager, hf = structured
    cfg = EngineConfig(block_size=4, num_kv_blocks=64, max_model_len=128)
    sched = Scheduler(cfg, KVCacheManager(64, 4, 0), 128, 1024, structured=manager)
    reqs = [request(f"g{i}") for i in range(2)]
    for req in reqs:
        manager.attach(req.request_id, [req], Spec.regex("a+"))
        req.grammar._compiled.result(timeout=60)
        sched.add_request(req)
    plain = request("plain")
    sched.add_request(plain)
    return sched, reqs, plain, hf.convert_tokens_to_ids("a"), hf.convert_tokens_to_ids("b")


def test_schedule_builds_the_bitmask_and_update_advances_each_grammar(structured):
    sched, (ok, refused), plain, a, b = constrained_scheduler(structured)
    out = sched.schedule()
    assert out.grammar is not None and out.grammar.rows == [0, 1]
    touched = sched.update_from_output(out, result({"g0": [a], "g1": [b], "plain": [b]}))
    assert touched == [ok, refused, plain]
    # the refused token (never expected: the mask forbade it) ends only its request
    assert refused.status == RequestStatus.FINISHED_ABORTED and "g1" not in sched.requests
    assert ok.status == RequestStatus.RUNNING and plain.status == RequestStatus.RUNNING
    assert ok.grammar.matcher.is_completed()


def test_an_unconstrained_step_builds_no_bitmask(structured):
    manager, _ = structured
    cfg = EngineConfig(block_size=4, num_kv_blocks=64, max_model_len=128)
    sched = Scheduler(cfg, KVCacheManager(64, 4, 0), 128, 1024, structured=manager)
    sched.add_request(request("plain"))
    assert sched.schedule().grammar is None


class _MemoryStore(KVConnector):
    """An in-memory KV store: the ABC's save path without a network."""

    def __init__(self, stored=()) -> None:
        self.saved: list[tuple[bytes, bytes]] = []
        self.stored = set(stored)

    def prefetch(self, req_id, block_hashes):
        pass

    def lookup(self, req_id, block_hashes):
        return []

    def release(self, req_id):
        pass

    def wants(self, block_hash):
        return block_hash not in self.stored

    def save(self, block_hash, data):
        self.stored.add(block_hash)
        self.saved.append((block_hash, data))

    def close(self):
        pass


def test_save_computed_prompts_offers_each_completed_prompts_full_blocks_once(harness):
    store = _MemoryStore()
    h = harness(num_blocks=64, block_size=4, kv_connector=store, max_num_batched_tokens=16,
                enable_chunked_prefill=True)
    a = h.add(10, n=2, rid="a")                         # 2 full blocks; sample a#1 forks
    b = h.add(10, rid="b")                              # the same prompt: the same hashes
    read = lambda block: b"block-%d" % block             # noqa: E731

    out = h.sched.schedule()                            # a's prompt, b's first 6 tokens
    assert [(sr.request, sr.sample) for sr in out.scheduled] == [(a, True), (b, False)]
    store.save_computed_prompts(out.scheduled, 4, read)
    table = h.kv.get_block_ids("a")
    assert store.saved == [(a.block_hashes[0], b"block-%d" % table[0]),
                           (a.block_hashes[1], b"block-%d" % table[1])]
    h.sched.update_from_output(out, h.fake_result(out))

    out = h.sched.schedule()                  # b completes, a and a#1 decode: nothing to save
    assert [(sr.request.request_id, sr.sample) for sr in out.scheduled] == [
        ("a", True), ("b", True), ("a#1", True)]
    store.save_computed_prompts(out.scheduled, 4, read)
    assert len(store.saved) == 2
    h.sched.update_from_output(out, h.fake_result(out))

    c = h.add(9, rid="c", prompt=[300 + i for i in range(9)])
    while c.num_output_tokens == 0:                     # c's two full blocks, once
        out = h.sched.schedule()
        store.save_computed_prompts(out.scheduled, 4, read)
        h.sched.update_from_output(out, h.fake_result(out))
    assert [hsh for hsh, _ in store.saved[2:]] == c.block_hashes[:2]
