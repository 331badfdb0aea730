"""The scheduler's side of a prefill/decode hand-off (kv_transfer/handoff.py) with a real KV-cache
manager: exact block ids, states and counts for a read that lands, fails, or is aborted midway,
and for a producer's pinned prompt.

NOTE: the connector is a test double: the real one (kv_transfer/connector.py) needs two engines
and Mooncake, which tests/kv_transfer/test_pd_servers.py runs; here the test decides when each
read ends and how.
"""
from __future__ import annotations

from kvmesh.engine.kv_connector import FinishedTransfer, KVConnector, LoadResult
from kvmesh.engine.kv_transfer.params import KVTransferParams
from kvmesh.engine.request import RequestStatus

REMOTE = KVTransferParams(False, True, "p0", "http://127.0.0.1:1", None, "t0")
DECODE = KVTransferParams(do_remote_decode=True, transfer_id="t1")


class Connector(KVConnector):
    handoff = True

    def __init__(self) -> None:
        self.loads: list[tuple[str, list[int], int]] = []
        self.ended: list[LoadResult] = []
        self.released: list[str] = []

    def prefetch(self, req_id, block_hashes): pass
    def lookup(self, req_id, block_hashes): return []
    def release(self, req_id): pass
    def wants(self, block_hash): return False
    def save(self, block_hash, data): pass
    def close(self): pass

    def wants_remote_prefill(self, req):
        kt = req.sampling_params.kv_transfer_params
        return kt is not None and kt.do_remote_prefill

    def start_load(self, req, block_ids, first_block):
        self.loads.append((req.request_id, list(block_ids), first_block))

    def end(self, rid: str, ok: bool) -> None:
        n = next(len(ids) for r, ids, _ in self.loads if r == rid)
        self.ended.append(LoadResult(rid, ok, n if ok else 0))

    def finished_loads(self):
        out, self.ended = self.ended, []
        return out

    def take_released(self):
        out, self.released = self.released, []
        return out

    def request_finished(self, req, block_ids):
        kt = req.sampling_params.kv_transfer_params
        if kt is None or not kt.do_remote_decode:
            return None
        n = req.num_prompt_tokens // 4
        return FinishedTransfer("pin:1", n, {"remote_block_ids": block_ids[:n]})


def plan(out):
    return [(sr.request.request_id, sr.start, sr.num_tokens, sr.sample) for sr in out.scheduled]


def make(harness, **kw):
    conn = Connector()
    return harness(kv_connector=conn, enable_prefix_caching=True, **kw), conn


def test_a_read_prompt_waits_unscheduled_then_computes_only_its_tail(harness):
    h, conn = make(harness)
    req = h.add(10, max_tokens=2, kv_transfer_params=REMOTE)
    out = h.step()
    assert plan(out) == []
    assert conn.loads == [("r0", [0, 1], 0)]            # (10 - 1) // 4 blocks; one token stays
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert h.kv.get_block_ids("r0") == [0, 1] and h.kv.pool.cached == {}   # not hit-able yet
    assert out.stats.num_waiting == 1
    assert plan(h.step()) == []                          # still reading: still not scheduled
    conn.end("r0", True)
    out = h.step()
    assert plan(out) == [("r0", 8, 2, True)]
    assert (out.stats.external_hit_tokens, out.stats.num_prompt_tokens_computed) == (8, 2)
    assert [h.kv.pool.cached.get(x).block_id for x in req.block_hashes[:2]] == [0, 1]
    h.run_to_completion()
    assert req.output_token_ids == [7, 7] and h.kv.num_free_blocks == 64


def test_the_decode_sides_prefix_hits_are_not_read(harness):
    h, conn = make(harness)
    shared = [100 + i for i in range(4)]
    h.add(0, max_tokens=1, prompt=shared + [1, 2, 3, 4, 5])
    h.run_to_completion()
    hit = h.kv.pool.cached[h.all_requests[0].block_hashes[0]].block_id
    req = h.add(0, max_tokens=1, prompt=shared + [9] * 9, kv_transfer_params=REMOTE)
    assert plan(h.step()) == []
    (rid, ids, first), = conn.loads
    assert (rid, len(ids), first) == ("r1", 2, 1)        # blocks 1 and 2; block 0 was a hit
    assert h.kv.get_block_ids("r1") == [hit, *ids]
    conn.end("r1", True)
    assert plan(h.step()) == [("r1", 12, 1, True)]
    assert req.num_cached_tokens == 4


