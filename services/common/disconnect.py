"""Waiting for work while watching the HTTP client: the server and the router both stop work
whose client went away (one spelling of the poll loop)."""
from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import Awaitable, TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before the work was done; the work was cancelled."""


async def until_disconnect(request: Request, work: Awaitable[T], poll_s: float = 0.25) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected.

    NOTE: starlette does not cancel a non-streaming handler when its client leaves, so the
    handler polls. Cancelling the work is what frees its resources (an engine request's KV
    blocks, a router's backend connection, which in turn aborts the request on the engine)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected
    finally:
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await task
