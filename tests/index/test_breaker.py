"""CircuitBreaker: opens after N consecutive failures, one probe after the cool-down."""
from __future__ import annotations

from kvmesh.index.breaker import CircuitBreaker


def test_opens_after_consecutive_failures_and_probes_once_after_the_cooldown():
    now = [0.0]
    b = CircuitBreaker("t", failures=3, cooldown_s=5.0, clock=lambda: now[0])
    b.failure(); b.failure()
    assert b.allow() and not b.is_open
    b.success()                                    # a success resets the count
    b.failure(); b.failure()
    assert b.allow()
    b.failure()
    assert b.is_open and b.opens == 1 and not b.allow() and not b.closed_or_due()
    now[0] = 5.0
    assert b.closed_or_due() and b.allow()         # the one probe
    assert not b.allow()                           # no second call while it is out
    b.failure()                                    # probe failed: open for another cool-down
    assert not b.allow() and b.opens == 1
    now[0] = 10.0
    assert b.allow()
    b.success()
    assert not b.is_open and b.allow() and b.allow()
