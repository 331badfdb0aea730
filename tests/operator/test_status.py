"""Status derivation from the children's real state (pure)."""
from __future__ import annotations

from typing import Any

from kvmesh.operator import crd
from kvmesh.operator import status as S

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def _dep(ready: int, replicas: int | None = None, updated: int | None = None, **extra: Any) -> dict[str, Any]:
    """A Deployment's status as its controller writes it (every ready pod available)."""
    replicas = ready if replicas is None else replicas
    return {"status": {"replicas": replicas, "readyReplicas": ready, "availableReplicas": ready,
                       "updatedReplicas": replicas if updated is None else updated, **extra}}


def _observed(engine: Any, router: Any = None, redis: Any = None, ingress: Any = None) -> S.Observed:
    return {("apps/v1", "Deployment", "smol-engine"): engine, ("apps/v1", "Deployment", "smol-router"): router,
            ("apps/v1", "Deployment", "smol-redis"): redis, ("networking.k8s.io/v1", "Ingress", "smol"): ingress}


SVC = crd.parse("smol", "team-a", {"model": {}, "ingress": {"enabled": True, "host": "smol.example.com"}})


def test_all_ready() -> None:
    lb = {"status": {"loadBalancer": {"ingress": [{"hostname": "lb.example.net"}]}}}
    st = S.build_status(SVC, _observed(_dep(2), _dep(1), _dep(1), lb), 2, 4, None, NOW)
    assert st == {"phase": "Ready", "observedGeneration": 4, "model": "smol", "replicas": 2, "readyReplicas": 2,
                  "selector": "app.kubernetes.io/component=engine,kvmesh.io/inference-service=smol",
                  "url": "http://smol.example.com", "conditions": [
                      {"type": "EnginesReady", "status": "True", "reason": "MinimumReplicasAvailable",
                       "message": "2/2 engine pods ready", "lastTransitionTime": NOW},
                      {"type": "RouterReady", "status": "True", "reason": "MinimumReplicasAvailable",
                       "message": "1 router pod(s) ready", "lastTransitionTime": NOW},
                      {"type": "RedisReady", "status": "True", "reason": "MinimumReplicasAvailable",
                       "message": "1 redis pod(s) ready", "lastTransitionTime": NOW},
                      {"type": "IngressReady", "status": "True", "reason": "AddressAssigned",
                       "message": "address lb.example.net", "lastTransitionTime": NOW},
                      {"type": "Ready", "status": "True", "reason": "AllComponentsReady",
                       "message": "serving smol", "lastTransitionTime": NOW}]}


def test_missing_children_and_awaiting_address() -> None:
    conds = S.conditions(SVC, _observed(None, None, _dep(0), {"status": {}}), 1)
    assert [(c["type"], c["status"], c["reason"]) for c in conds] == [
        ("EnginesReady", "False", "DeploymentMissing"), ("RouterReady", "False", "DeploymentMissing"),
        ("RedisReady", "False", "AwaitingPods"), ("IngressReady", "False", "AwaitingAddress"),
        ("Ready", "False", "EnginesNotReady")]


def test_engine_states() -> None:
    assert S.engines_condition(_dep(1, replicas=3, updated=1), 3)["reason"] == "RollingUpdate"
    assert S.engines_condition(_dep(1, replicas=1), 3) == {
        "type": "EnginesReady", "status": "False", "reason": "PartiallyReady", "message": "1/3 engine pods ready"}
    assert S.engines_condition(_dep(0), 0)["reason"] == "ScaledToZero"
    stuck = _dep(0, replicas=1, conditions=[{"type": "Progressing", "status": "False",
                                             "reason": "ProgressDeadlineExceeded", "message": "timed out"}])
    assert S.engines_condition(stuck, 1) == {"type": "EnginesReady", "status": "False",
                                             "reason": "ProgressDeadlineExceeded", "message": "timed out"}


def _generation(dep: dict[str, Any], generation: int, observed: int | None) -> dict[str, Any]:
    status = dict(dep["status"])
    if observed is not None:
        status["observedGeneration"] = observed
    return {"metadata": {"generation": generation}, "status": status}


