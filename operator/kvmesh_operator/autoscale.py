"""The operator's own autoscaler: waiting requests per engine pod → replicas, with a cooldown.

`decide` is pure; `scrape_waiting` reads `kvmesh:num_requests_waiting` from a pod's /metrics.
Scale to zero (`minReplicas: 0`) adds an `Activity`: the requests the routers hold for want of a
ready engine (`kvmesh_router_pending_requests`, `scrape_pending`), those the engines run
(`scrape_running`) and how long none of them was seen; from zero the first held request wakes one
engine, and the last one goes after `scaleToZeroAfterSeconds` without any.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from .crd import AutoscalingSpec
from .resources import PENDING_METRIC

_METRIC = re.compile(r"^(?:kvmesh|vllm):num_requests_waiting(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*", re.M)


@dataclass(frozen=True, slots=True)
class Activity:
    """What scale to zero looks at besides the engines' waiting queues (minReplicas 0 only)."""
    pending: float  # requests the routers hold while no engine is ready
    running: float  # requests the engine pods run now (a busy pod with an empty queue must stay)
    idle_seconds: float  # since the autoscaler last saw a running, waiting or held request


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int  # what the engine Deployment should run
    changed: bool  # differs from current (and the cooldown allowed it)
    reason: str  # for the Event and the log


def parse_waiting(metrics_text: str) -> float:
    """Sum of the waiting-queue gauges in one Prometheus text page (kvmesh: preferred over vllm:)."""
    kvmesh = [float(v) for v in re.findall(r"^kvmesh:num_requests_waiting(?:\{[^}]*\})?\s+(\S+)",
                                             metrics_text, re.M)]
    values = kvmesh or [float(m.group(1)) for m in _METRIC.finditer(metrics_text)]
    return sum(v for v in values if not math.isnan(v))


def parse_running(metrics_text: str) -> float:
    """Sum of the running-request gauges in one engine's page (kvmesh: preferred over vllm:)."""
    return _gauge_sum(metrics_text, "kvmesh:num_requests_running") or _gauge_sum(
        metrics_text, "vllm:num_requests_running")


def parse_pending(metrics_text: str) -> float:
    """The requests one router holds while no engine is ready (its `kvmesh_router_pending_requests`)."""
    return _gauge_sum(metrics_text, PENDING_METRIC)


def _gauge_sum(text: str, name: str) -> float:
    values = [float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)", text, re.M)]
    return sum(v for v in values if not math.isnan(v))


def is_active(waiting: list[float], activity: Activity) -> bool:
    """Any request waiting, running or held: the idle period starts over."""
    return sum(waiting) > 0 or activity.running > 0 or activity.pending > 0


def decide(spec: AutoscalingSpec, current: int, waiting: list[float], seconds_since_last_scale: float | None,
           activity: Activity | None = None) -> Decision:
    """Replicas so that each pod has about `target_waiting_requests` waiting, within [min, max].

    NOTE: with no ready pod reporting we hold the current count (scaling blind would thrash);
    every change, up or down, waits out the cooldown since the previous one. With minReplicas 0
    and an `activity`, the routers' held requests count as waiting, and to and from zero is
    `_to_or_from_zero`'s call.
    """
    floor = spec.min_replicas
    pending = 0.0
    if spec.min_replicas == 0 and activity is not None:
        if (zero := _to_or_from_zero(spec, current, waiting, activity)) is not None:
            return zero
        floor, pending = 1, activity.pending
    if not waiting:
        held = min(max(current, floor), spec.max_replicas)
        return Decision(held, held != current, "no engine pod reported metrics")
    total = sum(waiting) + pending
    want = math.ceil(total / spec.target_waiting_requests) if total > 0 else floor
    # NOTE: never below the pods already busy when the queue is non-empty.
    if total > 0:
        want = max(want, min(current, len(waiting)))
    want = min(max(want, floor), spec.max_replicas)
    if want == current:
        return Decision(current, False, f"{total:g} waiting over {len(waiting)} pod(s): steady")
    if seconds_since_last_scale is not None and seconds_since_last_scale < spec.cooldown_seconds:
        return Decision(current, False, f"cooling down ({seconds_since_last_scale:.0f}s < "
                                        f"{spec.cooldown_seconds}s), would scale to {want}")
    return Decision(want, True, f"{total:g} waiting over {len(waiting)} pod(s), target "
                                f"{spec.target_waiting_requests}/pod: {current} → {want}")


def _to_or_from_zero(spec: AutoscalingSpec, current: int, waiting: list[float], activity: Activity
                     ) -> Decision | None:
    """From zero to one when a request waits, to zero after the idle period; None: neither (the
    usual rule decides, with a floor of one engine).

    NOTE: waking from zero ignores the cooldown: a held request waits for the whole cold start
    already; the way down has its own, longer wait (scaleToZeroAfterSeconds)."""
    if current == 0:
        if activity.pending > 0:
            return Decision(1, True, f"{activity.pending:g} request(s) held by the router: 0 → 1")
        if is_active(waiting, activity):    # pods of the last scale-down still finishing
            return Decision(1, True, f"{sum(waiting) + activity.running:g} request(s) running or waiting: 0 → 1")
        return Decision(0, False, "scaled to zero: no request held")
    if not is_active(waiting, activity) and activity.idle_seconds >= spec.scale_to_zero_after_seconds:
        return Decision(0, True, f"no request for {activity.idle_seconds:.0f}s (scaleToZeroAfterSeconds "
                                 f"{spec.scale_to_zero_after_seconds}): {current} → 0")
    return None


async def scrape_waiting(pod_ips: list[str], port: int, timeout_s: float = 2.0) -> list[float]:
    """Waiting requests of each reachable pod (unreachable pods are skipped)."""
    return await _scrape(pod_ips, port, parse_waiting, timeout_s)


async def scrape_running(pod_ips: list[str], port: int, timeout_s: float = 2.0) -> float:
    """Requests the reachable engine pods run now."""
    return sum(await _scrape(pod_ips, port, parse_running, timeout_s))


async def scrape_pending(pod_ips: list[str], port: int, timeout_s: float = 2.0) -> float:
    """Requests the reachable router pods hold while no engine is ready."""
    return sum(await _scrape(pod_ips, port, parse_pending, timeout_s))


async def _scrape(pod_ips: list[str], port: int, parse: Callable[[str], float], timeout_s: float) -> list[float]:
    out: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        for ip in pod_ips:
            try:
                async with http.get(f"http://{ip}:{port}/metrics") as resp:
                    if resp.status == 200:
                        out.append(parse(await resp.text()))
            except (aiohttp.ClientError, TimeoutError):
                continue
    return out
