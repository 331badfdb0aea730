"""CircuitBreaker: stop calling a Redis that keeps failing, probe it again after a cool-down.

    closed ── N consecutive failures ──▶ open ── cooldown_s ──▶ half-open (one probe)
      ▲                                                          │ success │ failure
      └──────────────────────────────────────────────────────────┘         └──▶ open

NOTE: a Redis that accepts connections and never answers costs a full socket timeout per call;
the breaker turns that into one timeout per cool-down instead of one per call.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("kvmesh.index.breaker")


class CircuitBreaker:
    def __init__(self, name: str, failures: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.threshold = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._lock = threading.Lock()
        self._failures = 0                 # consecutive failures while closed
        self._open_until: float | None = None   # set while open (or half-open, once passed)
        self._probing = False              # the one half-open probe is in flight
        self.opens = 0                     # times it opened (metrics, tests)

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def closed_or_due(self) -> bool:
        """True unless open and still cooling down (a cheap check; takes no probe)."""
        until = self._open_until
        return until is None or self.clock() >= until

    def allow(self) -> bool:
        """True when a call may go out now (closed, or the single probe after the cool-down)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or self.clock() < self._open_until:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        with self._lock:
            was_open = self._open_until is not None
            self._failures, self._open_until, self._probing = 0, None, False
        if was_open:
            logger.info("%s: Redis answers again; circuit closed", self.name)

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._open_until is None and self._failures < self.threshold:
                return
            first = self._open_until is None
            self._open_until = self.clock() + self.cooldown_s
            self._probing = False
            if first:
                self.opens += 1
        if first:
            logger.warning("%s: %d consecutive Redis failures; circuit open, skipping Redis for "
                           "%.1f s at a time", self.name, self.threshold, self.cooldown_s)
