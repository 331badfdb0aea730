"""Scale to zero, the pure parts: the autoscaler's decision with an Activity, the metric parsers,
the spec (both validators), the router's flags and the KEDA ScaledObject."""
from __future__ import annotations

import pytest

from kvmesh.operator import autoscale, crd
from kvmesh.operator import resources as R
from kvmesh.operator.autoscale import Activity, Decision

from .test_crd_cel import _cr, failures
from .test_resources import OWNER

SPEC0 = crd.AutoscalingSpec(enabled=True, mode="operator", min_replicas=0, max_replicas=4,
                            target_waiting_requests=4, cooldown_seconds=60, prometheus_address=None,
                            scale_to_zero_after_seconds=120, hold_timeout_seconds=300)


def _act(pending: float = 0, running: float = 0, idle: float = 0) -> Activity:
    return Activity(pending=pending, running=running, idle_seconds=idle)


def test_from_zero_a_held_request_wakes_one_engine_despite_the_cooldown() -> None:
    assert autoscale.decide(SPEC0, 0, [], 5.0, _act(pending=3)) == Decision(
        1, True, "3 request(s) held by the router: 0 → 1")
    assert autoscale.decide(SPEC0, 0, [], None, _act()) == Decision(0, False, "scaled to zero: no request held")
    assert autoscale.decide(SPEC0, 0, [1.0], None, _act(running=2)) == Decision(
        1, True, "3 request(s) running or waiting: 0 → 1")


def test_to_zero_only_after_the_idle_period_with_nothing_running_waiting_or_held() -> None:
    assert autoscale.decide(SPEC0, 1, [0.0], 500.0, _act(idle=119)) == Decision(
        1, False, "0 waiting over 1 pod(s): steady")
    assert autoscale.decide(SPEC0, 1, [0.0], 500.0, _act(idle=120)) == Decision(
        0, True, "no request for 120s (scaleToZeroAfterSeconds 120): 1 → 0")
    assert autoscale.decide(SPEC0, 3, [0.0, 0.0, 0.0], 500.0, _act(idle=600)) == Decision(
        0, True, "no request for 600s (scaleToZeroAfterSeconds 120): 3 → 0")
    # a request running, waiting or held keeps one engine (the handler also restarts the idle clock)
    for waiting, activity in (([0.0], _act(running=2, idle=600)), ([1.0], _act(idle=600)),
                              ([0.0], _act(pending=1, idle=600))):
        assert autoscale.decide(SPEC0, 1, waiting, 500.0, activity).replicas == 1


def test_with_min_zero_the_usual_rule_keeps_a_floor_of_one_and_counts_held_requests() -> None:
    assert autoscale.decide(SPEC0, 2, [0.0, 0.0], 100.0, _act(running=1)) == Decision(
        1, True, "0 waiting over 2 pod(s), target 4/pod: 2 → 1")
    assert autoscale.decide(SPEC0, 1, [2.0], 100.0, _act(pending=7)) == Decision(
        3, True, "9 waiting over 1 pod(s), target 4/pod: 1 → 3")
    # the woken engine is still starting: hold, do not scale blind
    assert autoscale.decide(SPEC0, 1, [], 1.0, _act(pending=5)) == Decision(1, False, "no engine pod reported metrics")


def test_without_min_zero_the_activity_changes_nothing() -> None:
    spec1 = crd.AutoscalingSpec(True, "operator", 1, 4, 4, 60, None)
    assert autoscale.decide(spec1, 1, [0.0], 100.0, _act(pending=9, idle=10_000)) == Decision(
        1, False, "0 waiting over 1 pod(s): steady")


def test_parsers_read_running_and_held_requests() -> None:
    engine = ('kvmesh:num_requests_running{model_name="m"} 3.0\nvllm:num_requests_running{model_name="m"} 3.0\n'
              'kvmesh:num_requests_waiting{model_name="m"} 1.0\n')
    assert autoscale.parse_running(engine) == 3.0
    assert autoscale.parse_running('vllm:num_requests_running{model_name="m"} 2\n') == 2.0
    router = ('# TYPE kvmesh_router_pending_requests gauge\n'
              'kvmesh_router_pending_requests{model_name="m"} 4.0\n'
              'kvmesh_router_held_requests_total{outcome="sent"} 9.0\n')
    assert autoscale.parse_pending(router) == 4.0
    assert autoscale.parse_pending("") == 0.0


@pytest.mark.parametrize("mode", ["operator", "keda"])
def test_min_replicas_zero_is_accepted_in_operator_and_keda_modes(mode: str) -> None:
    spec = {"model": {}, "autoscaling": {"enabled": True, "mode": mode, "minReplicas": 0,
                                         "prometheusAddress": "http://prom:9090"}}
    a = crd.parse("x", "ns", spec).autoscaling
    assert (a.min_replicas, a.scale_to_zero_after_seconds, a.hold_timeout_seconds) == (0, 300, 300)
    assert failures(_cr(spec)) == []


