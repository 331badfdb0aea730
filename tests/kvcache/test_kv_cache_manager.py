"""KVCacheManager on scripted sequences with exact block ids, ref counts, copies and events."""
import pytest

from kvmesh.common.block_hash import hash_prompt_blocks
from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.engine.kv_cache_manager import KVCacheManager, swap_blocks_from_gib

BS = 4


def refs(mgr, ids):
    return [mgr.pool.blocks[i].ref_cnt for i in ids]


def test_allocation_prefix_hits_and_lru_eviction(helpers):
    mgr = KVCacheManager(num_gpu_blocks=10, block_size=BS)
    a = helpers.make_request("a", range(10))
    assert helpers.prefill(mgr, a) == ([], 0, [0, 1, 2])
    ha = hash_prompt_blocks(list(range(10)), BS)
    assert a.block_hashes == ha
    assert mgr.take_events() == [BlockStored([ha[0]], None, [0, 1, 2, 3], BS),
                                 BlockStored([ha[1]], ha[0], [4, 5, 6, 7], BS)]
    b = helpers.make_request("b", list(range(8)) + [100, 101, 102])
    assert helpers.prefill(mgr, b) == ([0, 1], 8, [3])
    assert mgr.get_block_ids("b") == [0, 1, 3] and refs(mgr, [0, 1, 2, 3]) == [2, 2, 1, 1]
    # never the whole prompt: 8 tokens = 2 full blocks, but only 1 may be a hit
    c = helpers.make_request("c", range(8))
    assert mgr.get_computed_blocks(c) == ([0], 4)
    assert (mgr.stats.prefix_queries, mgr.stats.prefix_hits) == (10 + 11 + 8, 8 + 4)
    mgr.check_invariants(["a", "b"])

    mgr.free(a)
    mgr.free(b)
    mgr.free(b)                                           # idempotent
    mgr.check_invariants([])
    # uncached tails went to the front; cached blocks are at the back, tail (1) before head (0)
    assert list(mgr.pool.free_queue) == [3, 2, 4, 5, 6, 7, 8, 9, 1, 0]
    assert mgr.stats.blocks_freed == 4
    mgr.take_events()
    d = helpers.make_request("d", range(1000, 1036))      # 9 blocks: evicts block 1 only
    assert helpers.prefill(mgr, d)[2] == [3, 2, 4, 5, 6, 7, 8, 9, 1]
    assert mgr.take_events()[0] == BlockRemoved([ha[1]])
    assert mgr.stats.blocks_evicted == 1
    e = helpers.make_request("e", list(range(8)) + [5])
    assert mgr.get_computed_blocks(e) == ([0], 4)         # block 0 survived, block 1 is gone
    mgr.free(d)
    mgr.check_invariants([])


def test_cache_salt_isolates_prefixes(helpers):
    mgr = KVCacheManager(num_gpu_blocks=8, block_size=BS)
    helpers.prefill(mgr, helpers.make_request("a", range(9), salt="tenant-1"))
    assert mgr.get_computed_blocks(helpers.make_request("b", range(9), salt="tenant-2")) == ([], 0)
    assert mgr.get_computed_blocks(helpers.make_request("c", range(9))) == ([], 0)
    assert mgr.get_computed_blocks(helpers.make_request("d", range(9), salt="tenant-1")) == (
        [0, 1], 8)


def test_hash_seed_isolates_managers(helpers):
    m1 = KVCacheManager(8, BS)
    r = helpers.make_request("a", range(9), seed="pod-a")     # the scheduler's hasher seed
    helpers.prefill(m1, r)
    assert r.block_hashes == hash_prompt_blocks(list(range(9)), BS, seed="pod-a")