def test_engines_ready_honours_observed_generation() -> None:
    # the operator just patched the template (generation 3): the old pods' counts say nothing yet
    stale = _generation(_dep(2), 3, 2)
    assert S.engines_condition(stale, 2) == {
        "type": "EnginesReady", "status": "False", "reason": "RollingUpdate",
        "message": "the Deployment controller has not observed generation 3 yet (at 2)"}
    assert S.engines_condition(_generation(_dep(2), 1, None), 2)["reason"] == "RollingUpdate"
    # a new Deployment the controller has not seen: nothing ready, nothing claimed
    assert S.engines_condition({"metadata": {"generation": 1}}, 1)["reason"] == "AwaitingPods"
    # observed, but no pod of the new template yet: the old ones still serve
    observed = _generation(_dep(2, replicas=3, updated=1), 3, 3)
    assert S.engines_condition(observed, 2) == {
        "type": "EnginesReady", "status": "False", "reason": "RollingUpdate",
        "message": "1/2 engine pods updated, 2 ready"}
    # every pod updated and ready but not yet available (minReadySeconds)
    unavailable = _generation(_dep(2, availableReplicas=1), 3, 3)
    assert S.engines_condition(unavailable, 2) == {
        "type": "EnginesReady", "status": "False", "reason": "PartiallyReady",
        "message": "1/2 engine pods available (2 ready, not yet for minReadySeconds)"}
    # fewer updated pods than wanted, even with no old ones left, is a rollout too
    assert S.engines_condition(_generation(_dep(2, updated=1), 3, 3), 2)["status"] == "False"
    assert S.engines_condition(_generation(_dep(2), 3, 3), 2)["status"] == "True"
    # the router and the managed Redis follow the same rule
    conds = {c["type"]: c for c in S.conditions(SVC, _observed(_generation(_dep(1), 1, 1),
                                                               _generation(_dep(1), 2, 1), _dep(1)), 1)}
    assert (conds["RouterReady"]["status"], conds["RouterReady"]["reason"]) == ("False", "RollingUpdate")
    assert conds["RedisReady"]["status"] == "True"


def test_disabled_and_external_components_count_as_ready() -> None:
    svc = crd.parse("smol", "team-a", {"model": {}, "router": {"enabled": False},
                                       "redis": {"url": "redis://r:6379/0"}})
    conds = {c["type"]: c["reason"] for c in S.conditions(svc, _observed(_dep(1)), 1)}
    assert conds == {"EnginesReady": "MinimumReplicasAvailable", "RouterReady": "Disabled", "RedisReady": "External",
                     "IngressReady": "Disabled", "Ready": "AllComponentsReady"}


def test_transition_time_moves_only_on_flips() -> None:
    first = S.stamp([{"type": "Ready", "status": "False", "reason": "A", "message": ""}], None, NOW)
    same = S.stamp([{"type": "Ready", "status": "False", "reason": "B", "message": ""}], first, LATER)
    flipped = S.stamp([{"type": "Ready", "status": "True", "reason": "C", "message": ""}], same, LATER)
    assert [c["lastTransitionTime"] for c in first + same + flipped] == [NOW, NOW, LATER]


def test_invalid_status() -> None:
    assert S.invalid_status(["a", "b"], 3, None, NOW) == {
        "phase": "Failed", "observedGeneration": 3, "conditions": [
            {"type": "Ready", "status": "False", "reason": "InvalidSpec", "message": "a; b",
             "lastTransitionTime": NOW}]}


