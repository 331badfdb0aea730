"""The LoRA adapters of spec.loraAdapters onto the ready engine pods, over their admin endpoints.

Per ready pod: GET /v1/models (what it serves), then POST /v1/unload_lora_adapter and
/v1/load_lora_adapter for the difference (`lora.plan`). The keys are the engines' own: the admin
key (adminApiKeySecret, else apiKeySecret) for the admin endpoints, the API key for /v1/models;
the operator reads them from their Secrets (rbac.readSecrets). Decisions live in `lora`.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from . import lora as L
from . import redis_auth
from .crd import InferenceService, LoRAAdapterSpec, SecretRef
from .kube import KubeClient, KubeError

# (pod, adapter name, source) → (when it was refused, the engine's message)
Refusals = MutableMapping[tuple[str, str, str], tuple[float, str]]


@dataclass(slots=True)
class SyncState:
    """What the syncs of one InferenceService share across reconciles (kept in kopf's memo)."""
    refusals: Refusals = field(default_factory=dict)
    # NOTE: the change handler and the resync timer may run at once: two syncs reading the same
    # /v1/models would both load a missing adapter, and the second load is refused as a duplicate
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True, slots=True)
class Keys:
    api: str | None  # Bearer key of /v1/models (the engines' --api-key)
    admin: str | None  # Bearer key of the load / unload endpoints (--admin-api-key, else the API key)


@dataclass(slots=True)
class AdapterSync:
    """What one sync saw and did: status.loraAdapters, the condition, and the actions for Events."""
    statuses: list[dict[str, Any]]
    condition: dict[str, str]
    actions: list[tuple[str, str]] = field(default_factory=list)  # (event reason, message)


class KeyUnavailable(Exception):
    """A key's Secret cannot be read (absent, or no RBAC): (reason, message) for the condition."""


async def read_keys(kube: KubeClient, svc: InferenceService) -> Keys:
    api = await _secret_value(kube, svc, svc.api_key_secret, "apiKeySecret")
    admin = await _secret_value(kube, svc, svc.admin_api_key_secret, "adminApiKeySecret")
    return Keys(api=api, admin=admin or api)


async def _secret_value(kube: KubeClient, svc: InferenceService, ref: SecretRef | None, field_: str) -> str | None:
    if ref is None:
        return None
    try:
        secret = await kube.get("v1", "Secret", svc.namespace, ref.name)
    except KubeError as err:
        if err.status == 403:
            raise KeyUnavailable("SecretUnreadable", f"the operator may not read Secret {ref.name} (spec.{field_}), "
                                 "whose key the engines' adapter endpoints require: install the chart with "
                                 "rbac.readSecrets=true") from err
        raise
    if secret is None:
        raise KeyUnavailable("SecretMissing", f"Secret {ref.name} (spec.{field_}) does not exist: the engines "
                             "cannot start without it either")
    value = redis_auth.password_of(secret, ref.key)
    if value is None:
        raise KeyUnavailable("SecretMissing", f"Secret {ref.name} (spec.{field_}) has no key {ref.key!r}")
    return value


def ready_pods(pods: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(name, IP) of the engine pods that are Ready, not being deleted, and have an address."""
    out = []
    for p in pods:
        st, meta = p.get("status") or {}, p.get("metadata") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
        if ready and st.get("podIP") and not meta.get("deletionTimestamp"):
            out.append((meta.get("name") or st["podIP"], st["podIP"]))
    return sorted(out)


async def sync_adapters(kube: KubeClient, svc: InferenceService, pods: Sequence[dict[str, Any]], port: int,
                        state: SyncState, retry_seconds: float = 60.0, timeout_s: float = 120.0) -> AdapterSync:
    """Load / unload on every ready engine pod until each serves exactly spec.loraAdapters.

    A refused adapter is tried again on that pod after `retry_seconds` (or at once when its source
    changes): the engine re-reads (and may re-fetch) it on every try."""
    async with state.lock:
        return await _sync(kube, svc, pods, port, state.refusals, retry_seconds, timeout_s)


async def _sync(kube: KubeClient, svc: InferenceService, pods: Sequence[dict[str, Any]], port: int,
                refusals: Refusals, retry_seconds: float, timeout_s: float) -> AdapterSync:
    targets = ready_pods(pods)
    wanted = list(svc.lora_adapters)
    try:
        keys = await read_keys(kube, svc)
    except KeyUnavailable as err:
        reason, message = err.args
        return AdapterSync(L.adapter_statuses(wanted, []), L.adapters_condition([], 0, (reason, message)))
    actions: list[tuple[str, str]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        outcomes = await asyncio.gather(*(_sync_pod(http, name, f"http://{ip}:{port}", wanted, keys, refusals,
                                                    retry_seconds, actions) for name, ip in targets))
    live = {name for name, _ in targets}
    for key in [k for k in refusals if k[0] not in live]:
        del refusals[key]  # NOTE: pods come and go: forget the ones that went
    statuses = L.adapter_statuses(wanted, outcomes)
    return AdapterSync(statuses, L.adapters_condition(statuses, len(outcomes)), actions)


async def _sync_pod(http: aiohttp.ClientSession, pod: str, base: str, wanted: list[LoRAAdapterSpec], keys: Keys,
                    refusals: Refusals, retry_seconds: float, actions: list[tuple[str, str]]) -> L.PodOutcome:
    out = L.PodOutcome(pod)
    try:
        out.loaded = L.served(await _get_json(http, f"{base}/v1/models", keys.api))
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:
        out.unreachable = f"cannot read {base}/v1/models: {str(err) or type(err).__name__}"
        return out
    now = time.monotonic()
    skip = set()
    for a in wanted:
        refused = refusals.get((pod, a.name, a.source))
        if refused is not None and now - refused[0] < retry_seconds:
            skip.add(a.name)
            out.errors[a.name] = refused[1]
    step = L.plan(wanted, out.loaded, frozenset(skip))
    try:
        for name in step.unload:
            status, text = await _post(http, f"{base}/v1/unload_lora_adapter", {"lora_name": name}, keys.admin)
            if status == 200 or status == 404:  # NOTE: 404: unloaded by someone else meanwhile: as wanted
                out.loaded.pop(name, None)
                actions.append(("LoRAAdapterUnloaded", f"unloaded {name} from {pod}"))
            else:
                out.errors[name] = f"unload answered {status}: {text}"
        for a in step.load:
            status, text = await _post(http, f"{base}/v1/load_lora_adapter",
                                       {"lora_name": a.name, "lora_path": a.source}, keys.admin)
            if status == 200:
                out.loaded[a.name] = a.source
                refusals.pop((pod, a.name, a.source), None)
                actions.append(("LoRAAdapterLoaded", f"loaded {a.name} from {a.source} on {pod}"))
            else:
                out.errors[a.name] = text
                refusals[(pod, a.name, a.source)] = (time.monotonic(), text)
                actions.append(("LoRAAdapterRefused", f"{pod} refused {a.name}: {text}"))
    except (aiohttp.ClientError, TimeoutError) as err:
        out.unreachable = f"{base}: {str(err) or type(err).__name__}"
    return out


def _headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _get_json(http: aiohttp.ClientSession, url: str, key: str | None) -> dict[str, Any]:
    async with http.get(url, headers=_headers(key)) as resp:
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status}")
        return await resp.json()


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, str], key: str | None) -> tuple[int, str]:
    """(status, the answer's message: the text, or an OpenAI-style error's message)."""
    async with http.post(url, json=body, headers=_headers(key)) as resp:
        text = await resp.text()
        if resp.status != 200:
            try:
                text = (await resp.json(content_type=None))["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
        return resp.status, text
