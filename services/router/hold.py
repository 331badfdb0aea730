"""Holding requests while no engine is ready (scale from zero).

With `--hold-timeout SECONDS` > 0, a request that finds no healthy backend waits here instead of
getting a 503 at once: a service scaled to zero keeps its router, the router's pending count
(`kvmesh_router_pending_requests`) wakes the autoscaler, and the held requests are sent as soon as
an engine passes a health check. A request is held before it is sent anywhere, so holding never
sends one twice. Beyond `--max-held-requests` held at once, or after the timeout (counted from
the request's arrival), the client gets a 503 with `Retry-After` in OpenAI's error shape; a held
client that disconnects is dropped from the queue.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response
from prometheus_client import Counter, Gauge

from kvmesh.common.openai_errors import error_json

# NOTE: how long a refused client should wait before retrying: about the time an engine pod
# takes to pass its first readiness probes once its model is loaded (a guess a client can keep).
RETRY_AFTER_S = 5
_POLL_S = 0.25               # how often a held request re-checks readiness and its client
OUTCOMES = ("sent", "timeout", "full", "disconnected")


class RequestHold:
    """The router's bounded wait for a ready backend. `wake()` after a health round that may have
    healed one; waiters also re-check every 0.25 s (and whether their client is still there)."""

    def __init__(self, timeout_s: float, max_held: int, pending: Gauge, outcomes: Counter) -> None:
        self.timeout_s = timeout_s      # 0: never hold (503 at once)
        self.max_held = max_held
        self.held = 0
        self._pending = pending         # the held count, exported
        self._outcomes = outcomes       # held requests by how their wait ended
        self._event: asyncio.Event | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def wake(self) -> None:
        """Let every held request re-check readiness now."""
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, request: Request, ready: Callable[[], bool], arrived: float
                   ) -> Response | None:
        """None when a backend is ready (send the request now); otherwise the response to return:
        503 + Retry-After (hold off, queue full, timed out) or 499 (the client left).

        `arrived`: time.monotonic() at the request's arrival; the timeout counts from there, so a
        request that is held again after a failed connection does not wait twice as long."""
        if not self.enabled:
            return _unavailable("no healthy backend to serve the request", "no_healthy_backend")
        if ready():
            return None
        if self.held >= self.max_held:
            self._outcomes.labels("full").inc()
            return _unavailable(f"no engine is ready and {self.held} requests are already held "
                                f"(--max-held-requests {self.max_held})", "too_many_held_requests")
        self.held += 1
        self._pending.set(self.held)
        try:
            outcome = await self._wait(request, ready, arrived + self.timeout_s)
        finally:
            self.held -= 1
            self._pending.set(self.held)
        self._outcomes.labels(outcome).inc()
        if outcome == "sent":
            return None
        if outcome == "disconnected":
            return Response(status_code=499)
        return _unavailable(f"no engine became ready within --hold-timeout {self.timeout_s:g} s",
                            "no_healthy_backend")

    async def _wait(self, request: Request, ready: Callable[[], bool], deadline: float) -> str:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            if self._event is None:
                self._event = asyncio.Event()
            event = self._event
            try:
                await asyncio.wait_for(event.wait(), min(left, _POLL_S))
            except TimeoutError:
                pass
            if ready():
                return "sent"
            if await request.is_disconnected():
                return "disconnected"


def _unavailable(message: str, code: str) -> Response:
    return error_json(503, message, code, headers={"Retry-After": str(RETRY_AFTER_S)})
