"""PURE builders of spec.disaggregation's children: one engine Deployment, headless Service and
(optionally) autoscaler per role (an HPA or a ScaledObject: role_autoscaling.py), in place of the
colocated engines.

    <name>-prefill  Deployment + headless Service   kvmesh serve --kv-transfer-config kv_producer
    <name>-decode   Deployment + headless Service   kvmesh serve --kv-transfer-config kv_consumer
    <name>-router   kvmesh router --discover-prefill-service <name>-prefill
                                  --discover-decode-service <name>-decode

Both roles share the engine ConfigMap (the same model, block size and cache settings: a decode
engine reads the prefill engine's blocks as they are); what differs is on the command line. Role
pods keep the engine component label (the service's selector, the scale subresource's, the LoRA
sync's and the model fetch status' pod lists span both roles) and add `kvmesh.io/role`.
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from . import resources as R
from .crd import InferenceService, RoleSpec

ROLE_LABEL = "kvmesh.io/role"
# NOTE: vLLM's Mooncake bootstrap port: where a decode engine asks a prefill engine for a transfer
KV_BOOTSTRAP_PORT = 8998


def role_name(svc: InferenceService, role: RoleSpec | str) -> str:
    return f"{svc.name}-{role if isinstance(role, str) else role.role}"


def kv_transfer_config(svc: InferenceService, role: RoleSpec) -> dict[str, Any]:
    """The role's --kv-transfer-config (vLLM's keys). NOTE: $(POD_NAME) / $(POD_IP) are expanded by
    the kubelet: each pod is its own engine id, reachable at its own address."""
    d = svc.disaggregation
    extra: dict[str, Any] = {"mooncake_protocol": d.protocol}
    if d.device_name is not None:
        extra["device_name"] = d.device_name
    return {"kv_connector": "MooncakeConnector", "kv_role": role.kv_role, "engine_id": "$(POD_NAME)",
            "kv_ip": "$(POD_IP)", "kv_port": KV_BOOTSTRAP_PORT, "kv_connector_extra_config": extra}


def role_args(svc: InferenceService, role: RoleSpec) -> list[str]:
    """What a role's engine adds to `kvmesh serve`'s arguments."""
    return ["--kv-transfer-config", json.dumps(kv_transfer_config(svc, role), sort_keys=True,
                                               separators=(",", ":")), *role.engine_args]


def role_selector(svc: InferenceService, role: RoleSpec) -> dict[str, str]:
    return {**R.selector(svc, "engine"), ROLE_LABEL: role.role}


def build_role_deployment(svc: InferenceService, owner: R.Owner, role: RoleSpec,
                          redis_auth: str | None = None) -> dict[str, Any]:
    """The colocated engine Deployment, made this role's: its name, role label, GPUs, replicas
    (None under the role's HPA) and command line."""
    replicas = None if role.autoscaling.enabled else role.replicas
    one = replace(svc, gpu=replace(svc.gpu, count=role.gpus))
    dep = R.build_engine_deployment(one, owner, replicas, redis_auth)
    name, sel = role_name(svc, role), role_selector(svc, role)
    dep["metadata"]["name"] = name
    dep["metadata"]["labels"][ROLE_LABEL] = role.role
    spec = dep["spec"]
    spec["selector"] = {"matchLabels": sel}
    template = spec["template"]
    template["metadata"]["labels"][ROLE_LABEL] = role.role
    pod = template["spec"]
    for constraint in pod.get("topologySpreadConstraints", []):
        constraint["labelSelector"] = {"matchLabels": sel}
    container = pod["containers"][0]
    container["args"] = container["args"] + role_args(svc, role)
    container["ports"] = container["ports"] + [
        {"name": "kv-bootstrap", "containerPort": KV_BOOTSTRAP_PORT, "protocol": "TCP"}]
    return dep


def build_role_service(svc: InferenceService, owner: R.Owner, role: RoleSpec) -> dict[str, Any]:
    """Headless: the P/D router discovers this role's ready pods from its DNS records."""
    meta = R.object_meta(svc, owner, role_name(svc, role), "engine")
    meta["labels"][ROLE_LABEL] = role.role
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"clusterIP": "None", "selector": role_selector(svc, role),
                     "publishNotReadyAddresses": False,
                     "ports": [{"name": "http", "port": R.ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                               {"name": "kv-bootstrap", "port": KV_BOOTSTRAP_PORT, "targetPort": "kv-bootstrap",
                                "protocol": "TCP"}]}}


def build_role_children(svc: InferenceService, owner: R.Owner, redis_auth: str | None = None
                        ) -> list[dict[str, Any]]:
    # NOTE: imported late: role_autoscaling builds on this module's names and labels
    from .role_autoscaling import build_role_autoscaler

    out: list[dict[str, Any]] = []
    for role in svc.disaggregation.roles:
        out += [build_role_service(svc, owner, role), build_role_deployment(svc, owner, role, redis_auth)]
        if role.autoscaling.enabled:
            out.append(build_role_autoscaler(svc, owner, role))
    return out


def possible_role_children(svc: InferenceService) -> list[tuple[str, str, str]]:
    """Every child any disaggregation spec could have (to delete them when it goes)."""
    out = []
    for role in ("prefill", "decode"):
        name = role_name(svc, role)
        out += [("apps/v1", "Deployment", name), ("v1", "Service", name),
                ("autoscaling/v2", "HorizontalPodAutoscaler", name), ("keda.sh/v1alpha1", "ScaledObject", name)]
    return out


def router_discovery_args(svc: InferenceService) -> list[str]:
    """The P/D router's engines: each role's headless Service."""
    return ["--discover-prefill-service", role_name(svc, "prefill"),
            "--discover-decode-service", role_name(svc, "decode")]


# ---- status ------------------------------------------------------------------------------------------
def role_counts(svc: InferenceService, observed: dict) -> list[tuple[RoleSpec, dict[str, Any] | None, int, int]]:
    """(role, its Deployment as observed, pods wanted, pods ready) per role. Wanted: the spec's
    replicas, or under the role's HPA the Deployment's own count."""
    out = []
    for role in svc.disaggregation.roles:
        dep = observed.get(("apps/v1", "Deployment", role_name(svc, role)))
        want = (int(((dep or {}).get("spec") or {}).get("replicas") or 0) if role.autoscaling.enabled
                else role.replicas)
        ready = int(((dep or {}).get("status") or {}).get("readyReplicas") or 0)
        out.append((role, dep, want, ready))
    return out


def disaggregation_condition(svc: InferenceService, observed: dict) -> dict[str, str]:
    """DisaggregationReady: both roles' engines ready (each judged as EnginesReady judges the
    colocated engines); the message names each role."""
    from .status import engines_condition  # NOTE: status imports this module's condition at call time

    parts, failing = [], None
    for role, dep, want, _ in role_counts(svc, observed):
        c = engines_condition(dep, want)
        message = c["message"].replace("engine Deployment", f"{role.role} Deployment").replace(
            "engine pods", f"{role.role} pods")
        parts.append(f"{role.role}: {message}")
        if c["status"] != "True" and failing is None:
            failing = c["reason"]
    ok = failing is None
    return {"type": "DisaggregationReady", "status": "True" if ok else "False",
            "reason": "BothRolesReady" if ok else failing, "message": "; ".join(parts)}