def test_min_replicas_zero_without_a_holder_or_with_an_hpa_is_refused_by_both_validators() -> None:
    spec = {"model": {}, "autoscaling": {"enabled": True, "mode": "hpa", "minReplicas": 0}}
    with pytest.raises(crd.SpecError) as err:
        crd.parse("x", "ns", spec)
    assert err.value.problems == ["spec.autoscaling.minReplicas 0 needs mode operator or keda (an HPA does not "
                                  "scale to zero)"]
    assert failures(_cr(spec)) == ["autoscaling.minReplicas 0 needs mode operator or keda (an HPA does not "
                                   "scale to zero)"]
    spec = {"model": {}, "router": {"enabled": False}, "autoscaling": {"enabled": True, "minReplicas": 0}}
    with pytest.raises(crd.SpecError) as err:
        crd.parse("x", "ns", spec)
    assert err.value.problems == ["spec.autoscaling.minReplicas 0 needs kvmesh's router (spec.router.enabled, mode "
                                  "builtin): it holds the requests that wake the engines"]
    assert failures(_cr(spec)) == ["autoscaling.minReplicas 0 needs kvmesh's router (router.enabled, mode builtin): "
                                   "it holds the requests that wake the engines"]
    with pytest.raises(crd.SpecError, match="scaleToZeroAfterSeconds"):
        crd.parse("x", "ns", {"model": {}, "autoscaling": {"scaleToZeroAfterSeconds": 0}})


def test_the_router_holds_requests_only_when_the_engines_may_be_at_zero() -> None:
    zero = crd.parse("smol", "team-a", {"model": {}, "autoscaling": {
        "enabled": True, "minReplicas": 0, "holdTimeoutSeconds": 90}})
    args = R.router_args(zero)
    assert args[args.index("--hold-timeout"):args.index("--hold-timeout") + 2] == ["--hold-timeout", "90"]
    assert "--hold-timeout" not in R.router_args(crd.parse("smol", "team-a", {"model": {}}))
    # minReplicas 0 with autoscaling off: spec.replicas rules, nothing scales to zero
    assert "--hold-timeout" not in R.router_args(crd.parse("smol", "team-a", {"model": {}, "autoscaling": {
        "minReplicas": 0}}))
    assert R.engine_replicas(zero, 0) == 0


def test_keda_scaled_object_for_scale_to_zero() -> None:
    svc = crd.parse("smol", "team-a", {"model": {"servedModelName": "m"}, "engine": {"maxNumSeqs": 64},
                                       "autoscaling": {"enabled": True, "mode": "keda", "minReplicas": 0,
                                                       "maxReplicas": 3, "targetWaitingRequests": 2,
                                                       "cooldownSeconds": 30, "scaleToZeroAfterSeconds": 600,
                                                       "prometheusAddress": "http://prom:9090"}})
    spec = R.build_scaled_object(svc, OWNER)["spec"]
    where = '{namespace="team-a",model_name="m"}'
    assert spec == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "smol-engine"},
        "minReplicaCount": 0, "maxReplicaCount": 3, "cooldownPeriod": 600,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
            "scaleDown": {"stabilizationWindowSeconds": 30}, "scaleUp": {"stabilizationWindowSeconds": 0}}}},
        "pollingInterval": 15,
        "triggers": [
            {"type": "prometheus", "metadata": {"serverAddress": "http://prom:9090", "threshold": "2",
                                                "query": f"sum(vllm:num_requests_waiting{where})",
                                                "activationThreshold": "0"}},
            {"type": "prometheus", "name": "router-held-requests", "metadata": {
                "serverAddress": "http://prom:9090", "threshold": "2",
                "query": f"sum(kvmesh_router_pending_requests{where})", "activationThreshold": "0"}},
            {"type": "prometheus", "name": "running-requests", "metadata": {
                "serverAddress": "http://prom:9090", "threshold": "64",
                "query": f"sum(vllm:num_requests_running{where})", "activationThreshold": "0"}}]}


async def test_an_unreachable_router_or_engine_counts_as_nothing_held_or_running() -> None:
    from processes import free_port
    closed = free_port()                # nothing listens there
    assert await autoscale.scrape_pending(["127.0.0.1"], closed, timeout_s=1.0) == 0.0
    assert await autoscale.scrape_running(["127.0.0.1"], closed, timeout_s=1.0) == 0.0


def test_the_scale_to_zero_example_is_valid_and_holds_requests() -> None:
    from .examples import load_example
    from .test_crd import _schema_errors
    cr = load_example("scale-to-zero.yaml")
    assert _schema_errors(cr) == [] and failures(cr) == []
    svc = crd.parse(cr["metadata"]["name"], cr["metadata"]["namespace"], cr["spec"])
    assert (svc.autoscaling.min_replicas, svc.autoscaling.scale_to_zero_after_seconds) == (0, 600)
    assert R.router_args(svc)[-2:] == ["--hold-timeout", "300"]