def test_a_fully_cached_prompt_reads_nothing_and_runs_at_once(harness):
    h, conn = make(harness)
    h.add(0, max_tokens=1, prompt=list(range(100, 110)))
    h.run_to_completion()
    h.add(0, max_tokens=1, prompt=list(range(100, 110)), kv_transfer_params=REMOTE)
    assert plan(h.step()) == [("r1", 8, 2, True)]
    assert conn.loads == [("r1", [], 2)]                 # only tells the producer it is done


def test_a_failed_read_is_computed_here(harness):
    h, conn = make(harness)
    req = h.add(10, max_tokens=1, kv_transfer_params=REMOTE)
    h.step()
    conn.end("r0", False)
    out = h.step()
    assert plan(out) == [("r0", 0, 10, True)]            # the whole prompt, in the same step
    assert (out.stats.external_hit_tokens, out.stats.num_prompt_tokens_computed) == (0, 10)
    assert len(conn.loads) == 1                          # never read twice
    h.run_to_completion()
    assert req.output_token_ids == [7] and h.kv.num_free_blocks == 64


def test_an_abort_mid_read_keeps_the_blocks_until_the_read_ends(harness):
    h, conn = make(harness)
    h.add(10, max_tokens=1, kv_transfer_params=REMOTE)
    h.step()
    h.sched.abort_requests(["r0"])
    assert not h.sched.has_unfinished_requests()
    assert h.kv.num_free_blocks == 62                    # the read may still write into them
    conn.end("r0", True)
    h.sched.poll_handoff(h.step().stats)
    assert h.kv.num_free_blocks == 64
    h.kv.check_invariants([])


def test_a_producer_keeps_the_prompts_full_blocks_until_released(harness):
    h, conn = make(harness)
    req = h.add(10, max_tokens=1, kv_transfer_params=DECODE)
    h.step()                                             # prefill, its one token, finished
    assert req.is_finished
    assert req.kv_transfer_result == {"remote_block_ids": [0, 1]}
    assert h.kv.get_block_ids("pin:1") == [0, 1]         # the partial block 2 was freed
    assert h.kv.num_free_blocks == 62
    h.kv.check_invariants(["pin:1"])
    conn.released.append("pin:1")
    h.sched.poll_handoff(h.step().stats)
    assert h.kv.num_free_blocks == 64
    h.kv.check_invariants([])


def test_an_aborted_producer_request_pins_nothing(harness):
    h, conn = make(harness)
    req = h.add(10, max_tokens=4, kv_transfer_params=DECODE)
    h.step()
    h.sched.abort_requests(["r0"])
    assert req.kv_transfer_result is None and h.kv.num_free_blocks == 64


def test_a_read_past_its_deadline_is_given_up_and_computed_here(harness):
    conn = Connector()
    conn.load_timeout_s = 2.5
    h = harness(kv_connector=conn, enable_prefix_caching=True)
    req = h.add(10, max_tokens=1, kv_transfer_params=REMOTE)
    assert plan(h.step()) == [] and plan(h.step()) == [] and plan(h.step()) == []   # t = 0, 1, 2
    out = h.step()                                       # t = 3: past 2.5 s, computed here
    assert plan(out) == [("r0", 0, 10, True)]
    assert h.sched.handoff.num_timeouts == 1
    assert req.is_finished and h.kv.num_free_blocks == 64 - 2   # the read's blocks stay parked
    conn.end("r0", True)                                 # the read returns late: ignored, freed
    h.sched.poll_handoff(h.step().stats)
    assert h.kv.num_free_blocks == 64 and req.output_token_ids == [7]
    h.kv.check_invariants([])
