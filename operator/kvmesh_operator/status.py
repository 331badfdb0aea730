"""PURE status: the children's observed state → phase, replica counts, URL and KServe-style conditions.

Conditions: ChildrenOwned (only when a child's name is taken by an object the operator does not own),
ModelReady (only for an s3:// / hf:// model: its fetch by the engine pods' init containers), EnginesReady
(DisaggregationReady instead with spec.disaggregation: both roles' engines), RouterReady, RedisReady, IngressReady, AutoscalingReady (only in hpa and keda modes),
InferencePoolReady (only in router.mode inference-pool: the pool's conditions as its gateways report
them), AdaptersReady (only with LoRA on: spec.loraAdapters on every ready engine pod, see `lora`), and
Ready (all of them True).
`lastTransitionTime` only moves when a condition's status flips.
"""
from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Any

from . import disaggregation as D
from . import inference_pool as IP
from . import model_fetch as MF
from . import resources as R
from . import role_autoscaling as RA
from .crd import InferenceService

CONDITION_TYPES = ("ModelReady", "EnginesReady", "RouterReady", "RedisReady", "IngressReady", "AutoscalingReady",
                   "InferencePoolReady", "AdaptersReady", "DisaggregationReady")
Observed = dict[tuple[str, str, str], dict[str, Any] | None]  # child key → object as the API returned it


