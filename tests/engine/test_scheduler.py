"""The scheduler with a real KV-cache manager and a fake model: exact decisions step by step."""
from __future__ import annotations

from kvmesh.engine.request import RequestStatus


def plan(out):
    """(request id, start, num tokens, sample) for each scheduled request of one step."""
    return [(sr.request.request_id, sr.start, sr.num_tokens, sr.sample) for sr in out.scheduled]


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget(harness):
    h = harness(max_num_batched_tokens=8)
    h.add(20, max_tokens=2)
    steps = [plan(h.step()) for _ in range(4)]
    assert steps == [
        [("r0", 0, 8, False)],
        [("r0", 8, 8, False)],
        [("r0", 16, 4, True)],
        [("r0", 20, 1, True)],
    ]
    assert not h.sched.has_unfinished_requests()
    assert h.kv.num_free_blocks == 64


def test_decodes_and_a_prefill_chunk_share_one_step(harness):
    h = harness(max_num_batched_tokens=8)
    h.add(4, max_tokens=3)
    h.step()
    h.add(10, max_tokens=1)
    out = h.step()
    assert plan(out) == [("r0", 4, 1, True), ("r1", 0, 7, False)]
    assert (out.stats.num_decode_reqs, out.stats.num_prefill_reqs) == (1, 1)
    assert out.stats.num_chunked_prefills == 1
    assert out.stats.num_scheduled_tokens == 8


def test_without_chunking_a_prefill_waits_for_a_step_with_room(harness):
    h = harness(max_model_len=12, max_num_batched_tokens=12, enable_chunked_prefill=False)
    h.add(10, max_tokens=2)
    h.add(10, max_tokens=2)
    assert plan(h.step()) == [("r0", 0, 10, True)]             # 2 tokens left: r1 must wait whole
    assert plan(h.step()) == [("r0", 10, 1, True), ("r1", 0, 10, True)]
    h.run_to_completion()


def test_recompute_preemption_evicts_the_latest_arrival_and_resumes_it(harness):
    h = harness(num_blocks=4, block_size=4, preemption_mode="recompute")
    a = h.add(7, max_tokens=4)
    b = h.add(7, max_tokens=4)
    assert plan(h.step()) == [("r0", 0, 7, True), ("r1", 0, 7, True)]
    assert plan(h.step()) == [("r0", 7, 1, True), ("r1", 7, 1, True)]
    out = h.step()                       # r0 needs a third block: r1 (latest arrival) goes
    assert plan(out) == [("r0", 8, 1, True)]
    assert out.preempted_ids == ["r1"]
    assert out.stats.num_preempted_recompute == 1 and out.block_ops == []
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert plan(h.step()) == [("r0", 9, 1, True)]     # r0 finishes; r1 still does not fit
    assert a.is_finished and a.output_token_ids == [7, 7, 7, 7]
    assert plan(h.step()) == [("r1", 0, 9, True)]     # prompt + 2 outputs recomputed at once
    h.run_to_completion()
    assert b.output_token_ids == [7, 7, 7, 7] and b.num_preemptions == 1
    h.kv.check_invariants([])


def test_swap_preemption_moves_blocks_to_cpu_and_back_before_new_admissions(harness):
    h = harness(num_blocks=4, block_size=4, num_cpu_blocks=8, preemption_mode="swap")
    h.add(7, max_tokens=4)
    b = h.add(7, max_tokens=4)
    h.step()
    h.step()
    victim_blocks = h.kv.get_block_ids("r1")
    out = h.step()
    assert out.preempted_ids == ["r1"] and b.status == RequestStatus.SWAPPED
    assert out.block_ops == [("swap_out", victim_blocks[0], 0), ("swap_out", victim_blocks[1], 1)]
    assert b.num_computed_tokens == 8        # its KV survives on the CPU
    h.add(3, max_tokens=1)                   # arrives while r1 is swapped: must wait for r1
    out = h.step()
    assert plan(out) == [("r0", 9, 1, True)]
    out = h.step()                           # r0 is done: r1 swaps in and decodes, then r2
    assert [op[0] for op in out.block_ops] == ["swap_in", "swap_in"]
    assert [(c, g) for _, c, g in out.block_ops][0][0] == 0
    assert plan(out)[0] == ("r1", 8, 1, True)
    assert [p[0] for p in plan(out)] == ["r1", "r2"]
    h.run_to_completion()
    assert b.output_token_ids == [7, 7, 7, 7] and h.kv.num_free_cpu_blocks == 8


