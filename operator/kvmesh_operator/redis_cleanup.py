"""Finalizer work: remove one InferenceService's keys from an external Redis.

The key layout and the delete-by-prefix live in the prefix-index package (kvmesh.index.layout,
kvmesh.index.purge); this module only connects with the operator's timeouts.
"""
from __future__ import annotations

from kvmesh.index.purge import delete_keys

ALLOWED_SCHEMES = ("redis://", "rediss://")


def cleanup(url: str, password: str | None, namespace: str, name: str, ca_pem: str | None = None) -> int:
    """Connect, delete, disconnect; raises redis errors for the caller to retry.

    `ca_pem`: the CA bundle (redis.caBundle) a rediss:// server's certificate is verified against
    (None: the system store), the same CA the engines and router trust.
    """
    import redis  # imported here: only deletions need it

    # NOTE: the URL comes from a user's spec and the password from a user's Secret: never send them
    # to a local socket or any other transport (the CRD refuses these URLs too).
    if not url.startswith(ALLOWED_SCHEMES):
        raise ValueError(f"refusing Redis URL {url.split('://')[0]}://…: only redis:// and rediss:// are allowed")

    tls = {"ssl_ca_data": ca_pem} if ca_pem is not None and url.startswith("rediss://") else {}
    client = redis.Redis.from_url(url, password=password, socket_timeout=5, socket_connect_timeout=5, **tls)
    try:
        return delete_keys(client, namespace, name)
    finally:
        client.close()
