"""Property test: random add / step (chunked prefill, decode) / fork / swap / free / reset.

Besides check_invariants, the machine simulates the KV memory: every slot written holds
(cache salt, the token prefix ending there), which is what a causal model's K/V depends on.
Copies (CoW, swap) are applied like the runner would, and after every rule each request's table
must read back exactly its own prefix: a wrong prefix hit, a missed copy-on-write or a lost swap
shows up as wrong content. A consumer of the event stream must track the cached hash set exactly.
"""
import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from kvmesh.common.block_hash import BlockHasher
from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams

PREFIXES = [list(range(1, 13)), list(range(1, 5)) + list(range(20, 28)), list(range(30, 42))]


def content(req, pos):
    return (req.cache_salt, tuple(req.all_token_ids[:pos + 1]))


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_gpu=st.integers(3, 16),
                num_cpu=st.integers(0, 8), caching=st.booleans())
    def setup(self, block_size, num_gpu, num_cpu, caching):
        self.bs = block_size
        self.mgr = KVCacheManager(num_gpu, block_size, num_cpu, enable_caching=caching)
        self.hasher = BlockHasher(block_size)      # the scheduler's part: the manager never hashes
        self.gpu = [[None] * block_size for _ in range(num_gpu)]
        self.cpu = [[None] * block_size for _ in range(num_cpu)]
        self.reqs: dict[str, Request] = {}
        self.swapped: set[str] = set()
        self.index: set[bytes] = set()      # what a Redis index following the events holds
        self.next_seq = 0
        self.counter = 0

    # ---- helpers -----------------------------------------------------------------------------
    def _pick(self, i, pool):
        pool = sorted(pool)
        return self.reqs[pool[i % len(pool)]] if pool else None

    def _write(self, req, start, end):
        table = self.mgr.get_block_ids(req.request_id)
        for pos in range(start, end):
            self.gpu[table[pos // self.bs]][pos % self.bs] = content(req, pos)

    def _apply_cow(self):
        for src, dst in self.mgr.take_copies():
            self.gpu[dst] = list(self.gpu[src])

    def _decode(self, req, token):
        req.append_output_token(token)
        if self.mgr.allocate_slots(req, 1) is None:
            self._preempt(req)
            return
        self._apply_cow()
        self._write(req, req.num_computed_tokens, req.num_tokens)
        req.num_computed_tokens += 1
        self._check_cached(req, req.num_computed_tokens - 1, req.num_computed_tokens)

    def _check_cached(self, req, start, end):
        """Blocks that became full in [start, end) are now in the prefix cache."""
        if self.mgr.enable_caching:
            for k in range(start // self.bs, end // self.bs):
                assert req.block_hashes[k] in self.mgr.pool.cached, f"block {k} not cached"

    def _preempt(self, req):
        self.mgr.free(req)
        req.num_computed_tokens = 0

    # ---- rules -------------------------------------------------------------------------------
    @rule(prefix=st.integers(0, 2), keep=st.integers(0, 12),
          suffix=st.lists(st.integers(0, 60), min_size=1, max_size=8),
          salt=st.sampled_from([None, None, "tenant"]))
    def add(self, prefix, keep, suffix, salt):
        rid = f"r{self.counter}"
        self.counter += 1
        self.reqs[rid] = Request(rid, PREFIXES[prefix][:keep] + suffix, SamplingParams(), 0.0,
                                 cache_salt=salt, block_hasher=self.hasher)

    @precondition(lambda self: self.reqs.keys() - self.swapped)
    @rule(i=st.integers(0, 100), chunk=st.integers(1, 16), token=st.integers(0, 60))
    def step(self, i, chunk, token):
        req = self._pick(i, self.reqs.keys() - self.swapped)
        mgr, rid = self.mgr, req.request_id
        if req.num_computed_tokens == req.num_tokens:
            self._decode(req, token)
            return
        hits, n_hit = [], 0
        if not mgr.get_block_ids(rid) and req.num_computed_tokens == 0:
            hits, n_hit = mgr.get_computed_blocks(req)
            assert n_hit < req.num_tokens and n_hit == len(hits) * self.bs
            for k, blk in enumerate(hits):                        # a hit holds our prefix
                for j in range(self.bs):
                    assert self.gpu[blk][j] == content(req, k * self.bs + j), "bad prefix hit"
        start = req.num_computed_tokens + n_hit
        n = min(chunk, req.num_tokens - start)
        before = self._snapshot()
        if mgr.allocate_slots(req, n, hits, n_hit) is None:
            assert self._snapshot() == before, "allocate_slots returned None but changed state"
            if mgr.get_block_ids(rid):
                self._preempt(req)
            return
        self._apply_cow()
        self._write(req, start, start + n)
        req.num_computed_tokens = start + n
        self._check_cached(req, start, start + n)

    @precondition(lambda self: self.reqs.keys() - self.swapped)
    @rule(i=st.integers(0, 100), n_children=st.integers(1, 2), decode_now=st.booleans(),
          tokens=st.lists(st.integers(0, 60), min_size=3, max_size=3, unique=True))
    def fork(self, i, n_children, decode_now, tokens):
        """n > 1 sampling: children share the parent's blocks; decoding right away (each sample
        its own token) writes into the shared partial block, which must trigger CoW."""
        parent = self._pick(i, self.reqs.keys() - self.swapped)
        if not self.mgr.get_block_ids(parent.request_id):
            return
        group = [parent]
        for _ in range(n_children):
            cid = f"r{self.counter}"
            self.counter += 1
            child = Request(cid, list(parent.prompt_token_ids), SamplingParams(), 0.0,
                            cache_salt=parent.cache_salt, sample_index=len(group))
            child.all_token_ids = list(parent.all_token_ids)
            child.output_token_ids = list(parent.output_token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.block_hashes = list(parent.block_hashes)
            child.set_block_hasher(self.hasher)
            self.mgr.fork(parent, child)
            self.reqs[cid] = child
            group.append(child)
        if decode_now and parent.num_computed_tokens == parent.num_tokens:
            for req, token in zip(group, tokens):
                self._decode(req, token)

    @precondition(lambda self: self.reqs.keys() - self.swapped)
    @rule(i=st.integers(0, 100))
    def swap_out(self, i):
        req = self._pick(i, self.reqs.keys() - self.swapped)
        if not self.mgr.get_block_ids(req.request_id) or not self.mgr.can_swap_out(req):
            return
        for g, c in self.mgr.swap_out(req):
            self.cpu[c] = list(self.gpu[g])
        self.swapped.add(req.request_id)

    @precondition(lambda self: self.swapped)
    @rule(i=st.integers(0, 100))
    def swap_in(self, i):
        req = self._pick(i, self.swapped)
        can = self.mgr.can_swap_in(req)
        before = self._snapshot()
        pairs = self.mgr.swap_in(req)
        assert (pairs is not None) == can
        if pairs is None:
            assert self._snapshot() == before
            return
        for c, g in pairs:
            self.gpu[g] = list(self.cpu[c])
        self.swapped.discard(req.request_id)
        self._check_cached(req, 0, req.num_computed_tokens)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 100))
    def free(self, i):                      # finish or abort, in any state
        req = self._pick(i, self.reqs.keys())
        self.mgr.free(req)
        self.mgr.free(req)
        del self.reqs[req.request_id]
        self.swapped.discard(req.request_id)

    @rule()
    def reset_prefix_cache(self):
        all_free = self.mgr.num_free_blocks == self.mgr.num_gpu_blocks
        assert self.mgr.reset_prefix_cache() == all_free

    # ---- checks ------------------------------------------------------------------------------
    def _snapshot(self):
        m, p = self.mgr, self.mgr.pool
        return (repr(m._tables), repr(m._num_cached), repr(m._cpu_tables), list(m._cpu_free),
                [(b.ref_cnt, b.block_hash) for b in p.blocks], list(p.free_queue),
                sorted(p.cached), len(p._events), list(m._copies), repr(m.stats))

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants(self.reqs.keys())
        assert self.mgr.take_copies() == []
        batch = self.mgr.take_event_batch()
        if batch is not None:
            assert batch.seq == self.next_seq
            self.next_seq += 1
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    assert not self.index & set(ev.block_hashes)
                    self.index |= set(ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    assert set(ev.block_hashes) <= self.index
                    self.index -= set(ev.block_hashes)
                else:
                    assert isinstance(ev, AllBlocksCleared)
                    self.index.clear()
        assert self.index == set(self.mgr.pool.cached)
        for rid, req in self.reqs.items():
            n = req.num_computed_tokens
            if rid in self.swapped:
                table, mem = self.mgr._cpu_tables[rid], self.cpu
            else:
                table, mem = self.mgr.get_block_ids(rid), self.gpu
            assert len(table) * self.bs >= n
            for pos in range(n):
                assert mem[table[pos // self.bs]][pos % self.bs] == content(req, pos), (
                    f"{rid} reads wrong KV at position {pos}")
            if rid not in self.swapped:
                for k in range(n // self.bs):
                    h = self.mgr.pool.blocks[table[k]].block_hash
                    assert h is None or h == req.block_hashes[k]

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for req in list(self.reqs.values()):
            self.mgr.free(req)
        self.mgr.check_invariants([])
        assert self.mgr.num_free_blocks == self.mgr.num_gpu_blocks
        assert self.mgr.num_free_cpu_blocks == self.mgr.num_cpu_blocks
        assert self.mgr.usage == 0.0


KVCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestKVCacheMachine = KVCacheMachine.TestCase
