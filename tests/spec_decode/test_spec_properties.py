"""Property-based: random workloads with drafts accepted or rejected at random never leak a
block, keep every ref count and hash right, and never cache (or publish) a block holding a
rejected draft. A real Scheduler, KVCacheManager and BlockPool; the 'model' is hypothesis."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.common.config import EngineConfig
from kvmesh.common.kv_events import BlockStored
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.output_processor import check_stops
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sched_output import ModelRunnerOutput
from kvmesh.engine.scheduler import Scheduler

ALPHABET = (100, 101, 102)    # few tokens: prompt lookup finds drafts often

configs = st.fixed_dictionaries({
    "preemption_mode": st.sampled_from(["recompute", "swap"]),
    "enable_chunked_prefill": st.booleans(),
    "num_blocks": st.integers(4, 20),
    "block_size": st.sampled_from([2, 4]),
    "num_cpu_blocks": st.integers(0, 16),
    "max_num_seqs": st.integers(1, 6),
    "k": st.integers(1, 4),
})
request = st.tuples(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=14),
                    st.integers(1, 12), st.integers(1, 2))    # prompt, max_tokens, n


def _scheduler(cfg):
    bs, nb = cfg["block_size"], cfg["num_blocks"]
    max_len = nb * bs
    chunked = cfg["enable_chunked_prefill"]
    config = EngineConfig(block_size=bs, num_kv_blocks=nb, max_model_len=max_len,
                          enable_prefix_caching=True, enable_chunked_prefill=chunked,
                          max_num_batched_tokens=None if chunked else max_len,
                          max_num_seqs=cfg["max_num_seqs"], preemption_mode=cfg["preemption_mode"],
                          speculative_config={"method": "ngram", "prompt_lookup_min": 1,
                                              "num_speculative_tokens": cfg["k"]})
    kv = KVCacheManager(nb, bs, cfg["num_cpu_blocks"], enable_caching=True, enable_events=True)
    return Scheduler(config, kv, max_len, 1024), kv, max_len


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, reqs=st.lists(request, min_size=1, max_size=6), data=st.data())
def test_rejected_drafts_never_leak_blocks_or_reach_the_prefix_cache(cfg, reqs, data):
    sched, kv, max_len = _scheduler(cfg)
    samples: list[Request] = []
    for i, (prompt, max_tokens, n) in enumerate(reqs):
        prompt = prompt[:max_len - 1]
        params = SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0)
        group = [Request(f"r{i}" if n == 1 else f"r{i}#{s}", prompt, params, float(i),
                         eos_token_ids=(2,), max_model_len=max_len, sample_index=s,
                         parent_id=f"r{i}") for s in range(n)]
        sched.add_request(group[0])
        for child in group[1:]:
            sched.add_fork(group[0], child)
        samples += group
    stored: list[BlockStored] = []
    drafted = accepted = 0
    for _ in range(2_000):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        result = ModelRunnerOutput(sampled={}, logprobs={})
        before = {}
        for sr in out.scheduled:
            if not sr.sample:
                continue
            rid = sr.request.request_id
            before[rid] = sr.request.num_output_tokens
            if sr.spec_token_ids:
                drafts = list(sr.spec_token_ids)
                n_ok = data.draw(st.integers(0, len(drafts)))
                drafted += len(drafts)
                accepted += n_ok
                result.spec_tokens[rid] = drafts[:n_ok] + [data.draw(st.sampled_from(ALPHABET))]
            else:
                result.sampled[rid] = [data.draw(st.sampled_from(ALPHABET))
                                       for _ in range(1 + len(sr.fork_children))]
        for req in sched.update_from_output(out, result):
            stop = check_stops(req, None, before.get(req.request_id, req.num_output_tokens - 1))
            if stop is not None:
                sched.finish_request(req, *stop)
        sched.end_step(out)
        kv.check_invariants(sched.requests.keys())
        for req in sched.requests.values():
            # every computed position holds a committed token (never a rejected draft)
            assert req.num_computed_tokens <= req.num_tokens, req
        stored += [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert not sched.has_unfinished_requests(), "no progress"
    kv.check_invariants([])
    assert kv.num_free_blocks == cfg["num_blocks"]
    assert kv.num_free_cpu_blocks == cfg["num_cpu_blocks"]
    # every cached block is a block of some request's committed tokens, under that block's hash
    bs = cfg["block_size"]
    committed = {}
    for r in samples:
        for i, h in enumerate(r.block_hashes):
            if (i + 1) * bs <= r.num_tokens:
                committed[h] = r.all_token_ids[i * bs:(i + 1) * bs]
    for e in stored:
        for j, h in enumerate(e.block_hashes):
            assert committed.get(h) == e.token_ids[j * bs:(j + 1) * bs]
    for r in samples:
        assert r.status != RequestStatus.FINISHED_ABORTED
        assert 1 <= r.num_output_tokens <= r.max_tokens
