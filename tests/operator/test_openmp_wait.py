"""spec.engine.openmpWaitPolicy (kvmesh.operator.openmp_wait): the engine pods' OMP_WAIT_POLICY."""
from __future__ import annotations

from typing import Any

import pytest

from kvmesh.operator import crd
from kvmesh.operator import resources as R
from kvmesh.operator.openmp_wait import _quantity, dedicated_cpus


def _engine_env(spec: dict[str, Any]) -> dict[str, Any]:
    svc = crd.parse("smol", "ns", {"model": {}, **spec})
    dep = R.build_engine_deployment(svc, R.Owner("uid-1", "smol"), 1)
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e.get("value") for e in env}


def _guaranteed(cpu: Any, memory: str = "8Gi", **over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"gpu": {"count": 0},
                            "resources": {"requests": {"cpu": cpu, "memory": memory},
                                          "limits": {"cpu": cpu, "memory": memory}}}
    spec.update(over)
    return spec


@pytest.mark.parametrize("cpu", ["4", 4, "4000m"])
def test_auto_spins_a_while_on_a_cpu_engine_with_exclusive_whole_cpus(cpu):
    env = _engine_env(_guaranteed(cpu))
    assert env["GOMP_SPINCOUNT"] == "20000000" and "OMP_WAIT_POLICY" not in env   # ~200 ms, then sleep


@pytest.mark.parametrize("spec", [
    _guaranteed("1500m"),                                               # not whole CPUs
    _guaranteed("4", resources={"requests": {"cpu": "2", "memory": "8Gi"},
                                "limits": {"cpu": "4", "memory": "8Gi"}}),   # burstable CPU
    _guaranteed("4", resources={"requests": {"cpu": "4", "memory": "4Gi"},
                                "limits": {"cpu": "4", "memory": "8Gi"}}),   # burstable memory
    _guaranteed("4", resources={"requests": {"cpu": "4"}, "limits": {"cpu": "4"}}),  # no memory limit
    {"gpu": {"count": 0}},                                              # no resources at all
    {"gpu": {"count": 1}, "resources": {"requests": {"cpu": "4", "memory": "8Gi"},
                                        "limits": {"cpu": "4", "memory": "8Gi"}}},  # a GPU engine
])
def test_auto_keeps_the_passive_default_where_the_cores_may_be_shared(spec):
    env = _engine_env(spec)
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env


def test_active_and_passive_are_set_whatever_the_resources():
    assert _engine_env({"gpu": {"count": 0}, "engine": {"openmpWaitPolicy": "active"}})["OMP_WAIT_POLICY"] == "ACTIVE"
    env = _engine_env(_guaranteed("4", engine={"openmpWaitPolicy": "passive"}))
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env


def test_the_engine_takes_the_bounded_spin_as_a_request_to_spin():
    """kvmesh serve releases its event loop's OpenMP team when the environment asks for spinning
    (kvmesh.common.openmp): the operator's bounded spin must count as asking."""
    from kvmesh.common.openmp import spin_requested
    assert spin_requested(_engine_env(_guaranteed("4")))


def test_an_unknown_policy_is_a_named_problem():
    with pytest.raises(crd.SpecError, match="openmpWaitPolicy"):
        crd.parse("smol", "ns", {"model": {}, "engine": {"openmpWaitPolicy": "spin"}})


def test_quantities():
    assert [_quantity(v) for v in ("2", 2, "2000m", "1.5", " 3 ")] == [2, 2, 2, 1.5, 3]
    assert [_quantity(v) for v in (None, True, "two", "")] == [None, None, None, None]
    svc = crd.parse("smol", "ns", {"model": {"source": "uri", "uri": "/models/smol"},
                                   **_guaranteed("2"), "engine": {"runtime": "vllm", "blockSize": 32},
                                   "image": "vllm/vllm-openai:v0.32.0"})
    assert not dedicated_cpus(svc)                                      # vLLM runs its own OpenMP
