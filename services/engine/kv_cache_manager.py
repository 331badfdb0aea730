"""What the scheduler calls: per-request block tables over the block pool, plus CPU swap space.

One-way layers: scheduler -> KVCacheManager -> BlockPool. No tensors here; the runner receives
block ids and (src, dst) copy lists. NOTE: no fixed order of copy kinds is safe within a step
(a copy-on-write may target a block a swap-out just freed; a swap-out may carry a block whose
copy-on-write was decided first), so the scheduler drains take_copies() after every allocation
and the runner replays all block moves in decision order.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from kvmesh.common.kv_events import KVEventBatch, KVEventSequencer
from kvmesh.engine.block_pool import BlockPool, KVCacheStats

__all__ = ["KVCacheManager", "KVCacheStats", "swap_blocks_from_gib"]

_NO_BLOCKS: list[int] = []


def swap_blocks_from_gib(swap_space_gib: float, bytes_per_block: int) -> int:
    """CPU swap blocks that fit in `swap_space_gib` GiB (bytes_per_block: K+V, all layers)."""
    if swap_space_gib < 0:
        raise ValueError(f"swap space must be >= 0 GiB, got {swap_space_gib}")
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    return int(swap_space_gib * (1 << 30)) // bytes_per_block


def _rid(request) -> str:
    return request if isinstance(request, str) else request.request_id


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 enable_caching: bool = True, enable_events: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_gpu_blocks, enable_caching, "gpu", enable_events)
        self.stats: KVCacheStats = self.pool.stats
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        # NOTE: block tables are lists of ids (what the runner needs); blocks are looked up by id.
        # They are append-only except that copy-on-write swaps the entry being written.
        self._tables: dict[str, list[int]] = {}
        # Leading blocks of each table already offered to the prefix cache: keeps decode O(1).
        self._num_cached: dict[str, int] = {}
        self._cpu_free: deque[int] = deque(range(num_cpu_blocks))   # FIFO: deterministic ids
        self._cpu_tables: dict[str, list[int]] = {}
        self._copies: list[tuple[int, int]] = []
        self._sequencer = KVEventSequencer()

    # ---- read-only views -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's GPU block table ([] when it has none)."""
        table = self._tables.get(request_id)
        return list(table) if table else []

    def block_table(self, request_id: str) -> list[int]:
        """The live block table (no copy), for readers within the current step only."""
        return self._tables.get(request_id, _NO_BLOCKS)

    # ---- prefix cache ----------------------------------------------------------------------
    def get_computed_blocks(self, request) -> tuple[list[int], int]:
        """Longest cached prefix of request.all_token_ids (full blocks only, by
        request.block_hashes: the scheduler's BlockHasher keeps them current; this manager
        never hashes). At least one token is always left to compute. Returns (block ids,
        tokens covered); takes no references.

        NOTE: call allocate_slots for the same request before any other allocation: the hit
        blocks may be free, and another allocation could evict them (allocate_slots checks).
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        bs = self.block_size
        hashes = request.block_hashes
        num_tokens = request.num_tokens
        max_blocks = max(0, (num_tokens - 1) // bs)
        lookup = self.pool.cached.get
        ids: list[int] = []
        for i in range(min(max_blocks, len(hashes))):
            block = lookup(hashes[i])
            if block is None:
                break
            ids.append(block.block_id)
        self.stats.prefix_queries += num_tokens
        self.stats.prefix_hits += len(ids) * bs
        return ids, len(ids) * bs

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    # ---- allocation ------------------------------------------------------------------------
    def allocate_slots(self, request, num_new_tokens: int, new_computed_blocks: Iterable[int] = (),
                       num_new_computed_tokens: int = 0, cache: bool = True) -> list[int] | None:
        """Grow the request's table to hold num_computed + num_new_computed + num_new_tokens
        tokens. Returns the newly allocated block ids (copy-on-write targets first), or None,
        with no state change, when the pool cannot supply them. `cache` False: the new full
        blocks join the prefix cache only at a later allocation (their KV is still on its way
        from another engine: nobody may hit them before it lands)."""
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError("token counts must be >= 0")
        rid = request.request_id
        bs = self.block_size
        pool = self.pool
        blocks = pool.blocks
        table = self._tables.get(rid)
        if table is not None and num_new_tokens and not new_computed_blocks:
            # NOTE: decode fast path (O(1), no allocation): the tokens fit in the table and
            # land in one block that this request owns alone.
            num_computed = request.num_computed_tokens + num_new_computed_tokens
            total = num_computed + num_new_tokens
            idx = num_computed // bs
            if (total <= len(table) * bs and (total - 1) // bs == idx
                    and blocks[table[idx]].ref_cnt == 1):
                if self.enable_caching:
                    num_full = min(total, len(request.all_token_ids)) // bs
                    if num_full > self._num_cached.get(rid, 0):
                        self._cache_full_blocks(request, table, num_full)
                return []
        is_new = table is None
        if is_new:
            if rid in self._cpu_tables:
                raise ValueError(f"request {rid} is swapped out; swap_in before allocate_slots")
            table = []
        hits = [blocks[i] for i in new_computed_blocks] if new_computed_blocks else []
        if hits:
            self._check_hits(request, table, hits)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens
        num_held = len(table) + len(hits)
        if num_computed > num_held * bs:
            raise ValueError(f"request {rid}: {num_computed} computed tokens but only "
                             f"{num_held} blocks of {bs}")
        if self.enable_caching:
            self._require_hashes(request, min(total, request.num_tokens) // bs)   # before changes
        num_required = -(-total // bs)
        # NOTE: copy-on-write. Blocks written by this step that other tables share (after a
        # fork) must become private first; only the partially filled one holds data to copy.
        cow: list[int] = []
        if num_new_tokens:
            for idx in range(num_computed // bs, min(len(table), num_required)):
                if blocks[table[idx]].ref_cnt > 1:
                    cow.append(idx)
        num_new = max(0, num_required - num_held)
        # NOTE: a free cached block revived by a prefix hit leaves the free queue too.
        num_revived = sum(1 for b in hits if b.ref_cnt == 0) if hits else 0
        if num_new + len(cow) + num_revived > len(pool.free_queue):
            return None

        if hits:  # touch before get_new_blocks, so the hits cannot be evicted by it
            pool.touch(hits)
            table.extend(b.block_id for b in hits)
        new_blocks = pool.get_new_blocks(len(cow) + num_new) if (cow or num_new) else []
        for k, idx in enumerate(cow):
            src, dst = blocks[table[idx]], new_blocks[k]
            if idx * bs < num_computed:
                self._copies.append((src.block_id, dst.block_id))
                self.stats.cow_copies += 1
            table[idx] = dst.block_id
            pool.free_blocks((src,))   # still referenced by the other table(s)
        if num_new:
            table.extend(b.block_id for b in new_blocks[len(cow):])
        if is_new:
            self._tables[rid] = table
        if self.enable_caching and cache:
            self._cache_full_blocks(request, table, min(total, request.num_tokens) // bs)
        return [b.block_id for b in new_blocks]

    def _check_hits(self, request, table: list[int], hits: list) -> None:
        if table:
            raise ValueError(f"request {request.request_id}: prefix hits are only accepted on "
                             "the first allocation")
        hashes = request.block_hashes
        for i, block in enumerate(hits):
            if i >= len(hashes) or block.block_hash != hashes[i]:
                raise ValueError(f"request {request.request_id}: prefix hit block "
                                 f"{block.block_id} is stale (evicted since get_computed_blocks)")

    def _cache_full_blocks(self, request, table: list[int], num_full: int) -> None:
        """Offer blocks [num_cached, num_full) of the table to the prefix cache."""
        rid = request.request_id
        done = self._num_cached.get(rid, 0)
        if num_full <= done:
            return
        bs = self.block_size
        hashes = request.block_hashes
        self._require_hashes(request, num_full)
        tokens = request.all_token_ids
        blocks = self.pool.blocks
        cache = self.pool.cache_full_block
        lora = getattr(request, "lora_request", None)
        lora_id, lora_name = (None, None) if lora is None else (lora.lora_int_id, lora.lora_name)
        for i in range(done, num_full):
            cache(blocks[table[i]], hashes[i], hashes[i - 1] if i else None,
                  tokens[i * bs:(i + 1) * bs], lora_id, lora_name)
        self._num_cached[rid] = num_full

    @staticmethod
    def _require_hashes(request, num_full: int) -> None:
        if len(request.block_hashes) < num_full:
            raise ValueError(f"request {request.request_id}: {len(request.block_hashes)} block "
                             f"hashes for {num_full} full blocks; with prefix caching on, give "
                             "it a BlockHasher (the scheduler does) before allocating")

    def free(self, request) -> None:
        """Release every block of the request (tail first, so it is evicted first). Idempotent."""
        rid = _rid(request)
        self._num_cached.pop(rid, None)
        table = self._tables.pop(rid, None)
        if table:
            blocks = self.pool.blocks
            self.pool.free_blocks([blocks[i] for i in reversed(table)])
        cpu = self._cpu_tables.pop(rid, None)
        if cpu:
            self._cpu_free.extend(cpu)

    def pin(self, request, num_blocks: int, key: str) -> list[int]:
        """Keep the first `num_blocks` of the request's table referenced under `key` (another
        engine will read them) and free the rest; `free(key)` releases them. Returns their ids."""
        rid = _rid(request)
        assert key not in self._tables, f"table key {key!r} is in use"
        self._num_cached.pop(rid, None)
        table = self._tables.pop(rid, [])
        kept, rest = table[:num_blocks], table[num_blocks:]
        if rest:
            blocks = self.pool.blocks
            self.pool.free_blocks([blocks[i] for i in reversed(rest)])
        if kept:
            self._tables[key] = kept
        return kept

    def fork(self, parent, child) -> None:
        """The child shares every block of the parent (n > 1 samples); writes trigger CoW."""
        pid, cid = _rid(parent), _rid(child)
        if cid in self._tables or cid in self._cpu_tables:
            raise ValueError(f"fork target {cid} already holds blocks")
        table = self._tables.get(pid)
        if table is None:
            raise ValueError(f"fork source {pid} holds no GPU blocks")
        blocks = self.pool.blocks
        self.pool.touch([blocks[i] for i in table])
        self._tables[cid] = list(table)
        if pid in self._num_cached:
            self._num_cached[cid] = self._num_cached[pid]

    # ---- swap preemption -------------------------------------------------------------------
    def _num_swap_blocks(self, request) -> int:
        # NOTE: only blocks holding computed tokens travel; lookahead blocks are just freed.
        table = self._tables.get(request.request_id, ())
        return min(len(table), -(-request.num_computed_tokens // self.block_size))

    def can_swap_out(self, request) -> bool:
        return (request.request_id in self._tables
                and self._num_swap_blocks(request) <= len(self._cpu_free))

    def swap_out(self, request) -> list[tuple[int, int]]:
        """Move the request's KV to CPU blocks: returns (gpu_block, cpu_block) copies. The GPU
        blocks are freed (cached ones stay evictable under their hash)."""
        rid = request.request_id
        if rid not in self._tables:
            raise ValueError(f"request {rid} holds no GPU blocks to swap out")
        n = self._num_swap_blocks(request)
        if n > len(self._cpu_free):
            raise RuntimeError(f"swap space full: request {rid} needs {n} CPU blocks, "
                               f"{len(self._cpu_free)} free; check can_swap_out or raise "
                               "--swap-space")
        table = self._tables[rid]
        cpu = [self._cpu_free.popleft() for _ in range(n)]
        self.free(rid)
        self._cpu_tables[rid] = cpu
        self.stats.swapped_out_blocks += n
        return list(zip(table[:n], cpu))

    def can_swap_in(self, request) -> bool:
        cpu = self._cpu_tables.get(request.request_id)
        return cpu is not None and len(cpu) <= len(self.pool.free_queue)

    def swap_in(self, request) -> list[tuple[int, int]] | None:
        """Bring a swapped request back: (cpu_block, gpu_block) copies, or None (no state change)
        when the GPU pool is short. Its full blocks are offered to the prefix cache again."""
        rid = request.request_id
        cpu = self._cpu_tables.get(rid)
        if cpu is None:
            raise ValueError(f"request {rid} is not swapped out")
        if len(cpu) > len(self.pool.free_queue):
            return None
        table = [b.block_id for b in self.pool.get_new_blocks(len(cpu))]
        del self._cpu_tables[rid]
        self._cpu_free.extend(cpu)
        self._tables[rid] = table
        self.stats.swapped_in_blocks += len(cpu)
        if self.enable_caching:
            num_full = min(request.num_computed_tokens, len(table) * self.block_size)
            self._cache_full_blocks(request, table, num_full // self.block_size)
        return list(zip(cpu, table))

    # ---- drains for the runner and the event publisher ---------------------------------------
    @property
    def has_copies(self) -> bool:
        """Copy-on-write copies wait for take_copies()."""
        return bool(self._copies)

    def take_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write (src, dst) pairs, drained. NOTE: called after every allocation;
        with nothing pending it returns the (empty) internal list without allocating."""
        copies = self._copies
        if copies:
            self._copies = []
        return copies

    def take_events(self) -> list:
        return self.pool.take_events()

    def cached_blocks(self) -> list[tuple[bytes, str]]:
        """Snapshot of the prefix cache as (block hash, tier): safe from another thread.

        NOTE: list(dict) runs in C under the GIL, so it sees one consistent state of the hash
        map; the retry only guards interpreters without that guarantee.
        """
        pool = self.pool
        for _ in range(100):
            try:
                return [(h, pool.medium) for h in list(pool.cached)]
            except RuntimeError:   # dictionary changed size during iteration
                time.sleep(0)
        raise RuntimeError("could not snapshot the prefix cache: it changes too fast")

    def take_event_batch(self, ts: float | None = None) -> KVEventBatch | None:
        """Drain events into the next numbered batch (None when there were none)."""
        return self._sequencer.batch(self.pool.take_events(), ts)

    # ---- tests -----------------------------------------------------------------------------
    def check_invariants(self, live_request_ids: Iterable[str] | None = None) -> None:
        """AssertionError unless ref counts, the free queue, the hash map and the CPU swap
        space all agree with the block tables (see the module tests)."""
        pool = self.pool
        users = [0] * pool.num_blocks
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"{rid} holds a block twice: {table}"
            for i in table:
                users[i] += 1
        for block in pool.blocks:
            i = block.block_id
            assert block.ref_cnt == users[i], (
                f"block {i}: ref_cnt {block.ref_cnt} but {users[i]} tables hold it")
            assert (block.ref_cnt == 0) == (i in pool.free_queue), (
                f"block {i}: ref_cnt {block.ref_cnt}, in free queue: {i in pool.free_queue}")
            if block.block_hash is not None:
                assert pool.cached.get(block.block_hash) is block, f"block {i}: hash not mapped"
        assert len(pool.free_queue) == users.count(0), "free queue holds a referenced block"
        assert all(k == b.block_id for k, b in pool.free_queue.items()), "free queue key mismatch"
        for h, block in pool.cached.items():
            assert block.block_hash == h, f"hash map -> block {block.block_id} with another hash"
        assert self.enable_caching or not pool.cached, "hashes registered with caching off"
        owned = [i for t in self._cpu_tables.values() for i in t] + list(self._cpu_free)
        assert sorted(owned) == list(range(self.num_cpu_blocks)), f"CPU blocks: {sorted(owned)}"
        both = self._tables.keys() & self._cpu_tables.keys()
        assert not both, f"requests both on GPU and swapped: {both}"
        for rid, n in self._num_cached.items():
            assert rid in self._tables and n <= len(self._tables[rid]), f"{rid}: num_cached {n}"
        if live_request_ids is not None:
            live = set(live_request_ids)
            extra = (self._tables.keys() | self._cpu_tables.keys()) - live
            assert not extra, f"blocks held by finished or unknown requests: {sorted(extra)}"
            if not live:
                assert len(pool.free_queue) == pool.num_blocks, "GPU blocks leaked"
                assert len(self._cpu_free) == self.num_cpu_blocks, "CPU blocks leaked"
