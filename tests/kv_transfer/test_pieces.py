"""The hand-off's pure pieces: read planning over contiguous runs, and the producer's pin table
(a fake clock decides when pins expire)."""
from __future__ import annotations

import pytest

from kvmesh.engine.kv_transfer.layout import KVLayout, plan_reads, runs
from kvmesh.engine.kv_transfer.pins import PinTable


def test_runs_join_pairs_that_go_up_together():
    assert runs([(5, 0), (6, 1), (7, 2), (9, 3), (10, 4), (11, 8)]) == [
        (5, 0, 3), (9, 3, 2), (11, 8, 1)]
    assert runs([]) == []


def test_one_read_per_run_per_region():
    local = KVLayout(base_addr=1000, num_regions=2, num_blocks=10, block_bytes=8, dtype="float32")
    remote = KVLayout(base_addr=50000, num_regions=2, num_blocks=4, block_bytes=8, dtype="float32")
    laddrs, raddrs, lengths = plan_reads(local, remote, [3, 4, 7], [0, 1, 3])
    # run (3<-0, 2 blocks) then (7<-3, 1 block); regions are 80 bytes here, 32 there
    assert laddrs == [1000 + 24, 1000 + 80 + 24, 1000 + 56, 1000 + 80 + 56]
    assert raddrs == [50000, 50000 + 32, 50000 + 24, 50000 + 32 + 24]
    assert lengths == [16, 16, 8, 8]


def test_layouts_must_match_to_copy():
    a = KVLayout(0, 4, 10, 2048, "float32")
    assert a.compatible(KVLayout(99, 4, 3, 2048, "float32")) is None   # block counts may differ
    assert "KV layouts differ" in a.compatible(KVLayout(0, 4, 10, 1024, "bfloat16"))
    assert KVLayout.from_dict(a.to_dict()) == a


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def test_pins_are_released_when_read_or_after_their_timeout():
    clock = Clock()
    pins = PinTable(2.0, clock)
    pins.pin("t1", "k1", [4, 5], [b"\x01", b"\x02"])
    pins.pin("t2", "k2", [6], [b"\x03"])
    assert pins.get("t1").block_hashes == ("01", "02")
    assert pins.num_pinned_blocks == 3
    assert pins.mark_read("t1") and not pins.mark_read("nope")
    assert pins.take_released() == ["k1"]
    clock.t = 1.9
    assert pins.take_released() == []
    clock.t = 2.0
    assert pins.take_released() == ["k2"]
    assert (pins.num_released, pins.num_timeouts, pins.num_pinned_blocks) == (1, 1, 0)
    assert pins.get("t2") is None


def test_a_transfer_id_pinned_twice_frees_the_older_pin():
    pins = PinTable(30.0, Clock())
    pins.pin("t", "k1", [1], [b"a"])
    pins.pin("t", "k2", [2], [b"b"])
    assert pins.take_released() == ["k1"]
    assert pins.get("t").key == "k2"


@pytest.mark.parametrize("n", [1, 3])
def test_loads_use_every_region(n):
    lay = KVLayout(0, n, 5, 4, "float32")
    assert len(plan_reads(lay, lay, [0, 1], [0, 1])[0]) == n


def test_the_side_channel_answers_through_the_consumers_one_client():
    """A real side channel on loopback, asked through one kept client (the loader's) for several
    transfers: the pinned blocks and hashes, then done; an unknown or finished transfer is a 404."""
    import httpx

    from kvmesh.engine.kv_transfer.side_channel import SideChannel, SideChannelError, notify_done, query

    pins = PinTable(timeout_s=30)
    pins.pin("t1", "k1", [4, 5, 6], [b"\x01" * 4, b"\x02" * 4, b"\x03" * 4])
    pins.pin("t2", "k2", [9], [b"\xff" * 4])
    sc = SideChannel("127.0.0.1", 0, pins, lambda: {"engine_id": "prefill-0", "rpc_addr": "127.0.0.1:1"})
    try:
        with httpx.Client() as http:
            assert query(http, sc.addr, "t1", 5) == {
                "engine_id": "prefill-0", "rpc_addr": "127.0.0.1:1", "block_ids": [4, 5, 6],
                "block_hashes": ["01010101", "02020202", "03030303"]}
            assert query(http, sc.addr, "t2", 5)["block_ids"] == [9]
            assert notify_done(http, sc.addr, "t1", 5) is True
            assert pins.take_released() == ["k1"]
            with pytest.raises(SideChannelError, match="404"):
                query(http, sc.addr, "t1", 5)                   # read: no longer pinned
            assert notify_done(http, sc.addr, "t2", 5) is True
    finally:
        sc.close()


def test_a_gone_producer_is_a_side_channel_error_and_done_says_false():
    import httpx

    from kvmesh.engine.kv_transfer.side_channel import SideChannel, SideChannelError, notify_done, query

    sc = SideChannel("127.0.0.1", 0, PinTable(timeout_s=30), dict)
    addr = sc.addr
    sc.close()                                                   # the producer went away
    with httpx.Client() as http:
        with pytest.raises(SideChannelError, match="did not answer"):
            query(http, addr, "t1", 1)
        assert notify_done(http, addr, "t1", 1) is False