def test_decode_registers_blocks_as_they_fill(helpers):
    mgr = KVCacheManager(num_gpu_blocks=8, block_size=BS)
    r = helpers.make_request("r", range(6))
    assert helpers.prefill(mgr, r)[2] == [0, 1]
    mgr.take_events()
    assert helpers.decode(mgr, r, 50) == []               # position 6
    assert mgr.take_events() == []
    assert helpers.decode(mgr, r, 51) == []               # position 7 fills block 1
    h = hash_prompt_blocks([0, 1, 2, 3, 4, 5, 50, 51], BS)
    assert mgr.take_events() == [BlockStored([h[1]], h[0], [4, 5, 50, 51], BS)]
    assert helpers.decode(mgr, r, 52) == [2]              # position 8 opens block 2
    assert mgr.get_block_ids("r") == [0, 1, 2]
    mgr.free(r)
    mgr.check_invariants([])


def test_fork_then_copy_on_write(helpers):
    mgr = KVCacheManager(num_gpu_blocks=8, block_size=BS)
    p = helpers.make_request("p", range(6))
    helpers.prefill(mgr, p)                              # blocks [0, 1]; block 1 holds 2 tokens
    c = helpers.make_request("p#1", range(6))
    c.num_computed_tokens = p.num_computed_tokens
    mgr.fork(p, c)
    assert mgr.get_block_ids("p#1") == [0, 1] and refs(mgr, [0, 1]) == [2, 2]
    mgr.check_invariants(["p", "p#1"])
    assert helpers.decode(mgr, p, 70) == [2]             # shared partial block -> private copy
    assert mgr.take_copies() == [(1, 2)]
    assert mgr.get_block_ids("p") == [0, 2] and refs(mgr, [0, 1, 2]) == [2, 1, 1]
    assert helpers.decode(mgr, c, 80) == []              # now sole owner of block 1: in place
    assert mgr.take_copies() == [] and mgr.get_block_ids("p#1") == [0, 1]
    assert mgr.stats.cow_copies == 1
    with pytest.raises(ValueError):
        mgr.fork(p, c)
    mgr.free(p)
    mgr.free(c)
    mgr.check_invariants([])


def test_fork_at_block_boundary_needs_no_copy(helpers):
    mgr = KVCacheManager(num_gpu_blocks=8, block_size=BS)
    p = helpers.make_request("p", range(8))
    helpers.prefill(mgr, p)
    c = helpers.make_request("c", range(8))
    c.num_computed_tokens = 8
    mgr.fork(p, c)
    assert helpers.decode(mgr, p, 1) == [2] and helpers.decode(mgr, c, 2) == [3]
    assert mgr.take_copies() == []


def test_swap_out_and_in(helpers):
    mgr = KVCacheManager(num_gpu_blocks=6, block_size=BS, num_cpu_blocks=4)
    r = helpers.make_request("r", range(10))
    helpers.prefill(mgr, r)                              # [0, 1, 2]; 0 and 1 cached
    hr = r.block_hashes
    assert mgr.can_swap_out(r)
    assert mgr.swap_out(r) == [(0, 0), (1, 1), (2, 2)]
    assert (mgr.num_free_blocks, mgr.num_free_cpu_blocks) == (6, 1)
    assert mgr.get_block_ids("r") == [] and mgr.pool.get_cached_block(hr[0]).block_id == 0
    mgr.check_invariants(["r"])
    s = helpers.make_request("s", range(500, 516))       # 4 blocks from [2, 3, 4, 5, 1, 0]
    assert helpers.prefill(mgr, s)[2] == [2, 3, 4, 5]
    assert not mgr.can_swap_in(r)
    before = helpers.snapshot(mgr)
    assert mgr.swap_in(r) is None
    assert helpers.snapshot(mgr) == before
    mgr.free(s)                                          # queue: [1, 0, 5, 4, 3, 2]
    mgr.take_events()
    assert mgr.swap_in(r) == [(0, 1), (1, 0), (2, 5)]
    hs = s.block_hashes
    assert mgr.take_events() == [BlockRemoved([hr[1], hr[0], hs[3]]),
                                 BlockStored([hr[0]], None, [0, 1, 2, 3], BS),
                                 BlockStored([hr[1]], hr[0], [4, 5, 6, 7], BS)]
    assert (mgr.stats.swapped_out_blocks, mgr.stats.swapped_in_blocks) == (3, 3)
    assert mgr.num_free_cpu_blocks == 4
    mgr.check_invariants(["r"])
    assert helpers.decode(mgr, r, 9) == []
    mgr.free(r)
    mgr.check_invariants([])


