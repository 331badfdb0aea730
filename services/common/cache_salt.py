"""Per-tenant prefix-cache isolation: the cache salt derived from the caller's API key or a tenant
header (`--cache-salt-from`), the same on the API server and the router.

Without it, any client can learn whether another client sent a prompt (its `cached_tokens`, or
a faster first token). With it, each tenant's block hashes start from its own salt, so blocks are
shared within a tenant only. The client's own `cache_salt` is appended to the tenant's, never
replaces it: a client cannot step into another tenant's cache.
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

_DOMAIN = b"kvmesh-cache-salt-v1"   # HMAC key: the salt is never the raw key or header value
CHOICES = "none, api-key or header:NAME"


@dataclass(frozen=True, slots=True)
class CacheSaltSource:
    kind: str = "none"            # "none", "api-key" (the Bearer token) or "header"
    header: str | None = None     # the tenant header's name when kind == "header"

    @classmethod
    def parse(cls, spec: str | None) -> CacheSaltSource:
        spec = (spec or "none").strip()
        if spec in ("none", "api-key"):
            return cls(spec)
        if spec.startswith("header:") and spec[len("header:"):].strip():
            return cls("header", spec[len("header:"):].strip().lower())
        raise ValueError(f"--cache-salt-from must be {CHOICES}, got {spec!r}")

    def salt(self, headers: Mapping[str, str], client_salt: object) -> str | None:
        """The cache salt for one request (`headers`: case-insensitive, e.g. Starlette's)."""
        client = client_salt if isinstance(client_salt, str) and client_salt else None
        if self.kind == "none":
            return client
        if self.kind == "api-key":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            value = token.strip() if scheme.lower() == "bearer" else ""
        else:
            value = headers.get(self.header, "")
        # NOTE: a request without the key or header gets the salt of "": the anonymous tenant.
        tenant = hmac.new(_DOMAIN, value.encode(), hashlib.sha256).hexdigest()
        # NOTE: a fixed-length hex prefix: no (tenant, client) pair can spell another's salt.
        return tenant if client is None else f"{tenant}:{client}"