def test_ingress_without_host_uses_the_address() -> None:
    svc = crd.parse("smol", "team-a", {"model": {}, "ingress": {"enabled": True}})
    lb = {"status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}]}}}
    assert S.build_status(svc, _observed(_dep(1), _dep(1), _dep(1), lb), 1, 1, None, NOW)["url"] == "http://203.0.113.9"


KEDA = crd.parse("smol", "team-a", {"model": {}, "autoscaling": {
    "enabled": True, "mode": "keda", "minReplicas": 2, "maxReplicas": 6, "prometheusAddress": "http://prom:9090"}})


def test_autoscaling_forbidden_by_rbac_is_a_condition() -> None:
    st = S.build_status(KEDA, _observed(_dep(1), _dep(1), _dep(1)), 1, 2, None, NOW, frozenset({"ScaledObject"}))
    assert st["phase"] == "Progressing"
    assert st["conditions"][-2:] == [
        {"type": "AutoscalingReady", "status": "False", "reason": "Forbidden",
         "message": "the operator may not manage ScaledObject objects: install the chart with rbac.keda=true "
                    "(or grant get/create/patch/delete on them); the engines run unscaled",
         "lastTransitionTime": NOW},
        {"type": "Ready", "status": "False", "reason": "AutoscalingNotReady",
         "message": "the operator may not manage ScaledObject objects: install the chart with rbac.keda=true "
                    "(or grant get/create/patch/delete on them); the engines run unscaled",
         "lastTransitionTime": NOW}]


def test_autoscaling_condition_by_mode() -> None:
    observed = {**_observed(_dep(1)), ("keda.sh/v1alpha1", "ScaledObject", "smol-engine"): {"spec": {}}}
    assert S.autoscaling_condition(KEDA, observed, frozenset()) == {
        "type": "AutoscalingReady", "status": "True", "reason": "Managed",
        "message": "ScaledObject smol-engine scales the engines within 2-6"}
    hpa = crd.parse("smol", "team-a", {"model": {}, "autoscaling": {"enabled": True, "mode": "hpa"}})
    assert S.autoscaling_condition(hpa, _observed(_dep(1)), frozenset({"ScaledObject"})) == {
        "type": "AutoscalingReady", "status": "False", "reason": "HorizontalPodAutoscalerMissing",
        "message": "the HorizontalPodAutoscaler does not exist yet"}
    assert S.autoscaling_condition(hpa, _observed(_dep(1)), frozenset({"HorizontalPodAutoscaler"}))["message"] == (
        "the operator may not manage HorizontalPodAutoscaler objects: install the chart with rbac.hpa=true "
        "(or grant get/create/patch/delete on them); the engines run unscaled")
    operator_mode = crd.parse("smol", "team-a", {"model": {}, "autoscaling": {"enabled": True}})
    assert S.autoscaling_condition(operator_mode, {}, frozenset({"ScaledObject"})) is None
    assert S.autoscaling_condition(SVC, {}, frozenset({"ScaledObject"})) is None


def test_a_name_conflict_fails_the_service_and_says_which_object() -> None:
    st = S.build_status(SVC, _observed(_dep(1), _dep(1), _dep(1)), 1, 2, None, NOW,
                        conflicts=["Service smol-engine exists and is not controlled by this InferenceService"])
    assert st["phase"] == "Failed"
    assert [(c["type"], c["status"], c["reason"]) for c in st["conditions"]][0] == (
        "ChildrenOwned", "False", "NameConflict")
    assert st["conditions"][-1]["reason"] == "NameConflict"
    assert st["conditions"][-1]["message"] == "Service smol-engine exists and is not controlled by this InferenceService"


REMOTE = crd.parse("smol", "team-a", {"model": {"source": "uri", "uri": "s3://models/team/llama"}})
ERROR = ("kvmesh fetch: error: s3://models/team/llama: the store refused the credentials "
         "(SignatureDoesNotMatch): check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")


def _pod(state: dict[str, Any], last: dict[str, Any] | None = None) -> dict[str, Any]:
    """An engine pod whose fetch-model init container is in `state` (as the kubelet reports it)."""
    status = {"name": "fetch-model", "state": state, **({"lastState": last} if last else {})}
    return {"status": {"initContainerStatuses": [status]}}


def _model(pods: list[dict[str, Any]]) -> dict[str, str]:
    return S.conditions(REMOTE, _observed(_dep(0, 1)), 1, pods=pods)[0]


def test_model_ready_follows_the_fetch_model_init_containers() -> None:
    failed = {"terminated": {"exitCode": 2, "reason": "Error",
                             "message": "INFO kvmesh.startup: fetching model (s3://models/team/llama) ...\n" + ERROR}}
    assert _model([]) == {"type": "ModelReady", "status": "False", "reason": "AwaitingPods",
                          "message": "no engine pod has started fetching s3://models/team/llama yet"}
    assert _model([_pod({"waiting": {"reason": "PodInitializing"}}), _pod({"running": {}})]) == {
        "type": "ModelReady", "status": "False", "reason": "Fetching",
        "message": "fetching s3://models/team/llama (1 engine pod(s))"}
    assert _model([_pod(failed)]) == {"type": "ModelReady", "status": "False", "reason": "FetchFailed",
                                      "message": ERROR}
    # restarted after a failure: the kubelet keeps the failure in lastState
    assert _model([_pod({"waiting": {"reason": "CrashLoopBackOff"}}, failed)])["message"] == ERROR
    assert _model([_pod({"running": {}}, failed)])["reason"] == "Fetching"
    assert _model([_pod({"terminated": {"exitCode": 137, "reason": "OOMKilled"}})])["message"] == (
        "the fetch-model container exited with code 137 (OOMKilled)")
    assert _model([_pod(failed), _pod({"terminated": {"exitCode": 0}})]) == {
        "type": "ModelReady", "status": "True", "reason": "Fetched",
        "message": "s3://models/team/llama fetched by 1/2 engine pod(s)"}


def test_a_failed_fetch_is_why_the_service_is_not_ready() -> None:
    failed = _pod({"terminated": {"exitCode": 2, "reason": "Error", "message": ERROR}})
    st = S.build_status(REMOTE, _observed(_dep(0, 1), _dep(1), _dep(1)), 1, 1, None, NOW, pods=[failed])
    assert st["conditions"][-1] == {"type": "Ready", "status": "False", "reason": "ModelNotReady",
                                    "message": ERROR, "lastTransitionTime": NOW}
    # a model in the image has no ModelReady at all
    assert "ModelReady" not in [c["type"] for c in S.conditions(SVC, _observed(_dep(1)), 1)]


def _done(summary: str | None) -> dict[str, Any]:
    return _pod({"terminated": {"exitCode": 0, "reason": "Completed",
                                **({"message": summary} if summary is not None else {})}})


def _summary(fetched: int, seconds: float, uri: str = "s3://models/team/llama") -> str:
    return (f'{{"uri": "{uri}", "sizeBytes": 5000, "fetchedBytes": {fetched}, '
            f'"fetchSeconds": {seconds}}}')


def test_model_storage_reports_the_download_and_counts_the_node_cache_hits() -> None:
    def storage(pods):
        return S.build_status(REMOTE, _observed(_dep(0, 1)), 1, 1, None, NOW, pods=pods).get("modelStorage")

    # nothing to report: no pod, a running or failed fetch, a success without a summary (an
    # older image), a summary of another URI (the spec changed since), a message that is no summary
    failed = _pod({"terminated": {"exitCode": 2, "reason": "Error", "message": ERROR}})
    assert storage([]) is None
    assert storage([_pod({"running": {}}), failed, _done(None), _done("fetched"),
                    _done(_summary(5000, 3.0, uri="s3://models/team/other"))]) is None
    # two downloads (the slower of equal reads wins), a resumed one that read less, a cache hit
    pods = [_done(_summary(0, 0.2)), _done(_summary(5000, 3.0)), _done(_summary(5000, 4.5)),
            _done(_summary(1200, 9.0)), failed]
    assert storage(pods) == {"uri": "s3://models/team/llama", "sizeBytes": 5000, "fetchedBytes": 5000,
                             "fetchSeconds": 4.5, "cachedPods": 1}
    # every pod found it cached: the model's size, and how long a cache hit took
    assert storage([_done(_summary(0, 0.25))]) == {"uri": "s3://models/team/llama", "sizeBytes": 5000,
                                                   "fetchedBytes": 0, "fetchSeconds": 0.25, "cachedPods": 1}
    # a model in the image: no modelStorage
    assert "modelStorage" not in S.build_status(SVC, _observed(_dep(1)), 1, 1, None, NOW, pods=pods)