def test_swap_in_skips_hashes_still_cached(helpers):
    mgr = KVCacheManager(num_gpu_blocks=6, block_size=BS, num_cpu_blocks=4)
    r = helpers.make_request("r", range(10))
    helpers.prefill(mgr, r)
    mgr.swap_out(r)
    mgr.take_events()
    assert mgr.swap_in(r) == [(0, 2), (1, 3), (2, 4)]
    assert mgr.take_events() == []                       # hashes still held by blocks 0 and 1
    mgr.check_invariants(["r"])
    mgr.free(r)
    mgr.check_invariants([])


def test_swap_of_a_swapped_request_is_freed(helpers):
    mgr = KVCacheManager(num_gpu_blocks=4, block_size=BS, num_cpu_blocks=2)
    r = helpers.make_request("r", range(5))
    helpers.prefill(mgr, r)
    mgr.swap_out(r)
    with pytest.raises(ValueError):
        mgr.allocate_slots(r, 1)
    mgr.free(r)                                          # abort while swapped
    assert mgr.num_free_cpu_blocks == 2
    mgr.check_invariants([])
    big = helpers.make_request("big", range(12))
    helpers.prefill(mgr, big)
    assert not mgr.can_swap_out(big)
    with pytest.raises(RuntimeError, match="swap space"):
        mgr.swap_out(big)


def test_allocate_none_leaves_state_untouched(helpers):
    mgr = KVCacheManager(num_gpu_blocks=4, block_size=BS)
    a = helpers.make_request("a", range(12))
    helpers.prefill(mgr, a)                              # 3 full blocks, all cached
    b = helpers.make_request("b", list(range(8)) + list(range(50, 59)))   # 17 tokens
    hits, n = mgr.get_computed_blocks(b)
    assert (hits, n) == ([0, 1], 8)
    before = helpers.snapshot(mgr)
    assert mgr.allocate_slots(b, 9, hits, n) is None     # needs 3 more, 1 free
    assert helpers.snapshot(mgr) == before
    mgr.free(a)
    # now the hits are cached FREE blocks: reviving them consumes free blocks too
    hits, n = mgr.get_computed_blocks(b)
    before = helpers.snapshot(mgr)
    assert mgr.allocate_slots(b, 9, hits, n) is None     # 3 new + 2 revived > 4
    assert helpers.snapshot(mgr) == before
    c = helpers.make_request("c", list(range(8)) + list(range(50, 58)))   # 16 tokens
    hits, n = mgr.get_computed_blocks(c)
    assert mgr.allocate_slots(c, 8, hits, n) == [3, 2]   # 2 new + 2 revived = 4 (LRU: 3, 2)
    mgr.check_invariants(["c"])


def test_allocate_none_with_pending_copy_on_write(helpers):
    mgr = KVCacheManager(num_gpu_blocks=3, block_size=BS)
    p = helpers.make_request("p", range(6))
    helpers.prefill(mgr, p)
    c = helpers.make_request("c", range(6))
    c.num_computed_tokens = 6
    mgr.fork(p, c)
    assert helpers.decode(mgr, p, 1) == [2]              # takes the last free block
    before = helpers.snapshot(mgr)
    c.append_output_token(2)
    c.append_output_token(3)
    c.append_output_token(4)                             # 3 tokens: 6..8 -> needs block 2 too
    assert mgr.allocate_slots(c, 3) is None
    assert helpers.snapshot(mgr) == before


