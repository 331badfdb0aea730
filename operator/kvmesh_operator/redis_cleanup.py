"""Finalizer work: remove one InferenceService's keys from an external Redis.

All keys of a service start with `kvmesh:{namespace}/{name}:`; SCAN + DEL in batches so a big
index never blocks Redis.
"""
from __future__ import annotations

from typing import Any, Protocol


class _Redis(Protocol):
    def scan_iter(self, match: str, count: int) -> Any: ...

    def delete(self, *keys: Any) -> int: ...


ALLOWED_SCHEMES = ("redis://", "rediss://")


def key_prefix(namespace: str, name: str) -> str:
    return f"kvmesh:{namespace}/{name}:"


def delete_keys(client: _Redis, namespace: str, name: str, batch: int = 500) -> int:
    """Delete every key of the service; returns how many were deleted."""
    # NOTE: escape glob characters a name could never hold today, but a namespace pattern might.
    pattern = "".join("\\" + c if c in "*?[]\\" else c for c in key_prefix(namespace, name)) + "*"
    deleted, pending = 0, []
    for key in client.scan_iter(match=pattern, count=batch):
        pending.append(key)
        if len(pending) >= batch:
            deleted += client.delete(*pending)
            pending = []
    if pending:
        deleted += client.delete(*pending)
    return deleted


def cleanup(url: str, password: str | None, namespace: str, name: str) -> int:
    """Connect, delete, disconnect; raises redis errors for the caller to retry."""
    import redis  # imported here: only deletions need it

    # NOTE: the URL comes from a user's spec and the password from a user's Secret: never send them
    # to a local socket or any other transport (the CRD refuses these URLs too).
    if not url.startswith(ALLOWED_SCHEMES):
        raise ValueError(f"refusing Redis URL {url.split('://')[0]}://…: only redis:// and rediss:// are allowed")

    client = redis.Redis.from_url(url, password=password, socket_timeout=5, socket_connect_timeout=5)
    try:
        return delete_keys(client, namespace, name)
    finally:
        client.close()
