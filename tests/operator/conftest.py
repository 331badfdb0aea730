"""Fixtures: an in-memory Kubernetes API (kmock) and the real kopf operator running against it."""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import jsonpatch
import jsonpointer
import kmock
import kopf
import pytest
import yaml

from kvmesh.operator.handlers import OperatorConfig, make_registry

NAMESPACE = "team-a"
CR_PATH = f"/apis/kvmesh.io/v1alpha1/namespaces/{NAMESPACE}/inferenceservices"
RESOURCES = {
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True),
    "v1/pods": kmock.ResourceInfo(kind="Pod", namespaced=True),
    # NOTE: with its verbs, so kopf's discovery lets the Secret watch (--watch-secrets) watch them
    "v1/secrets": kmock.ResourceInfo(kind="Secret", namespaced=True,
                                     verbs={"get", "list", "watch", "create", "patch", "delete"}),
    "v1/services": kmock.ResourceInfo(kind="Service", namespaced=True),
    "v1/configmaps": kmock.ResourceInfo(kind="ConfigMap", namespaced=True),
    "apps/v1/deployments": kmock.ResourceInfo(kind="Deployment", namespaced=True, subresources={"status", "scale"}),
    "networking.k8s.io/v1/networkpolicies": kmock.ResourceInfo(kind="NetworkPolicy", namespaced=True),
    "networking.k8s.io/v1/ingresses": kmock.ResourceInfo(kind="Ingress", namespaced=True, subresources={"status"}),
    "autoscaling/v2/horizontalpodautoscalers": kmock.ResourceInfo(kind="HorizontalPodAutoscaler", namespaced=True),
    "keda.sh/v1alpha1/scaledobjects": kmock.ResourceInfo(kind="ScaledObject", namespaced=True),
    "v1/serviceaccounts": kmock.ResourceInfo(kind="ServiceAccount", namespaced=True),
    "rbac.authorization.k8s.io/v1/roles": kmock.ResourceInfo(kind="Role", namespaced=True),
    "rbac.authorization.k8s.io/v1/rolebindings": kmock.ResourceInfo(kind="RoleBinding", namespaced=True),
    "inference.networking.k8s.io/v1/inferencepools": kmock.ResourceInfo(
        kind="InferencePool", namespaced=True, subresources={"status"}),
    "kvmesh.io/v1alpha1/inferenceservices": kmock.ResourceInfo(
        kind="InferenceService", singular="inferenceservice", namespaced=True, shortnames={"kisvc"},
        verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status", "scale"}),
}


@attrs.define(kw_only=True)
class StampingEmulator(kmock.KubernetesEmulator):
    """kmock plus what a real API server stamps on writes: resourceVersion, uid, generation, names.

    NOTE: without a changing resourceVersion kopf cannot tell its own writes from new ones and
    re-runs handlers; without generation there is no observedGeneration to check.
    """
    _version: int = attrs.field(default=0, init=False)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and isinstance(request.data, (dict, list)):
            # NOTE: kmock matches reactions against the request object it recorded, so the
            # stamped body must go into that same (frozen) object rather than a copy.
            if request.action == kmock.action.CREATE:
                object.__setattr__(request, "data", self._stamp_create(request.data))
            elif request.action == kmock.action.UPDATE:
                object.__setattr__(request, "data", self._stamp_patch(request, request.data))
        return await super()._handle(request)

    def _next(self) -> str:
        self._version += 1
        return str(self._version)

    def _stamp_create(self, data: dict[str, Any]) -> dict[str, Any]:
        rv = self._next()
        meta = dict(data.get("metadata") or {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{rv}"
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta.update(resourceVersion=rv, uid=f"uid-{rv}", generation=1, creationTimestamp=now)
        return {**data, "metadata": meta}

    def _stamp_patch(self, request: kmock.Request, data: Any) -> Any:
        rv = self._next()
        key = (request.resource, request.namespace, request.name)
        current: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            current = _plain(self.objects[key].raw)
        generation = int((current.get("metadata") or {}).get("generation") or 1)
        # NOTE: like the API server, bump the generation only when the spec really changes (a
        # patch that re-sends the same spec must not look like a new rollout to status checks).
        if isinstance(data, list):
            try:
                spec_changes = jsonpatch.apply_patch(current, data).get("spec") != current.get("spec")
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException):
                spec_changes = True
            ops = [{"op": "add", "path": "/metadata/resourceVersion", "value": rv}]
            if spec_changes:
                ops.append({"op": "add", "path": "/metadata/generation", "value": generation + 1})
            return list(data) + ops
        spec_changes = (request.subresource != "status" and "spec" in data
                        and _merged(current.get("spec"), data["spec"]) != current.get("spec"))
        meta = dict(data.get("metadata") or {})
        meta["resourceVersion"] = rv
        if spec_changes:
            meta["generation"] = generation + 1
        return {**data, "metadata": meta}


def _merged(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merged(out.get(k), v)
    return out


async def wait_for(check: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll `check` (yielding to kmock's server) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except (KeyError, IndexError, TypeError) as err:
            last_error = err
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (last error: {last_error!r})")


@contextlib.contextmanager
def _operator_thread(config: OperatorConfig) -> Iterator[kopf.Memo]:
    # NOTE: kopf cancels every task of its event loop on exit, so it gets a loop and thread of its own.
    stop, memo = threading.Event(), kopf.Memo()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(kopf.operator(registry=make_registry(config), standalone=True, clusterwide=True,
                                      stop_flag=stop, memo=memo))
        except BaseException as err:  # noqa: BLE001 - surfaced to the test below
            errors.append(err)

    thread = threading.Thread(target=target, name="kopf", daemon=True)
    thread.start()
    try:
        yield memo
    finally:
        stop.set()
        thread.join(timeout=15)
        assert not errors, errors


@pytest.fixture()
def operator_config() -> OperatorConfig:
    return OperatorConfig(resync_seconds=0.3, cleanup_retries=2, cleanup_delay_seconds=0.1)


@pytest.fixture()
async def cluster(kmock: StampingEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  operator_config: OperatorConfig) -> Any:
    """kmock with our resources declared and the operator running cluster-wide.

    NOTE: kmock cannot parse the cluster-wide namespace list kopf makes for `--namespace`, so the
    test operator runs cluster-wide; objects live in NAMESPACE."""
    for key, info in RESOURCES.items():
        kmock.resources[key] = info
    kubeconfig = {"apiVersion": "v1", "kind": "Config", "current-context": "kmock",
                  "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
                  "users": [{"name": "test", "user": {"token": "test-token"}}],
                  "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}]}
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    with _operator_thread(operator_config):
        await wait_for(lambda: any(r.params.get("watch") == "true" and r.url.path.endswith("/inferenceservices")
                                   for r in list(kmock)), what="kopf's watch on inferenceservices")
        yield kmock


def obj(server: Any, resource: str, name: str) -> dict[str, Any] | None:
    """The live object, or None when absent or deleted."""
    key = (kmock.resource(resource), NAMESPACE, name)
    if key not in server.objects or server.objects[key].deleted:
        return None
    return _plain(server.objects[key].raw)


def _plain(value: Any) -> Any:
    if hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value