def test_auto_mode_swaps_long_contexts_and_recomputes_short_ones(harness):
    # 1 KiB blocks at 1 GB/s swap vs 2000 tokens/s recompute: 2 blocks (4 µs) beat 8 tokens (4 ms)
    h = harness(num_blocks=4, block_size=4, num_cpu_blocks=8, preemption_mode="auto",
                swap_bytes_per_s=1e9)
    h.add(7, max_tokens=4)
    h.add(7, max_tokens=4)
    for _ in range(3):
        out = h.step()
    assert out.stats.num_preempted_swap == 1
    h2 = harness(num_blocks=4, block_size=4, num_cpu_blocks=8, preemption_mode="auto",
                 swap_bytes_per_s=1.0)          # absurdly slow swap: recompute wins
    h2.add(7, max_tokens=4)
    h2.add(7, max_tokens=4)
    for _ in range(3):
        out = h2.step()
    assert out.stats.num_preempted_recompute == 1


def test_priority_policy_preempts_lower_priority_running_requests(harness):
    h = harness(num_blocks=4, block_size=4, scheduling_policy="priority",
                preemption_mode="recompute")
    low = h.add(13, max_tokens=3, priority=5)        # all 4 blocks once its first token is out
    h.step()
    high = h.add(6, max_tokens=2, priority=0)
    out = h.step()
    assert plan(out) == [(high.request_id, 0, 6, True)]
    assert out.preempted_ids == [low.request_id]
    assert out.stats.num_decode_reqs == 0 and out.stats.num_scheduled_tokens == 6
    assert low.status == RequestStatus.WAITING
    h.run_to_completion()
    assert high.is_finished and low.is_finished and low.num_preemptions == 1


def test_fcfs_never_preempts_for_a_waiting_request(harness):
    h = harness(num_blocks=4, block_size=4, scheduling_policy="fcfs")
    low = h.add(13, max_tokens=3, priority=5)
    h.step()
    h.add(6, max_tokens=2, priority=0)
    out = h.step()
    assert plan(out) == [(low.request_id, 13, 1, True)] and out.preempted_ids == []


def test_priority_orders_admission_and_ties_break_by_arrival(harness):
    h = harness(max_num_seqs=1, scheduling_policy="priority")
    h.add(3, max_tokens=1, priority=2, rid="late-low")
    h.add(3, max_tokens=1, priority=1, rid="mid")
    h.add(3, max_tokens=1, priority=1, rid="mid-later")
    order = [plan(h.step())[0][0] for _ in range(3)]
    assert order == ["mid", "mid-later", "late-low"]


def test_sjf_runs_the_shortest_job_first_and_aging_prevents_starvation(harness):
    h = harness(max_num_seqs=1, scheduling_policy="sjf", sjf_aging_tokens_per_s=0.0)
    h.add(40, max_tokens=40, rid="long")
    h.add(4, max_tokens=2, rid="short")
    assert plan(h.step())[0][0] == "short"

    h = harness(max_num_seqs=1, scheduling_policy="sjf", sjf_aging_tokens_per_s=10.0)
    h.add(40, max_tokens=40, rid="long", arrival=0.0)
    h.clock.t = 20.0                      # long has waited 20 s: 80 - 200 < 5 - 0
    h.add(4, max_tokens=2, rid="short")
    assert plan(h.step())[0][0] == "long"


def _dynamic_victim(weights) -> tuple[list, list]:
    """Two running requests outgrow a 4-block cache at t=2: returns (plan, preempted ids)."""
    from kvmesh.common.config import DynamicPriorityWeights
    from .conftest import Harness
    h = Harness(num_blocks=4, block_size=4, scheduling_policy="dynamic",
                preemption_mode="recompute", dynamic_weights=DynamicPriorityWeights(*weights))
    h.add(7, max_tokens=8, rid="old-slow", arrival=0.0)
    h.add(7, max_tokens=3, rid="new-fast", arrival=0.5)
    h.step()
    h.step()                              # progress: old-slow 2/8, new-fast 2/3
    out = h.step()                        # both need a third block: the worst key is evicted
    return plan(out), out.preempted_ids


