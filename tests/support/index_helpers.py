"""Shared helpers for the router tests (sync wrappers over the async PrefixIndex)."""
from __future__ import annotations

import asyncio
import hashlib

import redis.asyncio as aioredis
from waiting import wait_until  # noqa: F401  (tests/support; re-exported)

from kvmesh.index.lookup import PrefixIndex

NS, SVC = "testns", "testsvc"


def h(i: int | str) -> bytes:
    """A fake 32-byte block hash."""
    return hashlib.sha256(str(i).encode()).digest()


def index_call(url: str, method: str, *args):
    """Run one PrefixIndex coroutine method with a fresh async client."""
    async def go():
        client = aioredis.from_url(url, decode_responses=True)
        try:
            return await getattr(PrefixIndex(client, NS, SVC), method)(*args)
        finally:
            await client.aclose()
    return asyncio.run(go())
