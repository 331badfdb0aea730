"""KV-cache events, the same shape as vLLM's (BlockStored / BlockRemoved / AllBlocksCleared).

The engine records events as blocks enter and leave its prefix cache; a publisher drains them into
a `KVEventBatch` with a per-pod sequence number so a consumer (the Redis prefix index) can detect
gaps and follow resets. `to_dict()` / `from_dict()` give a JSON-safe form (hashes as hex).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[bytes]            # newly cached blocks, in chain order
    parent_block_hash: bytes | None      # hash of the block before the first one; None for block 0
    token_ids: list[int]                 # the tokens of all the blocks, concatenated
    block_size: int                      # tokens per block
    medium: str = "gpu"                  # tier holding the blocks (gpu / cpu)
    lora_id: int | None = None           # the LoRA adapter's id on its engine (None: base model)
    lora_name: str | None = None         # the adapter's name, chained into the block hashes

    def to_dict(self) -> dict:
        return {"type": "BlockStored",
                "block_hashes": [h.hex() for h in self.block_hashes],
                "parent_block_hash": (None if self.parent_block_hash is None
                                      else self.parent_block_hash.hex()),
                "token_ids": list(self.token_ids), "block_size": self.block_size,
                "medium": self.medium, "lora_id": self.lora_id, "lora_name": self.lora_name}

    @staticmethod
    def from_dict(d: dict) -> KVCacheEvent:
        return event_from_dict(d)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[bytes]            # blocks evicted from the prefix cache
    medium: str = "gpu"

    def to_dict(self) -> dict:
        return {"type": "BlockRemoved", "block_hashes": [h.hex() for h in self.block_hashes],
                "medium": self.medium}

    @staticmethod
    def from_dict(d: dict) -> KVCacheEvent:
        return event_from_dict(d)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (reset or restart): forget every block of this pod."""

    def to_dict(self) -> dict:
        return {"type": "AllBlocksCleared"}

    @staticmethod
    def from_dict(d: dict) -> KVCacheEvent:
        return event_from_dict(d)


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_from_dict(d: dict) -> KVCacheEvent:
    kind = d.get("type")
    if kind == "BlockStored":
        parent = d["parent_block_hash"]
        return BlockStored([bytes.fromhex(h) for h in d["block_hashes"]],
                           None if parent is None else bytes.fromhex(parent),
                           [int(t) for t in d["token_ids"]], int(d["block_size"]),
                           d.get("medium", "gpu"), d.get("lora_id"), d.get("lora_name"))
    if kind == "BlockRemoved":
        return BlockRemoved([bytes.fromhex(h) for h in d["block_hashes"]], d.get("medium", "gpu"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {kind!r}")


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    seq: int                             # per-pod, strictly increasing: a gap means lost events
    ts: float                            # wall-clock seconds when the batch was taken
    events: list = field(default_factory=list)  # KVCacheEvent, in the order they happened

    def to_dict(self) -> dict:
        return {"seq": self.seq, "ts": self.ts, "events": [e.to_dict() for e in self.events]}

    @classmethod
    def from_dict(cls, d: dict) -> KVEventBatch:
        return cls(int(d["seq"]), float(d["ts"]), [event_from_dict(e) for e in d["events"]])


class KVEventSequencer:
    """Numbers batches for one pod: 0, 1, 2, ... Empty drains produce no batch (and no number)."""

    def __init__(self, start: int = 0) -> None:
        self._next_seq = start

    def batch(self, events: list, ts: float | None = None) -> KVEventBatch | None:
        if not events:
            return None
        batch = KVEventBatch(self._next_seq, time.time() if ts is None else ts, list(events))
        self._next_seq += 1
        return batch
