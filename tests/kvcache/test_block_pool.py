"""BlockPool: allocation order, ref counts, LRU eviction, prefix-cache registration, events."""
import pytest

from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.engine.block_pool import BlockPool

H = [bytes([i]) * 32 for i in range(10)]


def ids(blocks):
    return [b.block_id for b in blocks]


def queue(pool):
    return list(pool.free_queue)


def test_fresh_pool_allocates_in_id_order():
    pool = BlockPool(6, enable_caching=True)
    assert (pool.num_free_blocks, pool.usage) == (6, 0.0)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(3)
    assert (ids(a), ids(b)) == ([0, 1], [2, 3, 4])
    assert all(blk.ref_cnt == 1 for blk in a + b)
    assert (pool.num_free_blocks, pool.usage) == (1, 5 / 6)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.stats.blocks_allocated == 5


def test_touch_and_free_ref_counts():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.touch(a)
    assert [b.ref_cnt for b in a] == [2, 2]
    pool.free_blocks(a)
    assert [b.ref_cnt for b in a] == [1, 1] and pool.num_free_blocks == 2
    pool.free_blocks(a)
    assert pool.num_free_blocks == 4 and pool.stats.blocks_freed == 2
    with pytest.raises(AssertionError):
        pool.free_blocks(a[:1])


def test_lru_eviction_order_and_revival():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for b, h in zip(blocks, H):
        assert pool.cache_full_block(b, h, None, [b.block_id] * 2)
    # free as a request would: tail first -> evicted first
    pool.free_blocks([blocks[1], blocks[0]])
    pool.free_blocks([blocks[3], blocks[2]])
    assert queue(pool) == [1, 0, 3, 2]
    # a prefix hit revives block 0 out of the middle of the queue
    assert pool.get_cached_block(H[0]) is blocks[0]
    pool.touch([blocks[0]])
    assert queue(pool) == [1, 3, 2]
    pool.take_events()
    got = pool.get_new_blocks(2)
    assert ids(got) == [1, 3]
    assert got[0].block_hash is None and pool.get_cached_block(H[1]) is None
    assert pool.take_events() == [BlockRemoved([H[1], H[3]])]
    assert pool.stats.blocks_evicted == 2
    assert pool.get_cached_block(H[2]) is blocks[2]


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4)
    a = pool.get_new_blocks(4)
    pool.cache_full_block(a[0], H[0], None, [1, 2])
    pool.free_blocks([a[0]])                 # cached -> back of the queue
    pool.free_blocks([a[2], a[1]])           # no hash -> front of the queue
    assert queue(pool) == [1, 2, 0]
    assert ids(pool.get_new_blocks(2)) == [1, 2]


def test_cache_full_block_keeps_one_block_per_hash():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, H[5], H[4], [7, 8])
    assert not pool.cache_full_block(b, H[5], H[4], [7, 8])
    assert (a.block_hash, b.block_hash) == (H[5], None)
    assert pool.get_cached_block(H[5]) is a
    assert pool.take_events() == [BlockStored([H[5]], H[4], [7, 8], 2, "gpu")]
    assert pool.take_events() == []


def test_caching_off_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(a, H[0], None, [1])
    assert pool.cached == {} and pool.take_events() == []


def test_reset_prefix_cache_only_when_all_free():
    pool = BlockPool(3)
    a = pool.get_new_blocks(2)
    pool.cache_full_block(a[0], H[0], None, [1])
    pool.take_events()
    assert not pool.reset_prefix_cache()
    pool.free_blocks(a)
    assert pool.reset_prefix_cache()
    assert pool.cached == {} and a[0].block_hash is None
    assert pool.take_events() == [AllBlocksCleared()]
