"""An s3:// / hf:// model in an engine pod: the init container that fetches it, the volume it
fetches into, and the variables the fetch reads.

    engine pod:  initContainer fetch-model  `kvmesh fetch URI` (same image)  ─┐
                 container engine           `kvmesh serve` (model: URI)      ─┴─▶ FETCH_CACHE_DIR
                                                        (the URI resolves to the fetched copy: a cache hit)

The volume is spec.model.cache: a node directory (hostPath: a second engine on the node starts
without fetching), a PersistentVolumeClaim, or by default an emptyDir (one fetch per pod).
"""
from __future__ import annotations

from typing import Any, Sequence

from kvmesh.common.storage.summary import TERMINATION_LOG, FetchSummary

from .crd import InferenceService

FETCH_CACHE_DIR = "/var/cache/kvmesh/models"     # KVMESH_MODEL_CACHE_DIR in the pods
VOLUME = "fetched-models"


def fetch_env(svc: InferenceService) -> list[dict[str, Any]]:
    """The variables `kvmesh fetch` and `kvmesh serve` read: the cache, the endpoint, the bound
    and the Secret's credentials (each optional: a key the Secret lacks is left unset)."""
    m = svc.model
    # NOTE: HF_HUB_CACHE puts hf:// models in the shared volume (the engine's HF_HOME is per pod)
    env = [{"name": "KVMESH_MODEL_CACHE_DIR", "value": FETCH_CACHE_DIR},
           {"name": "HF_HUB_CACHE", "value": f"{FETCH_CACHE_DIR}/hub"}]
    if m.endpoint is not None:
        env.append({"name": "AWS_ENDPOINT_URL", "value": m.endpoint})
    if m.cache.max_size is not None:
        env.append({"name": "KVMESH_MODEL_CACHE_MAX_SIZE", "value": m.cache.max_size})
    if m.credentials is not None:
        env += [{"name": var, "valueFrom": {"secretKeyRef": {"name": m.credentials.secret_name, "key": key,
                                                             "optional": True}}}
                for var, key in m.credentials.keys]
    return env


def cache_volume(svc: InferenceService) -> dict[str, Any]:
    c = svc.model.cache
    if c.host_path is not None:
        return {"name": VOLUME, "hostPath": {"path": c.host_path, "type": "DirectoryOrCreate"}}
    if c.claim_name is not None:
        return {"name": VOLUME, "persistentVolumeClaim": {"claimName": c.claim_name}}
    return {"name": VOLUME, "emptyDir": {}}


def cache_mount() -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": FETCH_CACHE_DIR}


def fetch_init_container(svc: InferenceService, security: dict[str, Any]) -> dict[str, Any]:
    """`kvmesh fetch URI` before the engine starts: the pod's events and the init container's
    log say why a model cannot be had (the URI, never a credential)."""
    return {"name": "fetch-model", "image": svc.image, "imagePullPolicy": svc.image_pull_policy,
            "args": ["fetch", svc.model.uri, "--summary-file", TERMINATION_LOG], "env": fetch_env(svc),
            "volumeMounts": [cache_mount(), {"name": "tmp", "mountPath": "/tmp"}],
            "terminationMessagePolicy": "FallbackToLogsOnError", "securityContext": security}


_MESSAGE_CHARS = 512


def model_condition(svc: InferenceService, pods: Sequence[dict[str, Any]]) -> dict[str, str] | None:
    """ModelReady from the engine pods' fetch-model init containers (None: nothing to fetch).
    True once one pod has the model; a failed fetch shows `kvmesh fetch`'s own error line."""
    if not svc.model.remote:
        return None
    uri = svc.model.uri
    states = [_fetch_state(p) for p in pods]
    done = sum(1 for s, _ in states if s == "done")
    if done:
        return _cond(True, "Fetched", f"{uri} fetched by {done}/{len(pods)} engine pod(s)")
    failed = [m for s, m in states if s == "failed"]
    if failed:
        return _cond(False, "FetchFailed", failed[0])
    fetching = sum(1 for s, _ in states if s == "fetching")
    if fetching:
        return _cond(False, "Fetching", f"fetching {uri} ({fetching} engine pod(s))")
    return _cond(False, "AwaitingPods", f"no engine pod has started fetching {uri} yet")


def storage_status(svc: InferenceService, pods: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """status.modelStorage: the model's size and fetch time from the fetch-model containers'
    summaries (their termination messages); None when no pod has one. The fetch reported is the
    one that read the most from the store (a download beats a node-cache hit; ties: the slowest),
    `cachedPods` counts the pods that found the model in their node's cache."""
    summaries = []
    for pod in pods:
        statuses = (pod.get("status") or {}).get("initContainerStatuses") or []
        st = next((s for s in statuses if s.get("name") == "fetch-model"), None)
        terminated = ((st or {}).get("state") or {}).get("terminated") or {}
        if terminated.get("exitCode") == 0:
            summary = FetchSummary.parse(terminated.get("message"))
            if summary is not None and summary.uri == svc.model.uri:
                summaries.append(summary)
    if not summaries:
        return None
    best = max(summaries, key=lambda s: (s.fetched_bytes, s.seconds))
    return {"uri": best.uri, "sizeBytes": best.size_bytes, "fetchedBytes": best.fetched_bytes,
            "fetchSeconds": best.seconds,
            "cachedPods": sum(1 for s in summaries if s.fetched_bytes == 0)}


def _cond(ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": "ModelReady", "status": "True" if ok else "False", "reason": reason, "message": message}


def _fetch_state(pod: dict[str, Any]) -> tuple[str | None, str]:
    """("done" | "failed" | "fetching" | None, the failure's message) of one pod's fetch."""
    statuses = (pod.get("status") or {}).get("initContainerStatuses") or []
    st = next((s for s in statuses if s.get("name") == "fetch-model"), None)
    if st is None:
        return None, ""
    state, last = st.get("state") or {}, st.get("lastState") or {}
    running = "running" in state
    # NOTE: a container restarted after a failure is waiting again; the failure is in lastState
    for terminated in (state.get("terminated"), None if running else last.get("terminated")):
        if terminated is None:
            continue
        if terminated.get("exitCode") == 0:
            return "done", ""
        return "failed", _failure(terminated)
    return ("fetching", "") if running else (None, "")


def _failure(terminated: dict[str, Any]) -> str:
    # NOTE: the container's terminationMessagePolicy FallbackToLogsOnError makes the message its
    # last log lines, the last of which is `kvmesh fetch: error: URI: ...`
    lines = [ln for ln in (terminated.get("message") or "").splitlines() if ln.strip()]
    if lines:
        return lines[-1][-_MESSAGE_CHARS:]
    return f"the fetch-model container exited with code {terminated.get('exitCode')} ({terminated.get('reason')})"
