"""PURE builders of each spec.disaggregation role's autoscaler: an HPA (mode hpa) or a KEDA
ScaledObject (mode keda) on the role's Deployment, one metric per target the role sets.

    target                       metric (the colocated autoscaler's names)      typical role
    targetWaitingRequests        kvmesh:num_requests_waiting   per pod            prefill: its queue
    targetRunningRequests        kvmesh:num_requests_running   per pod            decode: its batch
    targetKVCacheUsagePercent    kvmesh:kv_cache_usage_perc    per pod (0..1)     decode: its memory

The HPA reads Pods metrics from a Prometheus adapter (which renames ':' to '_'), as spec.autoscaling
mode hpa does; a Pods metric is averaged over the scale target's own pods, so it is the role's.
KEDA queries Prometheus with the vllm:* names, as spec.autoscaling mode keda does, narrowed to the
role's pods by their names (`pod`, the label Prometheus' Kubernetes discovery and kube-prometheus'
monitors add). With several targets the HPA runs the most pods any of them asks for.
"""
from __future__ import annotations

from collections.abc import Set
from typing import Any

from . import resources as R
from .crd import InferenceService, RoleSpec
from .disaggregation import ROLE_LABEL, role_name

WAITING = "num_requests_waiting"
RUNNING = "num_requests_running"
KV_USAGE = "kv_cache_usage_perc"


def role_targets(svc: InferenceService, role: RoleSpec) -> list[tuple[str, float]]:
    """(metric without prefix, per-pod target) for every target the role sets, in a fixed order."""
    a = role.autoscaling
    out: list[tuple[str, float]] = []
    if a.target_waiting_requests is not None:
        out.append((WAITING, a.target_waiting_requests))
    if a.target_running_requests is not None:
        out.append((RUNNING, a.target_running_requests))
    if a.target_kv_cache_usage_percent is not None:
        out.append((KV_USAGE, a.target_kv_cache_usage_percent / 100))
    return out


def _quantity(value: float) -> str:
    """A Kubernetes quantity: whole numbers as they are, fractions in thousandths ("800m")."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def _behavior(role: RoleSpec) -> dict[str, Any]:
    """Scale up at once; scale down only after the load stayed low for cooldownSeconds."""
    return {"scaleDown": {"stabilizationWindowSeconds": role.autoscaling.cooldown_seconds},
            "scaleUp": {"stabilizationWindowSeconds": 0}}


def _meta(svc: InferenceService, owner: R.Owner, role: RoleSpec) -> dict[str, Any]:
    meta = R.object_meta(svc, owner, role_name(svc, role), "engine")
    meta["labels"][ROLE_LABEL] = role.role
    return meta


def _target_ref(svc: InferenceService, role: RoleSpec) -> dict[str, str]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": role_name(svc, role)}


def build_role_hpa(svc: InferenceService, owner: R.Owner, role: RoleSpec) -> dict[str, Any]:
    a = role.autoscaling
    metrics = [{"type": "Pods", "pods": {"metric": {"name": f"kvmesh_{name}"},
                                         "target": {"type": "AverageValue", "averageValue": _quantity(target)}}}
               for name, target in role_targets(svc, role)]
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _meta(svc, owner, role),
            "spec": {"scaleTargetRef": _target_ref(svc, role), "minReplicas": a.min_replicas,
                     "maxReplicas": a.max_replicas, "metrics": metrics, "behavior": _behavior(role)}}


def role_query(svc: InferenceService, role: RoleSpec, metric: str) -> str:
    """The role's total of one metric: its pods are `<name>-<role>-<replica set hash>-<suffix>`."""
    pods = f"{svc.name}-{role.role}-[a-z0-9]+-[a-z0-9]+"
    where = f'{{namespace="{svc.namespace}",model_name="{svc.model.served_name}",pod=~"{pods}"}}'
    return f"sum(vllm:{metric}{where})"


def build_role_scaled_object(svc: InferenceService, owner: R.Owner, role: RoleSpec) -> dict[str, Any]:
    a = role.autoscaling
    # NOTE: KEDA's prometheus trigger compares the query's value per pod with `threshold`
    triggers = [{"type": "prometheus", "name": name.replace("_", "-"),
                 "metadata": {"serverAddress": a.prometheus_address or "", "query": role_query(svc, role, name),
                              "threshold": f"{target:g}"}}
                for name, target in role_targets(svc, role)]
    spec = {"scaleTargetRef": _target_ref(svc, role), "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            # NOTE: the HPA KEDA manages gets the cooldown as its scale-down window
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(role)}},
            "pollingInterval": 15, "triggers": triggers}
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": _meta(svc, owner, role),
            "spec": spec}


def build_role_autoscaler(svc: InferenceService, owner: R.Owner, role: RoleSpec) -> dict[str, Any]:
    """The role's HPA or ScaledObject (its autoscaling must be enabled)."""
    if role.autoscaling.mode == "keda":
        return build_role_scaled_object(svc, owner, role)
    return build_role_hpa(svc, owner, role)


# ---- status ------------------------------------------------------------------------------------------
def role_autoscaling_condition(svc: InferenceService, observed: dict, forbidden: Set[str]) -> dict[str, str] | None:
    """AutoscalingReady for a disaggregated service: is each autoscaled role's HPA or ScaledObject
    there? None when no role autoscales. The message names each role; the first failing one gives
    the reason (Forbidden: the chart does not let the operator manage that kind)."""
    if svc.disaggregation is None:
        return None
    parts, failing = [], None
    for role in svc.disaggregation.roles:
        a = role.autoscaling
        if not a.enabled:
            continue
        api_version, kind = (("keda.sh/v1alpha1", "ScaledObject") if a.mode == "keda"
                             else ("autoscaling/v2", "HorizontalPodAutoscaler"))
        name = role_name(svc, role)
        if kind in forbidden:
            reason, text = "Forbidden", (f"the operator may not manage {kind} objects: install the chart with "
                                         f"{R.OPTIONAL_KINDS[kind]}=true; the {role.role} pods run unscaled")
        elif observed.get((api_version, kind, name)) is None:
            reason, text = f"{kind}Missing", f"the {kind} does not exist yet"
        else:
            reason, text = None, f"{kind} {name} scales the {role.role} pods within {a.min_replicas}-{a.max_replicas}"
        parts.append(f"{role.role}: {text}")
        failing = failing or reason
    if not parts:
        return None
    return {"type": "AutoscalingReady", "status": "False" if failing else "True",
            "reason": failing or "Managed", "message": "; ".join(parts)}
