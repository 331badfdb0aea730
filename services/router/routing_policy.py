"""Routing policy: PURE scoring of backends (no I/O), so every decision is unit-testable.

kv-aware score of a healthy backend b for a prompt of N full blocks:

    score(b) = w_prefix * hits(b) / N  +  w_queue * (1 - load(b) / max_load)  +  w_kv * (1 - kv(b))

    hits(b)  consecutive blocks from block 0 that b holds (Redis index)
    load(b)  outstanding requests: max(running + waiting from its heartbeat, router in-flight)
    max_load max(load) over healthy backends (1 when all are idle)

Load guard: when the top-scoring backend is overloaded (load more than `guard_threshold` above the
least-loaded backend's, or KV usage >= `guard_kv_usage`), the best-scoring backend that is not
overloaded wins instead (reason "load-guard"), so a hot prefix never piles onto one pod while
others idle. Exact ties break by lower load, then by `rr_counter` over the tied backends in list
order: deterministic for given inputs, yet cold prompts still spread.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

STRATEGIES = ("kv-aware", "round-robin", "least-loaded", "random")
REASONS = ("prefix-hit", "load-guard", "least-loaded", "round-robin", "random",
           "session-affinity", "fallback-no-redis", "fallback-slow-lookup", "no-prefix")


@dataclass(slots=True)
class BackendState:
    """What the policy knows about one backend."""
    url: str                    # base URL, also the backend's identity in metrics
    healthy: bool = True        # passed its last health check and request
    pod_id: str | None = None   # the pod id it publishes under in Redis (from its heartbeat)
    running: int = 0            # from the heartbeat (or /metrics)
    waiting: int = 0            # from the heartbeat (or /metrics)
    kv_usage: float = 0.0       # from the heartbeat (or /metrics), 0..1
    in_flight: int = 0          # requests this router has sent and not seen finish
    kind: str = "kvmesh"        # engine software: kvmesh (publishes to Redis) | vllm (ZMQ events)

    @property
    def load(self) -> int:
        # NOTE: the heartbeat counts every router's requests but lags by up to a second; the
        # in-flight count is exact for this router and immediate. Take the larger.
        return max(self.running + self.waiting, self.in_flight)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    w_prefix: float = 2.0        # weight of the prefix hit fraction
    w_queue: float = 1.0         # weight of the (inverted, normalised) load
    w_kv: float = 1.0            # weight of the free KV fraction
    guard_threshold: int = 8     # max load above the least-loaded backend before the guard
    guard_kv_usage: float = 0.95  # KV usage at which a backend counts as overloaded

    def __post_init__(self) -> None:
        if min(self.w_prefix, self.w_queue, self.w_kv) < 0:
            raise ValueError("policy weights must be >= 0")
        if self.guard_threshold < 0:
            raise ValueError("guard_threshold must be >= 0")


@dataclass(frozen=True, slots=True)
class Decision:
    backend: BackendState
    reason: str                  # one of REASONS
    prefix_blocks: int = 0       # consecutive blocks the chosen backend holds


def _hits(b: BackendState, prefix_hits: dict[str, int]) -> int:
    return prefix_hits.get(b.pod_id, 0) if b.pod_id is not None else 0


def _pick(tied: list[BackendState], rr_counter: int) -> BackendState:
    return tied[rr_counter % len(tied)]


def _least_loaded(healthy: list[BackendState], rr_counter: int) -> BackendState:
    key = min((b.load, b.kv_usage) for b in healthy)
    return _pick([b for b in healthy if (b.load, b.kv_usage) == key], rr_counter)


def _affinity(healthy: list[BackendState], session_key: str) -> BackendState:
    """Rendezvous hashing: a key keeps its backend while that backend stays healthy, and only
    the keys of a removed backend move."""
    def weight(b: BackendState) -> bytes:
        return hashlib.sha256(f"{session_key}\0{b.url}".encode()).digest()
    return max(healthy, key=weight)


def score(b: BackendState, hits: int, num_blocks: int, max_load: int,
          cfg: PolicyConfig) -> float:
    prefix = hits / num_blocks if num_blocks else 0.0
    queue = 1.0 - b.load / max_load
    kv = 1.0 - min(max(b.kv_usage, 0.0), 1.0)
    return cfg.w_prefix * prefix + cfg.w_queue * queue + cfg.w_kv * kv


def choose(backends: list[BackendState], prefix_hits: dict[str, int], num_blocks: int,
           strategy: str, rr_counter: int, rng: random.Random, session_key: str | None = None,
           redis_ok: bool = True, config: PolicyConfig = PolicyConfig(),
           fallback_reason: str = "fallback-no-redis") -> Decision | None:
    """The backend for one request, or None when no backend is healthy.

    redis_ok False: the prefix index gave no answer for this request; kv-aware routes by least
    load and reports `fallback_reason` ("fallback-no-redis", or "fallback-slow-lookup" when only
    this lookup missed its deadline)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown routing strategy {strategy!r}; use one of {STRATEGIES}")
    healthy = [b for b in backends if b.healthy]
    if not healthy:
        return None
    if session_key:
        b = _affinity(healthy, session_key)
        return Decision(b, "session-affinity", _hits(b, prefix_hits))
    if strategy == "round-robin":
        b = _pick(healthy, rr_counter)
        return Decision(b, "round-robin", _hits(b, prefix_hits))
    if strategy == "random":
        b = rng.choice(healthy)
        return Decision(b, "random", _hits(b, prefix_hits))
    if strategy == "least-loaded" or not redis_ok:
        b = _least_loaded(healthy, rr_counter)
        return Decision(b, "least-loaded" if redis_ok else fallback_reason, 0)
    return _kv_aware(healthy, prefix_hits, num_blocks, rr_counter, config)


def _kv_aware(healthy: list[BackendState], prefix_hits: dict[str, int], num_blocks: int,
              rr_counter: int, cfg: PolicyConfig) -> Decision:
    max_load = max(1, max(b.load for b in healthy))
    min_load = min(b.load for b in healthy)
    hits = {id(b): _hits(b, prefix_hits) for b in healthy}

    def best_of(cands: list[BackendState]) -> BackendState:
        # NOTE: round so float noise cannot break a tie that is exact in intent.
        scored = [(round(score(b, hits[id(b)], num_blocks, max_load, cfg), 9), -b.load, b)
                  for b in cands]
        top = max((s, l) for s, l, _ in scored)
        return _pick([b for s, l, b in scored if (s, l) == top], rr_counter)

    def overloaded(b: BackendState) -> bool:
        return b.load - min_load > cfg.guard_threshold or b.kv_usage >= cfg.guard_kv_usage

    best = best_of(healthy)
    if overloaded(best):
        ok = [b for b in healthy if not overloaded(b)]
        if ok:
            other = best_of(ok)
            return Decision(other, "load-guard", hits[id(other)])
    n = hits[id(best)]
    return Decision(best, "prefix-hit" if n > 0 else "no-prefix", n)
