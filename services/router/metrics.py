"""The router's Prometheus metrics, in a registry of their own (one per app instance)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvmesh.router.hold import OUTCOMES
from kvmesh.router.routing_policy import REASONS


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter("kvmesh_router_decisions_total",
                                 "Routing decisions by reason", ["reason"], registry=r)
        for reason in REASONS:
            self.decisions.labels(reason)
        self.prefix_hit_blocks = Histogram(
            "kvmesh_router_prefix_hit_blocks",
            "Consecutive prompt blocks cached on the chosen backend", registry=r,
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048))
        self.lookup_seconds = Histogram(
            "kvmesh_router_lookup_seconds", "Redis prefix lookup latency", registry=r,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5))
        self.lookup_timeouts = Counter(
            "kvmesh_router_lookup_timeouts_total",
            "Prefix lookups that missed their deadline (that request was routed by load)",
            registry=r)
        self.fallbacks = Counter("kvmesh_router_fallbacks_total",
                                 "Requests routed without the prefix index (Redis unreachable or slow)",
                                 registry=r)
        self.backend_healthy = Gauge("kvmesh_router_backend_healthy",
                                     "1 when the backend passes health checks", ["backend"],
                                     registry=r)
        self.retries = Counter("kvmesh_router_retries_total",
                               "Requests re-sent to another backend after a connection that was never made",
                               registry=r)
        self.client_disconnects = Counter(
            "kvmesh_router_client_disconnects_total",
            "Non-streaming requests whose client left before the answer (backend request "
            "cancelled)", registry=r)
        self.redis_up = Gauge("kvmesh_router_redis_up", "1 while the prefix index is reachable",
                              registry=r)
        self.duplicate_pod_ids = Gauge(
            "kvmesh_router_duplicate_pod_ids",
            "Pod ids whose heartbeat more than one backend claims (those backends are routed "
            "by load)", registry=r)
        # scale to zero (hold.py): the operator's autoscaler and KEDA read the pending count
        self.pending_requests = Gauge(
            "kvmesh_router_pending_requests",
            "Requests held while no engine is ready (--hold-timeout)", ["model_name"], registry=r)
        self.held_requests = Counter(
            "kvmesh_router_held_requests_total",
            "Held requests by how their wait ended: sent, timeout, full (refused: the queue was "
            "full), disconnected", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.held_requests.labels(outcome)


PREFILL_OUTCOMES = ("handoff", "no-params", "failed", "refused")
DECODE_KINDS = ("remote-prefill", "local-prefill")


class DisaggMetrics:
    """The two hops of P/D mode (disagg.py), in the router's registry; only a P/D router has them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.prefill_requests = Counter(
            "kvmesh_router_prefill_requests_total",
            "Prefill hops by outcome: handoff (kv_transfer_params returned), no-params (answered "
            "without them), failed (backend unreachable, died or 5xx/429: tried on another), "
            "refused (4xx passed to the client)", ["outcome"], registry=r)
        for outcome in PREFILL_OUTCOMES:
            self.prefill_requests.labels(outcome)
        self.prefill_seconds = Histogram(
            "kvmesh_router_prefill_seconds",
            "Prefill hop latency, request sent to answer read (successful hops)", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
        self.decode_requests = Counter(
            "kvmesh_router_decode_requests_total",
            "Decode hops by how the prompt's KV gets there: remote-prefill (the prefill "
            "engine's kv_transfer_params sent along), local-prefill (sent without them: the "
            "decode engine prefills itself)", ["kind"], registry=r)
        for kind in DECODE_KINDS:
            self.decode_requests.labels(kind)
        self.local_prefill_fallbacks = Counter(
            "kvmesh_router_prefill_fallbacks_total",
            "Requests sent to a decode engine alone because no prefill engine could take them "
            "(none healthy, or every one tried failed)", registry=r)
