"""The operator's own autoscaler: waiting requests per engine pod → replicas, with a cooldown.

`decide` is pure; `scrape_waiting` reads `kvmesh:num_requests_waiting` from a pod's /metrics.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import aiohttp

from .crd import AutoscalingSpec

_METRIC = re.compile(r"^(?:kvmesh|vllm):num_requests_waiting(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*", re.M)


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


def decide(spec: AutoscalingSpec, current: int, waiting: list[float], seconds_since_last_scale: float | None
           ) -> Decision:
    """Replicas so that each pod has about `target_waiting_requests` waiting, within [min, max].

    NOTE: with no ready pod reporting we hold the current count (scaling blind would thrash);
    every change, up or down, waits out the cooldown since the previous one.
    """
    if not waiting:
        held = min(max(current, spec.min_replicas), spec.max_replicas)
        return Decision(held, held != current, "no engine pod reported metrics")
    total = sum(waiting)
    want = math.ceil(total / spec.target_waiting_requests) if total > 0 else spec.min_replicas
    # NOTE: never below the pods already busy when the queue is non-empty.
    if total > 0:
        want = max(want, min(current, len(waiting)))
    want = min(max(want, spec.min_replicas), spec.max_replicas)
    if want == current:
        return Decision(current, False, f"{total:g} waiting over {len(waiting)} pod(s): steady")
    if seconds_since_last_scale is not None and seconds_since_last_scale < spec.cooldown_seconds:
        return Decision(current, False, f"cooling down ({seconds_since_last_scale:.0f}s < "
                                        f"{spec.cooldown_seconds}s), would scale to {want}")
    return Decision(want, True, f"{total:g} waiting over {len(waiting)} pod(s), target "
                                f"{spec.target_waiting_requests}/pod: {current} → {want}")


async def scrape_waiting(pod_ips: list[str], port: int, timeout_s: float = 2.0) -> list[float]:
    """Waiting requests of each reachable pod (unreachable pods are skipped)."""
    out: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        for ip in pod_ips:
            try:
                async with http.get(f"http://{ip}:{port}/metrics") as resp:
                    if resp.status == 200:
                        out.append(parse_waiting(await resp.text()))
            except (aiohttp.ClientError, TimeoutError):
                continue
    return out
