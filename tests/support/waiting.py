"""Polling for a condition in tests that watch other processes."""
from __future__ import annotations

import time


def wait_until(cond, timeout: float = 5.0, interval: float = 0.02) -> bool:
    """True as soon as cond() is; after `timeout` seconds, cond()'s last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()
