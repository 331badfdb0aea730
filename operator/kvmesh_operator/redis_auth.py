"""PURE: the Redis password Secret → the checksum on the pod templates (a rotated password rolls the pods).

The engines, the router and the managed Redis read the password once, at start (env / config file),
so a new password only takes effect in new pods: the pod templates carry this checksum, and a
different one is a new template. The checksum is a truncated SHA-256 of the password alone: it is
recorded in the InferenceService's status (for when the operator may not read the Secret back) and
reveals nothing usable about a 32-byte random password.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping
from typing import Any

# NOTE: an annotation of the InferenceService the Secret watch writes to make kopf re-run the
# reconcile; outside the kvmesh.io/ prefix, whose annotations kopf keeps out of its diffs.
TRIGGER_ANNOTATION = "secrets.kvmesh.io/redis-auth"


def checksum(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()[:16]


def password_of(secret: Mapping[str, Any] | None, key: str) -> str | None:
    """The value of `key` in a Secret as the API returns it (`data`, base64), or None when absent.

    `stringData` is write-only on a real API server; it is read too for servers that store it as sent.
    """
    if not secret:
        return None
    raw = (secret.get("data") or {}).get(key)
    if raw is not None:
        try:
            return base64.b64decode(raw, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
    value = (secret.get("stringData") or {}).get(key)
    return value if isinstance(value, str) else None


def secret_checksum(secret: Mapping[str, Any] | None, key: str) -> str | None:
    password = password_of(secret, key)
    return None if password is None else checksum(password)


def owner_name(secret: Mapping[str, Any], kind: str, api_version: str) -> str | None:
    """The InferenceService controlling a Secret (its controller ownerReference), or None."""
    for ref in (secret.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") is True and ref.get("kind") == kind and ref.get("apiVersion") == api_version:
            return ref.get("name")
    return None
