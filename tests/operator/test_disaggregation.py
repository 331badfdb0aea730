"""spec.disaggregation's pure builders and status (issue 26), and the real kopf operator against kmock:
two role Deployments and Services instead of the colocated engines, the router in P/D mode,
DisaggregationReady, and back to a colocated service."""
from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.operator import crd
from kvmesh.operator import disaggregation as D
from kvmesh.operator import resources as R
from kvmesh.operator import status as S

from .conftest import NAMESPACE, StampingEmulator, obj, wait_for
from .test_e2e_kmock import _cond, _cr, _create, _make_ready, _post

OWNER = R.Owner("pd", "uid-1")
SPEC = {"model": {}, "gpu": {"count": 1}, "disaggregation": {
    "prefill": {"replicas": 2, "engineArgs": ["--max-num-batched-tokens", "16384"]},
    "decode": {"gpus": 0, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}}}}


def _svc(spec: dict[str, Any] = SPEC) -> crd.InferenceService:
    return crd.parse("pd", "ns", spec)


def _children(svc: crd.InferenceService) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in R.build_children(svc, OWNER, R.engine_replicas(svc, None))}


def test_the_spec_parses_with_the_schemas_defaults():
    d = _svc().disaggregation
    assert d.protocol == "tcp" and d.device_name is None
    assert d.prefill == crd.RoleSpec("prefill", 2, 1, ("--max-num-batched-tokens", "16384"),
                                     crd.RoleAutoscalingSpec(False, 1, 4, 4, 300))
    # a decode role that sets no target: its running requests, one full batch (maxNumSeqs) per pod
    assert d.decode == crd.RoleSpec("decode", 1, 0, (), crd.RoleAutoscalingSpec(
        True, 2, 6, None, 300, "hpa", target_running_requests=256))
    assert _svc({"model": {}}).disaggregation is None
    # spec.gpu.count 8 with one GPU per role pod: the engines run tensor parallel size 1
    eight = _svc({"model": {}, "gpu": {"count": 8},
                  "disaggregation": {"prefill": {"gpus": 1}, "decode": {"gpus": 1}}})
    assert eight.engine.tensor_parallel_size == 1
    assert "tensor_parallel_size" not in R.engine_config(eight)


