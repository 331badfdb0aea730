"""Property-based: random add / step / abort sequences never leak a block or lose a request."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.engine.request import RequestStatus

from .conftest import Harness

configs = st.fixed_dictionaries({
    "scheduling_policy": st.sampled_from(["fcfs", "priority", "sjf", "dynamic"]),
    "preemption_mode": st.sampled_from(["recompute", "swap", "auto"]),
    "enable_chunked_prefill": st.booleans(),
    "enable_prefix_caching": st.booleans(),
    "num_blocks": st.integers(6, 24),
    "block_size": st.sampled_from([2, 4, 8]),
    "num_cpu_blocks": st.integers(0, 16),
    "max_num_seqs": st.integers(1, 8),
})

op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 8), st.integers(0, 3),
              st.integers(1, 3), st.integers(0, 3)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, ops=st.lists(op, max_size=60))
def test_random_workloads_keep_every_invariant(cfg, ops):
    block_size, num_blocks = cfg["block_size"], cfg["num_blocks"]
    max_model_len = num_blocks * block_size
    chunked = cfg.pop("enable_chunked_prefill")
    budget = None if chunked else max_model_len
    h = Harness(max_model_len=max_model_len, enable_chunked_prefill=chunked,
                max_num_batched_tokens=budget, swap_bytes_per_s=1e9, **cfg)
    added = []
    for o in ops:
        if o[0] == "add":
            _, plen, max_tokens, priority, n, prefix = o
            plen = min(plen, max_model_len - 1)
            # a few shared prefixes so prefix caching and copy-on-write are exercised
            prompt = [300 + prefix] * min(plen, 6) + [400 + i for i in range(max(plen - 6, 0))]
            added.append(h.add(0, prompt=prompt, max_tokens=max_tokens, priority=priority, n=n))
        elif o[0] == "step":
            h.step()
        else:
            live = sorted(h.sched.requests)
            if live:
                h.sched.abort_requests([live[o[1] % len(live)]])
        h.kv.check_invariants(h.sched.requests.keys())
    h.run_to_completion(max_steps=5_000)
    h.kv.check_invariants([])
    assert h.kv.num_free_blocks == num_blocks
    assert h.kv.num_free_cpu_blocks == cfg["num_cpu_blocks"]
    # no request is lost: every sample ended, and the non-aborted ones produced output
    assert len(h.all_requests) == sum(r.sampling_params.n for r in added)
    for r in h.all_requests:
        assert r.is_finished, r
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert 1 <= r.num_output_tokens <= r.max_tokens
