"""How the engine pods' OpenMP workers wait between parallel regions (spec.engine.openmpWaitPolicy).

    openmp_env(svc) -> [{"name": "GOMP_SPINCOUNT" | "OMP_WAIT_POLICY", "value": ...}] or []

`auto` (the default) asks for spinning only where the cores are the engine's own: a CPU engine
(no GPUs, runtime kvmesh) whose CPU and memory requests equal its limits with a whole number of
CPUs, the Guaranteed QoS class that the kubelet's static CPU manager pins to exclusive cores.
There a worker that spins keeps the forward hot between steps; `auto` bounds the spin
(GOMP_SPINCOUNT=BOUNDED_SPIN rounds, about 200 ms, as long as vLLM's Intel OpenMP spins by
default) so that an idle engine sleeps instead of holding its cores at 100 % (ACTIVE spins
forever: an idle server measured 100 % of a core busy against 0 % bounded,
benchmarks/openmp_idle.py). Anywhere else a
spinning worker would take a neighbour's time or the pod's CFS quota, so the server keeps
libgomp's passive default. `active` / `passive` set OMP_WAIT_POLICY whatever the resources.
Measured idle beside vLLM's CPU build: docs/BENCHMARKS.md.
"""
from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .crd import InferenceService


# NOTE: libgomp's spin rounds before a worker sleeps (300,000 by default, ~3 ms on the 2026-11-26
# test VM): 20 million keep it spinning ~200 ms, across every gap between steps while serving
BOUNDED_SPIN = 20_000_000


def openmp_env(svc: InferenceService) -> list[dict[str, Any]]:
    policy = svc.engine.openmp_wait_policy
    if policy == "auto":
        return [{"name": "GOMP_SPINCOUNT", "value": str(BOUNDED_SPIN)}] if dedicated_cpus(svc) else []
    return [{"name": "OMP_WAIT_POLICY", "value": policy.upper()}]


def dedicated_cpus(svc: InferenceService) -> bool:
    """A CPU kvmesh engine in the Guaranteed QoS class with whole CPUs."""
    if svc.gpu.count or svc.engine.runtime != "kvmesh":
        return False
    requests, limits = svc.resources.get("requests", {}), svc.resources.get("limits", {})
    cpus = _quantity(limits.get("cpu"))
    if cpus is None or cpus <= 0 or cpus != cpus.to_integral_value():
        return False
    if _quantity(requests.get("cpu", limits.get("cpu"))) != cpus:
        return False
    memory = limits.get("memory")
    return memory is not None and str(requests.get("memory", memory)) == str(memory)


def _quantity(value: Any) -> Decimal | None:
    """A CPU quantity ("2", 2, "2000m", "1.5") in CPUs; None when absent or not a CPU quantity."""
    if value is None or isinstance(value, bool):
        return None
    text = str(value).strip()
    try:
        return Decimal(text[:-1]) / 1000 if text.endswith("m") else Decimal(text)
    except InvalidOperation:
        return None
