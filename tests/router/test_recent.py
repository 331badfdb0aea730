"""The router's short memory of where it just sent each prefix."""
from kvmesh.router.recent import RecentRoutes, merge_hits

H = [bytes([i]) * 32 for i in range(6)]


def test_consecutive_blocks_from_block_zero_for_the_latest_pod():
    r = RecentRoutes(ttl_s=10.0)
    assert r.hits(H, 0.0) == {}
    r.record("pod-a", H[:4], now=0.0)
    assert r.hits(H, 1.0) == {"pod-a": 4}
    assert r.hits(H[1:], 1.0) == {"pod-a": 3}           # any run of recorded hashes counts
    r.record("pod-b", H[:2], now=2.0)                    # the load guard spilled the prefix
    assert r.hits(H, 3.0) == {"pod-b": 2}                 # block 2 belongs to pod-a: stop there


def test_entries_expire_and_the_table_is_bounded():
    r = RecentRoutes(ttl_s=5.0, max_entries=3)
    r.record("pod-a", H[:2], now=0.0)
    assert r.hits(H, 4.9) == {"pod-a": 2}
    assert r.hits(H, 5.1) == {}
    r.record("pod-a", H[:5], now=10.0)
    assert len(r._entries) == 3 and r.hits(H, 10.0) == {}   # the oldest (blocks 0, 1) evicted



def test_memory_counts_only_for_prefixes_the_index_does_not_know_yet():
    recent = {"pod-a": 4}
    assert merge_hits({}, recent) == {"pod-a": 4}                        # brand-new prefix
    assert merge_hits({"pod-b": 2}, recent) == {"pod-b": 2, "pod-a": 4}  # memory knows more
    assert merge_hits({"pod-b": 4}, recent) == {"pod-b": 4}              # index knows a holder
    assert merge_hits({"pod-a": 1}, recent) == {"pod-a": 4}
