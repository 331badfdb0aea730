"""Create-or-patch of one child, idempotently.

NOTE: the API server fills defaults into what we send (protocols, quantities as strings, probe
timeouts…), so comparing the desired object with the live one field by field would see drift
forever. Instead every child carries the hash of the object we last sent; a child is patched
only when its desired form changes, and recreated when it is gone.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .kube import KubeClient

APPLIED_HASH = "kvmesh.io/applied-hash"


@dataclass(frozen=True, slots=True)
class Applied:
    obj: dict[str, Any]  # the object as the API server returned it
    action: str  # created | patched | unchanged


def desired_hash(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _with_hash(obj: dict[str, Any], digest: str) -> dict[str, Any]:
    meta = dict(obj["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), APPLIED_HASH: digest}
    return {**obj, "metadata": meta}


def patch_ops(desired: dict[str, Any], live: dict[str, Any]) -> list[dict[str, Any]]:
    """A JSON patch making `live` carry everything of `desired` (lists and maps we own are replaced)."""
    ops: list[dict[str, Any]] = []
    meta, live_meta = desired["metadata"], live.get("metadata") or {}
    ops.append({"op": "add", "path": "/metadata/labels", "value": meta["labels"]})
    ops.append({"op": "add", "path": "/metadata/ownerReferences", "value": meta["ownerReferences"]})
    if live_meta.get("annotations"):
        # NOTE: keep annotations other controllers add (e.g. deployment.kubernetes.io/revision).
        for key, value in meta.get("annotations", {}).items():
            ops.append({"op": "add", "path": "/metadata/annotations/" + key.replace("~", "~0").replace("/", "~1"),
                        "value": value})
    else:
        ops.append({"op": "add", "path": "/metadata/annotations", "value": meta.get("annotations", {})})
    for key, value in desired.items():
        if key in ("apiVersion", "kind", "metadata"):
            continue
        if key == "spec" and desired["kind"] == "Deployment" and "replicas" not in value:
            live_replicas = (live.get("spec") or {}).get("replicas")
            if live_replicas is not None:  # an HPA / KEDA owns the count: keep it
                value = {"replicas": live_replicas, **value}
        ops.append({"op": "add", "path": f"/{key}", "value": value})
    return ops


async def apply(kube: KubeClient, desired: dict[str, Any]) -> Applied:
    """Create `desired` if absent, patch it if its desired form changed, else leave it alone."""
    api_version, kind, meta = desired["apiVersion"], desired["kind"], desired["metadata"]
    digest = desired_hash(desired)
    stamped = _with_hash(desired, digest)
    live = await kube.get(api_version, kind, meta["namespace"], meta["name"])
    if live is None or (live.get("metadata") or {}).get("deletionTimestamp"):
        if live is not None:  # being deleted behind our back: wait for it to go, then recreate
            return Applied(live, "unchanged")
        return Applied(await kube.create(stamped), "created")
    if ((live.get("metadata") or {}).get("annotations") or {}).get(APPLIED_HASH) == digest:
        return Applied(live, "unchanged")
    ops = patch_ops(stamped, live)
    return Applied(await kube.json_patch(api_version, kind, meta["namespace"], meta["name"], ops), "patched")
