"""The finalizer's purge: delete every key of one InferenceService (the layout's prefix).

SCAN + DEL in batches, so a big index never blocks Redis. The operator's redis_cleanup connects
and calls `delete_keys`.
"""
from __future__ import annotations

from typing import Any, Protocol

from kvmesh.index.layout import KeySpace


class RedisDeleter(Protocol):
    """The two sync redis-py calls the purge uses (a fake in tests)."""

    def scan_iter(self, match: str, count: int) -> Any: ...

    def delete(self, *keys: Any) -> int: ...


def delete_keys(client: RedisDeleter, namespace: str, name: str, batch: int = 500) -> int:
    """Delete every key of the service `namespace`/`name`; returns how many were deleted."""
    deleted, pending = 0, []
    for key in client.scan_iter(match=KeySpace(namespace, name).all_keys_pattern, count=batch):
        pending.append(key)
        if len(pending) >= batch:
            deleted += client.delete(*pending)
            pending = []
    if pending:
        deleted += client.delete(*pending)
    return deleted
