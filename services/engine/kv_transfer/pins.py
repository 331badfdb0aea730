"""The producer's pinned prompts: blocks a decode engine has yet to read, by transfer id.

The engine thread pins at a request's finish and frees what `take_released` returns; the side
channel's threads look pins up and mark them read. A pin nobody reads is released after its
timeout (counted), so a decode engine that died never leaks the prefill engine's cache.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Pin:
    key: str                    # the KV manager's table key holding the blocks
    block_ids: tuple[int, ...]  # the prompt's full blocks, in order
    block_hashes: tuple[str, ...]  # their chained hashes (hex): the reader checks its prompt
    deadline: float             # monotonic time after which the blocks are freed unread


class PinTable:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pins: dict[str, Pin] = {}        # transfer id -> pin
        self._read: list[str] = []             # transfer ids the reader is done with
        self._stale: list[str] = []            # table keys of pins replaced under their id
        self.num_timeouts = 0                  # pins freed unread (their timeout ran out)
        self.num_released = 0                  # pins freed after the reader said it was done

    def pin(self, transfer_id: str, key: str, block_ids: list[int], hashes: list[bytes]) -> None:
        with self._lock:
            old = self._pins.get(transfer_id)
            if old is not None:               # NOTE: a transfer id used twice: the old pin goes
                self._stale.append(old.key)
            self._pins[transfer_id] = Pin(key, tuple(block_ids), tuple(h.hex() for h in hashes),
                                          self._clock() + self.timeout_s)

    def get(self, transfer_id: str) -> Pin | None:
        with self._lock:
            return self._pins.get(transfer_id)

    def mark_read(self, transfer_id: str) -> bool:
        """The reader is done (or gave up): free at the next take_released. False: unknown."""
        with self._lock:
            if transfer_id not in self._pins:
                return False
            self._read.append(transfer_id)
            return True

    def take_released(self) -> list[str]:
        """Table keys to free now: the pins read since the last call, then the expired ones."""
        now = self._clock()
        keys: list[str] = []
        with self._lock:
            keys.extend(self._stale)
            self._stale.clear()
            for tid in self._read:
                pin = self._pins.pop(tid, None)
                if pin is not None:
                    keys.append(pin.key)
                    self.num_released += 1
            self._read.clear()
            for tid in [t for t, p in self._pins.items() if p.deadline <= now]:
                keys.append(self._pins.pop(tid).key)
                self.num_timeouts += 1
        return keys

    @property
    def num_pinned_blocks(self) -> int:
        with self._lock:
            return sum(len(p.block_ids) for p in self._pins.values())
