"""Fetch progress: a log line every few seconds (a pod's log, a file), a tqdm bar on a terminal."""
from __future__ import annotations

import logging
import sys
import threading
import time

logger = logging.getLogger("kvmesh.fetch")

LOG_EVERY_S = 5.0
_MIB = 1 << 20


def mib(n: int) -> str:
    return f"{n / _MIB:.1f} MiB"


class Progress:
    """Bytes of one fetch so far; add() is called by the download threads."""

    def __init__(self, uri: str, total: int, done: int = 0) -> None:
        self.uri, self.total, self.done = uri, total, done
        self.fetched = 0                  # bytes read from the store by this process
        self._lock = threading.Lock()
        self._t0 = self._last = time.monotonic()
        self._bar = _bar(total, done, uri)

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            self.fetched += n
            if self._bar is not None:
                self._bar.update(n)
            now = time.monotonic()
            if now - self._last >= LOG_EVERY_S:
                self._last = now
                logger.info("fetching %s: %d %% (%s of %s), %.1f MiB/s", self.uri,
                            100 * self.done // max(1, self.total), mib(self.done), mib(self.total),
                            self.fetched / _MIB / max(1e-9, now - self._t0))

    def close(self) -> float:
        """Ends the bar; the seconds since the start."""
        if self._bar is not None:
            self._bar.close()
        return time.monotonic() - self._t0


def _bar(total: int, done: int, uri: str):
    try:
        if not sys.stderr.isatty():
            return None
        from tqdm import tqdm  # noqa: PLC0415 - a terminal only
    except (ImportError, AttributeError, ValueError):
        return None
    return tqdm(total=total, initial=done, unit="B", unit_scale=True, unit_divisor=1024,
                desc=uri, leave=False)