def _cond(type_: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def _ready(obj: dict[str, Any] | None) -> int:
    return int(((obj or {}).get("status") or {}).get("readyReplicas") or 0)


def _unobserved(dep: dict[str, Any]) -> str | None:
    """Why the Deployment controller has not caught up with the latest spec, or None when it has.

    NOTE: right after the operator patches a Deployment its status still describes the previous
    generation (all old pods ready), so readiness counts mean nothing until the controller has
    observed the new generation.
    """
    generation = (dep.get("metadata") or {}).get("generation")
    observed = (dep.get("status") or {}).get("observedGeneration")
    if generation is not None and (observed is None or int(observed) < int(generation)):
        return f"the Deployment controller has not observed generation {generation} yet (at {observed or 0})"
    return None


def engines_condition(dep: dict[str, Any] | None, want: int) -> dict[str, str]:
    if dep is None:
        return _cond("EnginesReady", False, "DeploymentMissing", "the engine Deployment does not exist yet")
    st = dep.get("status") or {}
    for c in st.get("conditions") or []:
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
            return _cond("EnginesReady", False, "ProgressDeadlineExceeded", c.get("message", "rollout stuck"))
    # NOTE: with no pod ready yet the counts cannot claim too much (AwaitingPods below).
    if (pending := _unobserved(dep)) is not None and _ready(dep) > 0:
        return _cond("EnginesReady", False, "RollingUpdate", pending)
    ready, updated = _ready(dep), int(st.get("updatedReplicas") or 0)
    available = int(st.get("availableReplicas") or 0)
    # NOTE: pods of an older template still running (updated < total) means a rollout is under way.
    rolling = updated < int(st.get("replicas") or 0)
    if want == 0:
        return _cond("EnginesReady", True, "ScaledToZero", "0 engine pods wanted")
    if ready >= want and available >= want and updated >= want and not rolling:
        return _cond("EnginesReady", True, "MinimumReplicasAvailable", f"{ready}/{want} engine pods ready")
    if rolling or (ready >= want and updated < want):
        return _cond("EnginesReady", False, "RollingUpdate", f"{updated}/{want} engine pods updated, {ready} ready")
    if ready >= want:
        return _cond("EnginesReady", False, "PartiallyReady",
                     f"{available}/{want} engine pods available ({ready} ready, not yet for minReadySeconds)")
    if ready > 0:
        return _cond("EnginesReady", False, "PartiallyReady", f"{ready}/{want} engine pods ready")
    return _cond("EnginesReady", False, "AwaitingPods", f"0/{want} engine pods ready (loading the model?)")


def _deployment_condition(type_: str, dep: dict[str, Any] | None, what: str) -> dict[str, str]:
    if dep is None:
        return _cond(type_, False, "DeploymentMissing", f"the {what} Deployment does not exist yet")
    if (pending := _unobserved(dep)) is not None and _ready(dep) > 0:
        return _cond(type_, False, "RollingUpdate", pending)
    if _ready(dep) >= 1:
        return _cond(type_, True, "MinimumReplicasAvailable", f"{_ready(dep)} {what} pod(s) ready")
    return _cond(type_, False, "AwaitingPods", f"no {what} pod is ready yet")


def _ingress_address(ing: dict[str, Any] | None) -> str | None:
    for entry in (((ing or {}).get("status") or {}).get("loadBalancer") or {}).get("ingress") or []:
        if entry.get("hostname") or entry.get("ip"):
            return entry.get("hostname") or entry.get("ip")
    return None


def autoscaling_condition(svc: InferenceService, observed: Observed,
                          forbidden: Set[str]) -> dict[str, str] | None:
    """hpa / keda modes only: is the HPA or ScaledObject there? None when the operator scales (or nothing)."""
    a = svc.autoscaling
    if not a.enabled or a.mode == "operator":
        return None
    api_version, kind = (("autoscaling/v2", "HorizontalPodAutoscaler") if a.mode == "hpa"
                         else ("keda.sh/v1alpha1", "ScaledObject"))
    if kind in forbidden:
        value = R.OPTIONAL_KINDS[kind]
        return _cond("AutoscalingReady", False, "Forbidden",
                     f"the operator may not manage {kind} objects: install the chart with {value}=true "
                     f"(or grant get/create/patch/delete on them); the engines run unscaled")
    if observed.get((api_version, kind, R.engine_name(svc))) is None:
        return _cond("AutoscalingReady", False, f"{kind}Missing", f"the {kind} does not exist yet")
    return _cond("AutoscalingReady", True, "Managed",
                 f"{kind} {R.engine_name(svc)} scales the engines within {a.min_replicas}-{a.max_replicas}")


def inference_pool_condition(svc: InferenceService, observed: Observed,
                             forbidden: Set[str]) -> dict[str, str] | None:
    """router.mode inference-pool only: the InferencePool's `status.parents[].conditions`, one line per
    parent (gateway). True when at least one parent accepted the pool and resolved its references."""
    if svc.router.mode != "inference-pool":
        return None
    if "InferencePool" in forbidden:
        return _cond("InferencePoolReady", False, "Forbidden",
                     "the operator may not manage InferencePool objects: install the chart with "
                     "rbac.inferencePool=true (and the InferencePool CRD)")
    pool = observed.get((IP.POOL_API_VERSION, "InferencePool", svc.name))
    if pool is None:
        return _cond("InferencePoolReady", False, "InferencePoolMissing", "the InferencePool does not exist yet")
    parents = ((pool.get("status") or {}).get("parents") or [])
    if not parents:
        return _cond("InferencePoolReady", False, "NoParents",
                     f"no Gateway has accepted InferencePool {svc.name} yet: route an HTTPRoute to it")
    lines, ready = [], False
    for parent in parents:
        ref = parent.get("parentRef") or {}
        conds = {c.get("type"): c for c in parent.get("conditions") or []}
        lines.append(f"{ref.get('kind', 'Gateway')} {ref.get('namespace', svc.namespace)}/{ref.get('name', '?')}: "
                     + ", ".join(f"{t}={c.get('status')} ({c.get('reason')})" for t, c in conds.items()))
        ready = ready or all(conds.get(t, {}).get("status") == "True" for t in ("Accepted", "ResolvedRefs"))
    return _cond("InferencePoolReady", ready, "Accepted" if ready else "NotAccepted", "; ".join(lines))


def conditions(svc: InferenceService, observed: Observed, want: int,
               forbidden: Set[str] = frozenset(), conflicts: Sequence[str] = (),
               pods: Sequence[dict[str, Any]] = (), adapters: dict[str, str] | None = None) -> list[dict[str, str]]:
    """The component conditions plus Ready, without timestamps; `forbidden`: optional kinds RBAC refuses;
    `conflicts`: children whose names are taken by objects the operator does not own (ChildrenOwned);
    `pods`: the engine pods (ModelReady of an s3:// / hf:// model reads their fetch-model containers);
    `adapters`: AdaptersReady as `lora.adapters_condition` made it (None: LoRA off)."""
    out = []
    if conflicts:
        out.append(_cond("ChildrenOwned", False, "NameConflict", "; ".join(conflicts)))
    if (model := MF.model_condition(svc, pods)) is not None:
        out.append(model)
    if svc.disaggregation is None:
        out += [engines_condition(observed.get(("apps/v1", "Deployment", R.engine_name(svc))), want)]
    else:
        # NOTE: disaggregated engines: two Deployments, one condition naming both roles
        out.append(D.disaggregation_condition(svc, observed))
    if svc.router.builtin:
        out.append(_deployment_condition("RouterReady", observed.get(("apps/v1", "Deployment", R.router_name(svc))),
                                         "router"))
    elif svc.router.mode == "inference-pool":
        out.append(_deployment_condition("RouterReady", observed.get(("apps/v1", "Deployment", IP.epp_name(svc))),
                                         "endpoint picker"))
    else:
        out.append(_cond("RouterReady", True, "Disabled", "router disabled; the Service selects the engines"))
    if not R.needs_redis(svc):
        out.append(_cond("RedisReady", True, "NotUsed", "vLLM engines behind an InferencePool use no kvmesh index"))
    elif svc.redis.managed:
        out.append(_deployment_condition("RedisReady", observed.get(("apps/v1", "Deployment", R.redis_name(svc))),
                                         "redis"))
    else:
        out.append(_cond("RedisReady", True, "External", "using the external Redis from spec.redis.url"))
    if not svc.ingress.enabled:
        out.append(_cond("IngressReady", True, "Disabled", "no Ingress requested"))
    else:
        ing = observed.get(("networking.k8s.io/v1", "Ingress", svc.name))
        if ing is None:
            out.append(_cond("IngressReady", False, "IngressMissing", "the Ingress does not exist yet"))
        elif _ingress_address(ing):
            out.append(_cond("IngressReady", True, "AddressAssigned", f"address {_ingress_address(ing)}"))
        else:
            out.append(_cond("IngressReady", False, "AwaitingAddress", "the ingress controller has not "
                                                                        "assigned an address yet"))
    if (autoscaling := autoscaling_condition(svc, observed, forbidden)) is not None:
        out.append(autoscaling)
    elif (roles := RA.role_autoscaling_condition(svc, observed, forbidden)) is not None:
        out.append(roles)       # NOTE: disaggregated: spec.autoscaling is off, each role scales itself
    if (pool := inference_pool_condition(svc, observed, forbidden)) is not None:
        out.append(pool)
    if adapters is not None:
        out.append(adapters)
    failing = [c for c in out if c["status"] != "True"]
    if failing:
        first = failing[0]
        reason = "NameConflict" if first["type"] == "ChildrenOwned" else first["type"].replace("Ready", "NotReady")
        out.append(_cond("Ready", False, reason, first["message"]))
    else:
        out.append(_cond("Ready", True, "AllComponentsReady", f"serving {svc.model.served_name}"))
    return out


def stamp(new: list[dict[str, str]], previous: list[dict[str, Any]] | None, now: str) -> list[dict[str, Any]]:
    """Add lastTransitionTime, kept from `previous` while a condition's status does not change."""
    before = {c.get("type"): c for c in previous or []}
    out = []
    for c in new:
        old = before.get(c["type"])
        keep = old is not None and old.get("status") == c["status"] and old.get("lastTransitionTime")
        out.append({**c, "lastTransitionTime": old["lastTransitionTime"] if keep else now})
    return out


def build_status(svc: InferenceService, observed: Observed, want: int, generation: int | None,
                 previous: list[dict[str, Any]] | None, now: str, forbidden: Set[str] = frozenset(),
                 conflicts: Sequence[str] = (), pods: Sequence[dict[str, Any]] = (),
                 adapters: tuple[list[dict[str, Any]], dict[str, str]] | None = None) -> dict[str, Any]:
    """`adapters`: (status.loraAdapters, AdaptersReady) of the last adapter sync; None: LoRA off."""
    conds = stamp(conditions(svc, observed, want, forbidden, conflicts, pods,
                             adapters[1] if adapters is not None else None), previous, now)
    engine = observed.get(("apps/v1", "Deployment", R.engine_name(svc)))
    ready_replicas = _ready(engine)
    if svc.disaggregation is not None:
        counts = D.role_counts(svc, observed)
        want, ready_replicas = sum(c[2] for c in counts), sum(c[3] for c in counts)
    is_ready = conds[-1]["status"] == "True"
    phase = "Ready" if is_ready else ("Progressing" if ready_replicas > 0 else "Pending")
    if conflicts:
        phase = "Failed"  # NOTE: not fixable by waiting: someone must rename or remove an object
    url = R.service_url(svc)
    address = _ingress_address(observed.get(("networking.k8s.io/v1", "Ingress", svc.name)))
    if svc.ingress.enabled and not svc.ingress.host and address:
        url = f"http://{address}"
    out = {"phase": phase, "observedGeneration": generation, "model": svc.model.served_name,
           "replicas": want, "readyReplicas": ready_replicas, "selector": R.selector_string(svc),
           "url": url, "conditions": conds}
    if (storage := MF.storage_status(svc, pods)) is not None:
        out["modelStorage"] = storage
    if adapters is not None:
        out["loraAdapters"] = adapters[0]
    return out


def invalid_status(problems: list[str], generation: int | None, previous: list[dict[str, Any]] | None,
                   now: str) -> dict[str, Any]:
    """An unservable spec: phase Failed, Ready=False/InvalidSpec with every problem in the message."""
    cond = _cond("Ready", False, "InvalidSpec", "; ".join(problems))
    return {"phase": "Failed", "observedGeneration": generation, "conditions": stamp([cond], previous, now)}
