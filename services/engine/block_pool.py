"""The GPU block pool: fixed-size KV blocks, ref counts, an O(1) LRU free queue, the prefix cache.

Pure bookkeeping (no tensors). Block ids are 0..num_blocks-1; the runner maps them to memory.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


@dataclass(slots=True)
class KVCacheStats:
    """Cumulative counters (never reset), read by /metrics and the benchmarks."""
    blocks_allocated: int = 0     # blocks handed out by get_new_blocks (CoW and swap-in included)
    blocks_freed: int = 0         # ref count dropped to 0 (the block went back to the free queue)
    blocks_evicted: int = 0       # cached free blocks whose hash was dropped to reuse them
    prefix_queries: int = 0       # tokens looked up in the prefix cache
    prefix_hits: int = 0          # tokens served from the prefix cache
    cow_copies: int = 0           # copy-on-write block copies
    swapped_out_blocks: int = 0   # GPU -> CPU block copies
    swapped_in_blocks: int = 0    # CPU -> GPU block copies


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int                   # index into the KV tensors
    ref_cnt: int = 0                # block tables holding this block; 0 = in the free queue
    block_hash: bytes | None = None  # set while the block is a registered prefix-cache entry


class BlockPool:
    """Ref-counted blocks with prefix caching and LRU eviction of cached free blocks.

    NOTE: the free queue is an OrderedDict keyed by block id: popitem(last=False) allocates the
    least recently freed block, pop(id) takes a cached free block out of the middle on a prefix
    hit, and insertion appends; all O(1) and in C, faster in CPython than an intrusive list.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, medium: str = "gpu",
                 enable_events: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}; "
                             "raise the KV-cache memory or lower the block size")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.medium = medium
        self.enable_events = enable_events and enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}   # block hash -> the block that holds it
        self.stats = KVCacheStats()
        self._events: list = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (cached free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop n blocks from the front of the free queue (evicting their hashes), ref_cnt = 1."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self.free_queue)} free")
        out = []
        evicted: list[bytes] = []
        popitem = self.free_queue.popitem
        for _ in range(n):
            block = popitem(last=False)[1]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self.stats.blocks_evicted += len(evicted)
            if self.enable_events:
                # NOTE: one BlockRemoved per call, hashes in eviction order.
                self._events.append(BlockRemoved(evicted, self.medium))
        self.stats.blocks_allocated += n
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit or a fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; at 0 it goes back to the free queue.

        NOTE: callers pass blocks in eviction order (a request's tail first), so a prefix's tail
        is evicted before its head, which other prompts are more likely to share. A block with
        no hash goes to the FRONT of the queue instead: it holds nothing reusable, so it should
        be reused before any cached block is evicted.
        """
        queue = self.free_queue
        freed = 0
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue[block.block_id] = block
                if block.block_hash is None:
                    queue.move_to_end(block.block_id, last=False)
                freed += 1
            elif block.ref_cnt < 0:
                block.ref_cnt = 0
                raise AssertionError(f"block {block.block_id} freed more often than taken")
        self.stats.blocks_freed += freed

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes,
                         parent_hash: bytes | None, token_ids: Sequence[int],
                         lora_id: int | None = None, lora_name: str | None = None) -> bool:
        """Register a full block under its hash; False when caching is off or another block
        already holds the hash (this one then stays uncached and is simply freed later).
        `lora_id` / `lora_name`: the adapter whose KV it holds, for the event."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        self.cached[block_hash] = block
        block.block_hash = block_hash
        if self.enable_events:
            self._events.append(BlockStored([block_hash], parent_hash, list(token_ids),
                                            len(token_ids), self.medium, lora_id, lora_name))
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; only possible while no block is referenced. Records AllBlocksCleared."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list:
        events, self._events = self._events, []
        return events
