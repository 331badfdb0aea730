"""A small async client for the few kinds the operator manages (aiohttp, which kopf already uses).

Built from the same `kopf.ConnectionInfo` kopf logs in with, so in-cluster, kubeconfig and test
servers all work the same way. Objects are plain dicts in and out.
"""
from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import kopf

_PLURALS = {
    "ConfigMap": "configmaps", "Service": "services", "Secret": "secrets", "Pod": "pods",
    "Deployment": "deployments", "Ingress": "ingresses", "NetworkPolicy": "networkpolicies",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers", "ScaledObject": "scaledobjects",
    "InferenceService": "inferenceservices", "ServiceAccount": "serviceaccounts", "Role": "roles",
    "RoleBinding": "rolebindings", "InferencePool": "inferencepools",
}


class KubeError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_NAME = re.compile(r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    # NOTE: names come from users' specs (a Secret to read at deletion): only plain DNS names, so a
    # request can never leave the resource's own namespace ("../", "%2F", "other-ns/x").
    if not _NAMESPACE.match(namespace) or (name is not None and (not _NAME.match(name) or ".." in name)):
        raise ValueError(f"refusing object path for namespace {namespace!r}, name {name!r}")
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{_PLURALS[kind]}"
    return f"{path}/{name}" if name else path


class KubeClient:
    """GET / POST / PATCH / DELETE of namespaced objects; one aiohttp session per client."""

    def __init__(self, info: kopf.ConnectionInfo) -> None:
        self._info = info
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl: Any = False if self._info.insecure else self._info.as_ssl_context()
            if not self._info.server.startswith("https"):
                ssl = None
            self._session = aiohttp.ClientSession(
                headers=self._info.as_http_headers(), connector=aiohttp.TCPConnector(ssl=ssl),
                timeout=aiohttp.ClientTimeout(total=30))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                    params: dict[str, str] | None = None) -> dict[str, Any] | None:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        url = self._info.server.rstrip("/") + path
        async with self._http().request(method, url, data=data, headers=headers, params=params) as resp:
            text = await resp.text()
            if resp.status == 404 and method in ("GET", "DELETE"):
                return None
            if resp.status >= 300:
                try:
                    message = json.loads(text).get("message", text)
                except ValueError:
                    message = text
                raise KubeError(resp.status, f"{method} {path}: {message}")
            return json.loads(text) if text else {}

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._call("GET", object_path(api_version, kind, namespace, name))

    async def list(self, api_version: str, kind: str, namespace: str,
                   label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        out = await self._call("GET", object_path(api_version, kind, namespace), params=params)
        return list((out or {}).get("items") or [])

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        out = await self._call("POST", object_path(obj["apiVersion"], obj["kind"], meta["namespace"]), obj)
        assert out is not None
        return out

    async def json_patch(self, api_version: str, kind: str, namespace: str, name: str,
                         ops: list[dict[str, Any]], subresource: str | None = None) -> dict[str, Any]:
        path = object_path(api_version, kind, namespace, name) + (f"/{subresource}" if subresource else "")
        out = await self._call("PATCH", path, ops, "application/json-patch+json")
        assert out is not None
        return out

    async def merge_patch(self, api_version: str, kind: str, namespace: str, name: str,
                          body: dict[str, Any]) -> dict[str, Any]:
        out = await self._call("PATCH", object_path(api_version, kind, namespace, name), body,
                               "application/merge-patch+json")
        assert out is not None
        return out

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete in the background (children go with their owner); False if it was already gone."""
        out = await self._call("DELETE", object_path(api_version, kind, namespace, name),
                               {"propagationPolicy": "Background"})
        return out is not None
