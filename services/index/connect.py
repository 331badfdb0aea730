"""redis_client_kwargs: the TLS settings every kvmesh Redis client passes (engine and router).

`rediss://` URLs verify the server against the CA bundle the operator mounts and names in
KVMESH_REDIS_CA_FILE (else the system store). One function, so the publisher, the KV-bytes
store and the router's clients agree.
"""
from __future__ import annotations

import os

CA_FILE_ENV = "KVMESH_REDIS_CA_FILE"


def redis_client_kwargs(url: str) -> dict:
    """Extra keyword arguments for redis.Redis.from_url(url, ...): ssl_ca_certs for rediss://."""
    if not url.startswith("rediss://"):
        return {}
    ca = os.environ.get(CA_FILE_ENV)
    if not ca:
        return {}
    if not os.path.isfile(ca):
        raise ValueError(f"{CA_FILE_ENV}={ca} is not a file; mount the Redis CA bundle there "
                         "or unset it to use the system CA store")
    return {"ssl_ca_certs": ca}