def test_dynamic_policy_weights_decide_which_running_request_is_preempted():
    # (priority, progress, waiting) weights; keys at t=2 are -progress*p - waiting*age
    # progress 2, waiting 0.5: old-slow -0.5-1.0 = -1.5, new-fast -1.33-0.75 = -2.08
    assert _dynamic_victim((1.0, 2.0, 0.5)) == ([("new-fast", 8, 1, True)], ["old-slow"])
    # progress 2, waiting 2: old-slow -0.5-4 = -4.5, new-fast -1.33-3 = -4.33
    assert _dynamic_victim((1.0, 2.0, 2.0)) == ([("old-slow", 8, 1, True)], ["new-fast"])
    # progress 0, waiting 0.5: age alone, like FCFS
    assert _dynamic_victim((1.0, 0.0, 0.5)) == ([("old-slow", 8, 1, True)], ["new-fast"])


def test_dynamic_policy_waiting_weight_decides_admission_order(harness):
    from kvmesh.common.config import DynamicPriorityWeights

    def order(waiting: float) -> list[str]:
        h = harness(max_num_seqs=1, scheduling_policy="dynamic",
                    dynamic_weights=DynamicPriorityWeights(priority=1.0, progress=2.0,
                                                           waiting=waiting))
        h.add(3, max_tokens=1, priority=2, rid="old-low", arrival=0.0)
        h.clock.t = 3.0
        h.add(3, max_tokens=1, priority=0, rid="new-high")
        return [plan(h.step())[0][0] for _ in range(2)]

    assert order(0.5) == ["new-high", "old-low"]     # 2 - 0.5*3 = 0.5 > 0
    assert order(1.0) == ["old-low", "new-high"]     # 2 - 1.0*3 = -1 < 0


def test_a_request_preempted_for_a_waiting_one_is_not_readmitted_in_the_same_step(harness):
    # the no-thrashing guard (Request.last_preempted_step): both lows are evicted for high,
    # and 2 blocks stay free that r-low-small alone would fit in; it waits for the next step
    h = harness(num_blocks=4, block_size=4, scheduling_policy="priority",
                preemption_mode="recompute")
    h.add(11, max_tokens=5, priority=5, rid="low-big")      # 3 blocks
    h.add(2, max_tokens=5, priority=6, rid="low-small")     # 1 block
    h.step()
    h.add(8, max_tokens=1, priority=0, rid="high")          # 2 blocks
    out = h.step()
    assert plan(out) == [("high", 0, 8, True)]
    assert out.preempted_ids == ["low-small", "low-big"] and out.stats.kv_usage == 0.5
    out = h.step()
    assert plan(out) == [("low-big", 0, 12, True), ("low-small", 0, 3, True)]
    h.run_to_completion()


def test_priority_swap_preemption_admits_nothing_else_in_that_step(harness):
    h = harness(num_blocks=4, block_size=4, num_cpu_blocks=8, scheduling_policy="priority",
                preemption_mode="swap")
    low = h.add(13, max_tokens=3, priority=5, rid="low")        # all 4 blocks
    h.step()
    h.add(6, max_tokens=2, priority=0, rid="high")              # 2 blocks
    h.add(2, max_tokens=1, priority=5, rid="later")             # would fit the 2 left
    out = h.step()
    assert plan(out) == [("high", 0, 6, True)] and out.preempted_ids == ["low"]
    assert low.status == RequestStatus.SWAPPED and h.kv.num_free_blocks == 2
    assert plan(h.step()) == [("high", 6, 1, True)]              # low needs 4 blocks: waits
    assert plan(h.step()) == [("low", 13, 1, True)]              # later waits behind low
    assert plan(h.step()) == [("low", 14, 1, True)]
    assert plan(h.step()) == [("later", 0, 2, True)]
    assert not h.sched.has_unfinished_requests()


def test_priority_preempts_for_a_max_num_seqs_seat(harness):
    h = harness(max_num_seqs=1, scheduling_policy="priority", preemption_mode="recompute")
    low = h.add(4, max_tokens=3, priority=5, rid="low")
    h.step()
    h.add(4, max_tokens=1, priority=0, rid="high")
    h.add(4, max_tokens=1, priority=5, rid="peer")              # equal priority: never evicts
    out = h.step()
    assert plan(out) == [("high", 0, 4, True)] and out.preempted_ids == ["low"]
    assert out.stats.num_scheduled_tokens == 4 and out.stats.num_decode_reqs == 0
    assert low.status == RequestStatus.WAITING
    assert plan(h.step()) == [("low", 0, 5, True)]
    assert plan(h.step()) == [("low", 5, 1, True)]
    assert plan(h.step()) == [("peer", 0, 4, True)]
    assert low.output_token_ids == [7, 7, 7] and not h.sched.has_unfinished_requests()