def test_stale_prefix_hit_is_rejected(helpers):
    mgr = KVCacheManager(num_gpu_blocks=3, block_size=BS)
    a = helpers.make_request("a", range(5))
    helpers.prefill(mgr, a)
    mgr.free(a)
    b = helpers.make_request("b", range(5))
    hits, n = mgr.get_computed_blocks(b)
    assert hits == [0]
    other = helpers.make_request("o", range(100, 112))
    helpers.prefill(mgr, other)                          # evicts block 0
    with pytest.raises(ValueError, match="stale"):
        mgr.allocate_slots(b, 1, hits, n)


def test_event_batches_and_reset(helpers):
    mgr = KVCacheManager(num_gpu_blocks=4, block_size=BS)
    a = helpers.make_request("a", range(5))
    helpers.prefill(mgr, a)
    h = a.block_hashes
    b0 = mgr.take_event_batch(ts=1.0)
    assert (b0.seq, b0.events) == (0, [BlockStored([h[0]], None, [0, 1, 2, 3], BS)])
    assert mgr.take_event_batch() is None
    assert not mgr.reset_prefix_cache()                  # a is still running
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    b1 = mgr.take_event_batch(ts=2.0)
    assert (b1.seq, b1.events) == (1, [AllBlocksCleared()])
    assert mgr.get_computed_blocks(helpers.make_request("c", range(5))) == ([], 0)
    mgr.check_invariants([])


def test_caching_off(helpers):
    mgr = KVCacheManager(num_gpu_blocks=4, block_size=BS, enable_caching=False)
    a = helpers.make_request("a", range(9))
    assert helpers.prefill(mgr, a) == ([], 0, [0, 1, 2])
    assert mgr.get_computed_blocks(helpers.make_request("b", range(9))) == ([], 0)
    assert mgr.pool.cached == {} and mgr.take_events() == []
    mgr.free(a)
    mgr.check_invariants([])


def test_usage_and_invariant_checker_catches_leaks(helpers):
    mgr = KVCacheManager(num_gpu_blocks=4, block_size=BS)
    a = helpers.make_request("a", range(5))
    helpers.prefill(mgr, a)
    assert mgr.usage == 0.5 and mgr.num_free_blocks == 2
    with pytest.raises(AssertionError, match="finished or unknown"):
        mgr.check_invariants([])
    mgr.pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt"):
        mgr.check_invariants()


def test_swap_blocks_from_gib():
    assert swap_blocks_from_gib(1, 2 * 1024 * 1024) == 512
    assert swap_blocks_from_gib(0, 1024) == 0
    with pytest.raises(ValueError):
        swap_blocks_from_gib(-1, 1024)


def test_an_unhashed_request_is_refused_without_a_state_change(helpers):
    """The manager reads block hashes, never computes them: a request nobody hashed (no
    scheduler hasher) fails loudly instead of caching blocks under missing hashes."""
    from kvmesh.engine.request import Request
    from kvmesh.engine.sampling_params import SamplingParams

    mgr = KVCacheManager(num_gpu_blocks=8, block_size=BS)
    helpers.prefill(mgr, helpers.make_request("a", range(6)))
    bare = Request("bare", list(range(100, 109)), SamplingParams(), 0.0)
    assert mgr.get_computed_blocks(bare) == ([], 0)          # no hashes: no hits
    before = helpers.snapshot(mgr)
    with pytest.raises(ValueError, match="0 block hashes for 2 full blocks"):
        mgr.allocate_slots(bare, 9)
    assert helpers.snapshot(mgr) == before
    mgr.check_invariants(["a"])
    # without prefix caching nothing needs hashes
    plain = KVCacheManager(num_gpu_blocks=4, block_size=BS, enable_caching=False)
    assert plain.allocate_slots(bare, 9) == [0, 1, 2]
