"""Create-or-patch of one child, idempotently, reverting edits made behind the operator's back.

NOTE: the API server fills defaults into what we send (protocols, quantities as strings, probe
timeouts…), and admission webhooks may mutate it, so comparing the desired object with the live one
field by field would see drift forever. Two records instead:

- every child carries `kvmesh.io/applied-hash`, the hash of the object we last sent: a child is
  patched when its desired form changes, and recreated when it is gone;
- the InferenceService's `status.childFingerprints` keeps, per child, a fingerprint of the object as
  the API server returned it from our own create or patch (defaults and webhook mutations included).
  Defaults are applied once, at write time, so the stored object stays the same until somebody
  writes it again: a live fingerprint that differs from the recorded one means someone else changed
  the child, and it is patched back.

The fingerprint covers every top-level field but `metadata` and `status` (`spec`, ConfigMap `data`):
metadata is shared with other tools (revision annotations, labels added by GitOps tools), and status
belongs to controllers. It leaves out what others may own: a Deployment's `spec.replicas` when an
HPA / KEDA owns the count (the desired spec has none), and the pod template's
`kubectl.kubernetes.io/restartedAt` (`kubectl rollout restart`), which patches keep. Generations
would not do: a Service or ConfigMap has none, and an HPA's scale bumps the Deployment's.
A child without a recorded fingerprint (the status was lost or predates this) is patched once to
record one. A cluster upgrade that defaults a new field reads as one edit: one patch, then steady.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .kube import KubeClient, KubeError

APPLIED_HASH = "kvmesh.io/applied-hash"
RESTARTED_AT = "kubectl.kubernetes.io/restartedAt"


class NotOwned(Exception):
    """A live object has the child's name but is not controlled by this InferenceService: never adopted."""

    def __init__(self, kind: str, name: str, uid: str) -> None:
        super().__init__(f"{kind} {name} exists and is not controlled by this InferenceService (no controller "
                         f"ownerReference to uid {uid}); it is left untouched: delete or rename it, or rename "
                         f"this InferenceService")
        self.kind, self.name = kind, name


def controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Does `obj` carry our controller ownerReference (the only proof that the operator made it)?"""
    owners = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(o.get("uid") == uid and o.get("controller") is True for o in owners)


def owner_uid(desired: Mapping[str, Any]) -> str:
    return str(desired["metadata"]["ownerReferences"][0]["uid"])


@dataclass(frozen=True, slots=True)
class Applied:
    obj: dict[str, Any]  # the object as the API server returned it
    action: str  # created | patched | reverted | unchanged
    fingerprint: str  # of `obj`, to record for the next sync (see `live_fingerprint`)


def desired_hash(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint_key(obj: Mapping[str, Any]) -> str:
    """`Kind/name`: the key of a child in `status.childFingerprints` (names are unique per kind)."""
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _with_hash(obj: dict[str, Any], digest: str) -> dict[str, Any]:
    meta = dict(obj["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), APPLIED_HASH: digest}
    return {**obj, "metadata": meta}


def _owns_replicas(desired: Mapping[str, Any]) -> bool:
    return desired["kind"] != "Deployment" or "replicas" in (desired.get("spec") or {})


def _template_annotations(obj: Mapping[str, Any]) -> dict[str, Any]:
    template = (obj.get("spec") or {}).get("template") or {}
    return dict((template.get("metadata") or {}).get("annotations") or {})


def _without_restarted_at(spec: dict[str, Any]) -> dict[str, Any]:
    annotations = _template_annotations({"spec": spec})
    if RESTARTED_AT not in annotations:
        return spec
    del annotations[RESTARTED_AT]
    template = spec["template"]
    return {**spec, "template": {**template, "metadata": {**template["metadata"], "annotations": annotations}}}


def live_fingerprint(desired: Mapping[str, Any], live: Mapping[str, Any]) -> str:
    """A hash of the fields of `live` the operator owns (see the module docstring)."""
    owned = {k: v for k, v in live.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    if desired["kind"] == "Deployment" and isinstance(owned.get("spec"), dict):
        spec = _without_restarted_at(dict(owned["spec"]))
        if not _owns_replicas(desired):
            spec.pop("replicas", None)
        owned["spec"] = spec
    return desired_hash(owned)


def fingerprints_update(previous: Mapping[str, Any], current: Mapping[str, str]) -> dict[str, str | None]:
    """The merge patch for `status.childFingerprints`: the current ones, None for children gone."""
    return {**{key: None for key in previous if key not in current}, **current}


def _kept_spec(desired: dict[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """The desired Deployment spec plus what others own in the live one (replicas, restartedAt)."""
    value, live_spec = desired["spec"], live.get("spec") or {}
    if not _owns_replicas(desired) and live_spec.get("replicas") is not None:
        value = {"replicas": live_spec["replicas"], **value}  # an HPA / KEDA owns the count: keep it
    restarted = _template_annotations(live).get(RESTARTED_AT)
    if restarted is not None and "template" in value:
        template = value["template"]
        meta = template.get("metadata") or {}
        annotations = {**(meta.get("annotations") or {}), RESTARTED_AT: restarted}
        value = {**value, "template": {**template, "metadata": {**meta, "annotations": annotations}}}
    return value


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
        if key == "spec" and desired["kind"] == "Deployment":
            value = _kept_spec(desired, live)
        ops.append({"op": "add", "path": f"/{key}", "value": value})
    return ops


def decide(desired: dict[str, Any], digest: str, live: Mapping[str, Any] | None, recorded: str | None) -> str:
    """What to do with one child: create | wait | patch | revert | keep."""
    if live is None:
        return "create"
    if (live.get("metadata") or {}).get("deletionTimestamp"):
        return "wait"  # being deleted behind our back: wait for it to go, then recreate
    if ((live.get("metadata") or {}).get("annotations") or {}).get(APPLIED_HASH) != digest or recorded is None:
        return "patch"
    return "keep" if live_fingerprint(desired, live) == recorded else "revert"


async def apply(kube: KubeClient, desired: dict[str, Any], recorded: str | None = None) -> Applied:
    """Create `desired` if absent, patch it if its desired form or its live fields changed, else leave it.

    `recorded`: the fingerprint this child had after the operator's last write, if known.
    Raises NotOwned, writing nothing, when a same-named object is not controlled by our owner.
    """
    api_version, kind, meta = desired["apiVersion"], desired["kind"], desired["metadata"]
    digest = desired_hash(desired)
    stamped = _with_hash(desired, digest)
    live = await kube.get(api_version, kind, meta["namespace"], meta["name"])
    # NOTE: a same-named object someone else made (another service's child, a user's own Service)
    # is never patched: patching would rewrite its spec and ownerReferences, i.e. take it over.
    if live is not None and not controlled_by(live, owner_uid(desired)):
        raise NotOwned(kind, meta["name"], owner_uid(desired))
    action = decide(desired, digest, live, recorded)
    if action == "create":
        try:
            out = await kube.create(stamped)
        except KubeError as err:
            # NOTE: created meanwhile (a resync racing the change handler, or someone else): look again.
            if err.status != 409 or (live := await kube.get(api_version, kind, meta["namespace"], meta["name"])) is None:
                raise
            if not controlled_by(live, owner_uid(desired)):
                raise NotOwned(kind, meta["name"], owner_uid(desired)) from err
            return Applied(live, "unchanged", live_fingerprint(desired, live))
        return Applied(out, "created", live_fingerprint(desired, out))
    assert live is not None
    if action in ("wait", "keep"):
        return Applied(live, "unchanged", live_fingerprint(desired, live))
    out = await kube.json_patch(api_version, kind, meta["namespace"], meta["name"], patch_ops(stamped, live))
    return Applied(out, "reverted" if action == "revert" else "patched", live_fingerprint(desired, out))