def test_fcfs_never_preempts_for_a_max_num_seqs_seat(harness):
    h = harness(max_num_seqs=1, scheduling_policy="fcfs")
    h.add(4, max_tokens=3, priority=5, rid="low")
    h.step()
    h.add(4, max_tokens=1, priority=0, rid="high")
    out = h.step()
    assert plan(out) == [("low", 4, 1, True)] and out.preempted_ids == []


def test_scheduler_keeps_no_state_for_finished_requests(harness):
    h = harness(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    for i in range(20):
        h.add(3 + i % 5, max_tokens=1 + i % 3, n=1 + i % 2)
    h.sched.abort_requests(["r3"])
    h.run_to_completion()
    assert sum(r.is_finished for r in h.all_requests) == 30
    containers = {name: len(v) for name, v in vars(h.sched).items()
                  if isinstance(v, (list, dict, set))}
    assert containers == {"waiting": 0, "running": 0, "swapped": 0, "pending_forks": 0,
                          "requests": 0, "_awaiting_kv": 0, "_records": 0,
                          "_records_prev": 0}


def test_abort_frees_every_block_at_once_wherever_the_request_is(harness):
    h = harness(num_blocks=8, block_size=4, max_num_batched_tokens=4)
    run = h.add(6, max_tokens=8)
    wait = h.add(30, max_tokens=8)
    h.step()
    h.step()
    assert h.kv.num_free_blocks < 8
    h.sched.abort_requests([run.request_id, wait.request_id, "unknown-id"])
    assert h.kv.num_free_blocks == 8
    assert run.status == wait.status == RequestStatus.FINISHED_ABORTED
    assert not h.sched.has_unfinished_requests()
    h.kv.check_invariants([])


def test_n_samples_fork_after_prefill_and_copy_the_shared_partial_block(harness):
    h = harness(num_blocks=16, block_size=4)
    parent = h.add(6, max_tokens=3, n=3)
    out = h.step()
    assert [len(sr.fork_children) for sr in out.scheduled] == [2]
    kids = [h.sched.requests["r0#1"], h.sched.requests["r0#2"]]
    assert parent.output_token_ids == [7] and [k.output_token_ids for k in kids] == [[8], [9]]
    shared = h.kv.get_block_ids("r0")
    assert all(h.kv.get_block_ids(k.request_id) == shared for k in kids)
    out = h.step()                         # each sample writes position 6 of the shared block
    copies = [op for op in out.block_ops if op[0] == "copy"]
    assert len(copies) == 2 and all(src == shared[1] for _, src, _ in copies)
    assert h.kv.get_block_ids("r0")[0] == shared[0]   # the full block stays shared
    h.run_to_completion()
    h.kv.check_invariants([])


def test_eos_finishes_with_stop_and_max_tokens_with_length(harness):
    h = harness()
    h.next_token = h.EOS
    r = h.add(3, max_tokens=5)
    h.step()
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None   # vLLM: None for EOS
    h.next_token = 9
    r1 = h.add(3, max_tokens=5, stop_token_ids=[9])
    h.step()
    assert r1.status == RequestStatus.FINISHED_STOPPED and r1.stop_reason == 9
    h.next_token = 7
    r2 = h.add(3, max_tokens=2)
    h.run_to_completion()
    assert r2.finish_reason == "length" and r2.num_output_tokens == 2


def test_max_model_len_caps_generation(harness):
    h = harness(max_model_len=8)
    r = h.add(6, max_tokens=100)
    h.run_to_completion()
    assert r.num_output_tokens == 2 and r.finish_reason == "length"


def test_prefix_cache_hits_skip_computed_tokens(harness):
    h = harness(enable_prefix_caching=True, block_size=4)
    shared = list(range(200, 212))            # three full blocks
    h.add(0, prompt=shared + [1, 2], max_tokens=1)
    h.run_to_completion()
    b = h.add(0, prompt=shared + [3], max_tokens=1)
    out = h.step()
    assert plan(out) == [(b.request_id, 12, 1, True)]
    assert out.stats.prefix_hit_tokens == 12 and b.num_cached_tokens == 12


def test_step_stats_count_every_block_operation_once(harness):
    h = harness(num_blocks=8, block_size=4)
    h.add(8, max_tokens=1)
    s = h.step().stats                   # 2 blocks for the prompt; the request finishes at once
    assert (s.blocks_allocated, s.blocks_freed, s.num_running) == (2, 2, 1)
    h.add(6, max_tokens=4)
    s = h.step().stats
    assert (s.blocks_allocated, s.blocks_freed) == (2, 0)
    h.sched.abort_requests(["r1"])      # between steps: counted in the next step
    s = h.step().stats
    assert (s.blocks_allocated, s.blocks_freed, s.num_scheduled_tokens) == (0, 2, 0)
    assert h.kv.num_free_blocks == 8


def test_swapped_request_needing_the_whole_cache_comes_back_once_it_is_free(harness):
    # r1 needs all 3 blocks to decode again; a block of headroom on top could never be free
    h = harness(num_blocks=3, block_size=4, num_cpu_blocks=16, preemption_mode="swap",
                max_model_len=12)
    a = h.add(1, max_tokens=2)
    b = h.add(8, max_tokens=2)
    assert plan(h.step()) == [("r0", 0, 1, True), ("r1", 0, 8, True)]
    out = h.step()                       # r1 needs a third block: it swaps itself out
    assert plan(out) == [("r0", 1, 1, True)] and out.preempted_ids == ["r1"]
    assert out.block_ops == [("swap_out", 1, 0), ("swap_out", 2, 1)]
    assert a.is_finished and b.status == RequestStatus.SWAPPED and b.num_computed_tokens == 8
    out = h.step()                       # nothing runs: the whole cache is r1's
    assert plan(out) == [("r1", 8, 1, True)]
    assert out.block_ops == [("swap_in", 0, 0), ("swap_in", 1, 1)]
    assert b.status == RequestStatus.FINISHED_LENGTH and b.output_token_ids == [7, 7]
    assert not h.sched.has_unfinished_requests()
    assert (h.kv.num_free_blocks, h.kv.num_free_cpu_blocks) == (3, 16)
    h.kv.check_invariants([])


def test_swapped_request_keeps_a_block_of_headroom_while_others_run(harness):
    h = harness(num_blocks=6, block_size=4, num_cpu_blocks=16, preemption_mode="swap")
    h.add(1, max_tokens=3)
    h.add(9, max_tokens=4)
    c = h.add(7, max_tokens=3)
    h.step()
    h.step()
    out = h.step()                        # r1 needs a 4th block: r2 (latest) swaps out
    assert plan(out) == [("r0", 2, 1, True), ("r1", 10, 1, True)] and out.preempted_ids == ["r2"]
    assert (c.num_computed_tokens, h.kv.num_free_blocks) == (8, 3)
    # r2 needs 3 blocks and 3 are free, but r1 still runs: it waits for one block of headroom
    assert plan(h.step()) == [("r1", 11, 1, True)]
    out = h.step()                        # nothing runs: the headroom is not needed
    assert plan(out) == [("r2", 8, 1, True)]
    assert [op[0] for op in out.block_ops] == ["swap_in", "swap_in"]
    assert c.output_token_ids == [7, 7, 7] and not h.sched.has_unfinished_requests()


def test_a_request_that_outgrows_the_whole_cache_finishes_instead_of_hanging(harness):
    for mode in ("swap", "recompute"):
        # max_model_len 12 but only 8 tokens of cache: the engine forbids this; be robust anyway
        h = harness(num_blocks=2, block_size=4, num_cpu_blocks=8, preemption_mode=mode,
                    max_model_len=12)
        r = h.add(7, max_tokens=4)
        assert plan(h.step()) == [("r0", 0, 7, True)]
        assert plan(h.step()) == [("r0", 7, 1, True)]
        out = h.step()                    # token 9 needs a third block that does not exist
        assert plan(out) == [] and out.preempted_ids == ["r0"]
        assert plan(h.step()) == []
        assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [7, 7]
        assert (h.kv.num_free_blocks, h.kv.num_free_cpu_blocks) == (2, 8)
        assert not h.sched.has_unfinished_requests()


def test_a_prompt_larger_than_the_whole_cache_finishes_with_its_forks(harness):
    h = harness(num_blocks=2, block_size=4, max_model_len=12)
    r = h.add(9, max_tokens=2, n=2)
    ok = h.add(3, max_tokens=1)
    out = h.step()
    assert plan(out) == [(ok.request_id, 0, 3, True)]
    assert [(x.request_id, x.status) for x in h.all_requests] == [
        ("r0", RequestStatus.FINISHED_LENGTH), ("r0#1", RequestStatus.FINISHED_LENGTH),
        ("r1", RequestStatus.FINISHED_LENGTH)]
    assert r.output_token_ids == [] and not h.sched.has_unfinished_requests()
    assert h.sched.pending_forks == {}


def test_the_scheduler_hashes_each_request_once_as_its_tokens_grow(harness, monkeypatch):
    """Block hashes come from the scheduler's one hasher, block by block as tokens arrive; the
    prefix cache only reads them. With caching off (and no connector) nothing is hashed."""
    from kvmesh.common import block_hash

    h = harness(num_blocks=32, block_size=4, enable_prefix_caching=True, hash_seed="s1")
    hashed_blocks = []
    real = block_hash.hash_block
    monkeypatch.setattr(block_hash, "hash_block",
                        lambda *a, **k: hashed_blocks.append(1) or real(*a, **k))
    a = h.add(9, max_tokens=8)
    n = h.add(5, max_tokens=8, n=2)
    assert len(hashed_blocks) == 2 + 1 + 1            # a's and each sample's full prompt blocks
    while h.sched.has_unfinished_requests():
        h.step()
    # every full block was hashed exactly once: a 9 + 8 = 17 tokens, each sample 5 + 8 = 13
    assert len(hashed_blocks) == 4 + 3 + 3
    for req in h.all_requests:
        assert req.block_hashes == block_hash.hash_prompt_blocks(req.all_token_ids, 4, seed="s1")
    assert n.block_hasher is a.block_hasher is h.sched.block_hasher

    off = harness(num_blocks=32, block_size=4)
    b = off.add(9, max_tokens=8)
    while off.sched.has_unfinished_requests():
        off.step()
    assert off.sched.block_hasher is None and b.block_hashes == []


class _HungFetches:
    """A cross-pod KV store whose fetches stay in flight until finish() (a store that hangs)."""

    def __init__(self) -> None:
        self.in_flight: set[str] = set()

    def prefetch(self, req_id, block_hashes):
        self.in_flight.add(req_id)

    def finish(self, req_id):
        self.in_flight.discard(req_id)

    def ready(self, req_id):
        return req_id not in self.in_flight

    def lookup(self, req_id, block_hashes):
        return []

    def release(self, req_id):
        self.in_flight.discard(req_id)


def test_prefetch_waits_and_waits_that_run_out_are_counted_once_per_request(harness):
    from kvmesh.api.metrics import EngineMetrics
    from kvmesh.engine.observers import LoadSnapshot, StepReport
    from kvmesh.engine.scheduler import REMOTE_KV_WAIT_S

    store = _HungFetches()
    h = harness(num_blocks=32, block_size=4, kv_connector=store)
    metrics = EngineMetrics("m")
    waits, timeouts = [], []

    def step():
        out = h.step()
        waits.append(out.stats.remote_kv_waits)
        timeouts.append(out.stats.remote_kv_timeouts)
        metrics.on_step(StepReport(0, 0, 0, 0, 0, None, out, [], None, LoadSnapshot(0, 0, 0, 0)))
        return out

    assert REMOTE_KV_WAIT_S == 2.0                   # the harness clock moves 1 s a step
    slow = h.add(9, max_tokens=2)                    # two full blocks to fetch: it waits
    assert plan(step()) == []
    fast = h.add(9, max_tokens=2)
    store.finish(fast.request_id)                    # its fetch answered before its first step
    assert [sr.request for sr in step().scheduled] == [fast]
    assert h.clock.t == slow.arrival_time + REMOTE_KV_WAIT_S   # its wait ran out: computed locally
    assert slow in [sr.request for sr in step().scheduled]
    while h.sched.has_unfinished_requests():
        step()
    assert (sum(waits), sum(timeouts)) == (1, 1) and (waits[0], timeouts[2]) == (1, 1)
    assert (metrics.extra["kvmesh:kv_share_prefetch_waits"],
            metrics.extra["kvmesh:kv_share_prefetch_timeouts"]) == (1, 1)
    assert store.in_flight == set() and not h.sched._awaiting_kv