def test_two_role_deployments_and_services_replace_the_colocated_engines():
    kids = _children(_svc())
    assert sorted(kids) == [
        ("ConfigMap", "pd-engine-config"), ("Deployment", "pd-decode"), ("Deployment", "pd-prefill"),
        ("Deployment", "pd-redis"), ("Deployment", "pd-router"),
        ("HorizontalPodAutoscaler", "pd-decode"), ("NetworkPolicy", "pd-redis"), ("Service", "pd"),
        ("Service", "pd-decode"), ("Service", "pd-prefill"), ("Service", "pd-redis")]
    prefill, decode = kids[("Deployment", "pd-prefill")], kids[("Deployment", "pd-decode")]
    assert prefill["spec"]["replicas"] == 2 and "replicas" not in decode["spec"]   # the HPA owns it
    sel = {R.OWNER_LABEL: "pd", "app.kubernetes.io/component": "engine", "kvmesh.io/role": "prefill"}
    assert prefill["spec"]["selector"] == {"matchLabels": sel}
    assert prefill["spec"]["template"]["metadata"]["labels"]["kvmesh.io/role"] == "prefill"
    assert prefill["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["labelSelector"] == {
        "matchLabels": sel}
    (c,) = prefill["spec"]["template"]["spec"]["containers"]
    assert c["args"] == [
        "serve", "--config", "/etc/kvmesh/engine.json", "--host", "0.0.0.0", "--port", "8000",
        "--pod-id", "$(POD_NAME)", "--kv-transfer-config",
        '{"engine_id":"$(POD_NAME)","kv_connector":"MooncakeConnector","kv_connector_extra_config":'
        '{"mooncake_protocol":"tcp"},"kv_ip":"$(POD_IP)","kv_port":8998,"kv_role":"kv_producer"}',
        "--max-num-batched-tokens", "16384"]
    assert c["resources"] == {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}
    assert [p["name"] for p in c["ports"]] == ["http", "kv-bootstrap"]
    assert {e["name"] for e in c["env"]} >= {"POD_NAME", "POD_IP"}       # what the args expand
    (d,) = decode["spec"]["template"]["spec"]["containers"]
    assert json.loads(d["args"][d["args"].index("--kv-transfer-config") + 1])["kv_role"] == "kv_consumer"
    assert "resources" not in d            # gpus 0: a CPU pod
    svc = kids[("Service", "pd-decode")]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {**sel, "kvmesh.io/role": "decode"}
    hpa = kids[("HorizontalPodAutoscaler", "pd-decode")]
    assert (hpa["spec"]["scaleTargetRef"]["name"], hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == \
        ("pd-decode", 2, 6)


def test_the_router_runs_in_pd_mode_on_both_roles_services():
    args = _children(_svc())[("Deployment", "pd-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:12] == ["router", "--host", "0.0.0.0", "--port", "8080", "--redis-url",
                         "redis://pd-redis.ns.svc:6379/0", "--discover-prefill-service", "pd-prefill",
                         "--discover-decode-service", "pd-decode", "--strategy"]
    assert "--discover-headless-service" not in args
    # and the router's own parser takes them
    from kvmesh.router import main as router_main
    cfg = router_main.config_from_args(router_main.build_parser().parse_args(args[1:]))
    assert (cfg.prefill_discover, cfg.decode_discover, cfg.disaggregated) == ("pd-prefill", "pd-decode", True)


def test_the_example_parses_and_passes_every_cel_rule():
    from .examples import load_example
    from .test_crd_cel import _cr, failures
    spec = load_example("disaggregated.yaml")["spec"]
    d = crd.parse("smol-pd", "default", spec).disaggregation
    assert (d.prefill.replicas, d.decode.autoscaling.enabled, d.decode.autoscaling.max_replicas) == (1, True, 8)
    assert failures(_cr(spec)) == []


def test_rdma_reaches_the_kv_transfer_config():
    svc = _svc({"model": {}, "disaggregation": {"protocol": "rdma", "deviceName": "mlx5_0,mlx5_1"}})
    assert D.kv_transfer_config(svc, svc.disaggregation.decode)["kv_connector_extra_config"] == {
        "mooncake_protocol": "rdma", "device_name": "mlx5_0,mlx5_1"}


def test_a_colocated_service_is_unchanged_and_every_role_child_can_be_swept():
    plain = _svc({"model": {}})
    kids = _children(plain)
    assert ("Deployment", "pd-engine") in kids and ("Deployment", "pd-prefill") not in kids
    assert "--discover-headless-service" in kids[("Deployment", "pd-router")]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert set(D.possible_role_children(plain)) <= set(R.possible_children(plain))
    assert {(k, n) for _, k, n in D.possible_role_children(plain)} == {
        (k, f"pd-{r}") for r in ("prefill", "decode")
        for k in ("Deployment", "Service", "HorizontalPodAutoscaler", "ScaledObject")}


def _dep(name: str, want: int, ready: int) -> dict[str, Any]:
    return {"metadata": {"name": name, "generation": 1},
            "spec": {"replicas": want},
            "status": {"observedGeneration": 1, "replicas": want, "readyReplicas": ready,
                       "updatedReplicas": want, "availableReplicas": ready}}


@pytest.mark.parametrize(("prefill", "decode", "status", "reason", "message"), [
    ((2, 2), (3, 3), "True", "BothRolesReady",
     "prefill: 2/2 prefill pods ready; decode: 3/3 decode pods ready"),
    ((2, 1), (3, 3), "False", "PartiallyReady",
     "prefill: 1/2 prefill pods ready; decode: 3/3 decode pods ready"),
    ((2, 2), (3, 0), "False", "AwaitingPods",
     "prefill: 2/2 prefill pods ready; decode: 0/3 decode pods ready (loading the model?)"),
    ((2, 2), None, "False", "DeploymentMissing",
     "prefill: 2/2 prefill pods ready; decode: the decode Deployment does not exist yet"),
])
def test_disaggregation_ready_names_both_roles(prefill, decode, status, reason, message):
    svc = _svc(SPEC)     # decode under its HPA: wanted = the Deployment's replicas
    observed = {("apps/v1", "Deployment", "pd-prefill"): _dep("pd-prefill", *prefill)}
    if decode is not None:
        observed[("apps/v1", "Deployment", "pd-decode")] = _dep("pd-decode", *decode)
    conds = S.conditions(svc, observed, 0)
    assert _by_type(conds, "DisaggregationReady") == {
        "type": "DisaggregationReady", "status": status, "reason": reason, "message": message}
    assert "EnginesReady" not in {c["type"] for c in conds}
    out = S.build_status(svc, observed, 0, 1, [], "2026-11-25T00:00:00Z")
    assert (out["replicas"], out["readyReplicas"]) == (
        prefill[0] + (decode or (0, 0))[0], prefill[1] + (decode or (0, 0))[1])


def _by_type(conds: list[dict[str, Any]], type_: str) -> dict[str, Any]:
    return next(c for c in conds if c["type"] == type_)


# ---- the real operator against kmock ---------------------------------------------------------------
@pytest.mark.kmock(cls=StampingEmulator)
@pytest.mark.timeout(60)
async def test_the_operator_builds_both_roles_reports_them_and_goes_back_to_colocated(cluster: Any) -> None:
    server = cluster
    await _create(server, "pd", {"model": {}, "gpu": {"count": 0},
                                 "disaggregation": {"prefill": {"replicas": 2}, "decode": {"replicas": 1}}})
    prefill = await wait_for(lambda: obj(server, "apps/v1/deployments", "pd-prefill"), what="prefill engines")
    decode = await wait_for(lambda: obj(server, "apps/v1/deployments", "pd-decode"), what="decode engines")
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (2, 1)
    for dep, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert json.loads(args[args.index("--kv-transfer-config") + 1])["kv_role"] == role
    assert obj(server, "v1/services", "pd-prefill")["spec"]["selector"]["kvmesh.io/role"] == "prefill"
    assert obj(server, "apps/v1/deployments", "pd-engine") is None
    router = await wait_for(lambda: obj(server, "apps/v1/deployments", "pd-router"), what="router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--discover-prefill-service"):][:4] == [
        "--discover-prefill-service", "pd-prefill", "--discover-decode-service", "pd-decode"]

    await wait_for(lambda: _cond(_cr(server, "pd"), "DisaggregationReady").get("reason") == "AwaitingPods",
                   what="DisaggregationReady False")
    for name, n in (("pd-prefill", 2), ("pd-decode", 1), ("pd-router", 1), ("pd-redis", 1)):
        _make_ready(server, name, n)
    cr = await wait_for(lambda: (c := _cr(server, "pd"))["status"]["phase"] == "Ready" and c, what="Ready")
    assert _cond(cr, "DisaggregationReady")["message"] == (
        "prefill: 2/2 prefill pods ready; decode: 1/1 decode pods ready")
    assert (cr["status"]["replicas"], cr["status"]["readyReplicas"]) == (3, 3)

    # colocated again: the role children go, the engine Deployment and the plain router return
    await _post(server, f"/apis/kvmesh.io/v1alpha1/namespaces/{NAMESPACE}/inferenceservices/pd",
                {"spec": {"disaggregation": None}}, method="patch",
                content_type="application/merge-patch+json")
    await wait_for(lambda: obj(server, "apps/v1/deployments", "pd-engine"), what="colocated engines")
    await wait_for(lambda: obj(server, "apps/v1/deployments", "pd-prefill") is None
                   and obj(server, "v1/services", "pd-decode") is None, what="role children deleted")
    await wait_for(lambda: "--discover-headless-service" in obj(server, "apps/v1/deployments", "pd-router")[
        "spec"]["template"]["spec"]["containers"][0]["args"], what="plain router")
