"""/metrics for the prefix-index publisher and the cross-pod KV store (`--redis-url`,
`--kv-share redis`): prometheus_client collectors read at scrape time, registered on the
engine's registry by kvmesh.index.serve.attach.

    kvmesh:kv_index_connected                 1 while the publisher's Redis answers
    kvmesh:kv_index_{events_published, resyncs, redis_errors, batches_dropped,
                     heartbeat_lapses}_total
    kvmesh:kv_share_breaker_open              1 while the store is skipped after failures
    kvmesh:kv_share_{breaker_opens, prefetches_started, prefetch_hits, prefetch_misses,
                     prefetches_skipped, blocks_stored, stores_dropped, redis_errors}_total

    kvmesh:kv_events_zmq_{batches_published, batches_dropped, replays_served}_total
                                              (`--kv-events-config`)

The scheduler's side of the prefetch (requests that waited for it, waits that ran out) is
counted per step by kvmesh.api.metrics (kvmesh:kv_share_prefetch_{waits, timeouts}_total).
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvmesh.engine.kv_connector import KVConnector
from kvmesh.index.publisher import KVEventPublisher
from kvmesh.index.zmq_events import ZmqKVEventPublisher

_LABELS = ["model_name"]
PUBLISHER_COUNTERS = ("events_published", "resyncs", "redis_errors", "batches_dropped",
                      "heartbeat_lapses")
KV_SHARE_COUNTERS = {   # metric suffix -> KVConnectorStats field
    "breaker_opens": "breaker_opens", "prefetches_started": "prefetches_started",
    "prefetch_hits": "prefetch_hits", "prefetch_misses": "prefetch_misses",
    "prefetches_skipped": "prefetches_skipped", "blocks_stored": "blocks_stored",
    "stores_dropped": "stores_dropped", "redis_errors": "errors"}


def _gauge(name: str, help_: str, model: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, help_, labels=_LABELS)
    g.add_metric([model], value)
    return g


def _counter(name: str, model: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, name.split(":", 1)[1].replace("_", " "), labels=_LABELS)
    c.add_metric([model], value)
    return c


class PublisherCollector:
    """The publisher's health: Redis reachable, errors, resyncs, dropped batches, lapses."""

    def __init__(self, publisher: KVEventPublisher, model_name: str) -> None:
        self.publisher = publisher
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        p = self.publisher
        yield _gauge("kvmesh:kv_index_connected", "1 while Redis is reachable.", self.model_name,
                     1.0 if p.connected else 0.0)
        for name in PUBLISHER_COUNTERS:
            yield _counter(f"kvmesh:kv_index_{name}", self.model_name, float(getattr(p, name)))


class KVShareCollector:
    """The cross-pod KV store's counters and its circuit breaker."""

    def __init__(self, connector: KVConnector, model_name: str) -> None:
        self.connector = connector
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.connector.stats()
        yield _gauge("kvmesh:kv_share_breaker_open", "1 while the KV store is skipped after "
                     "repeated failures.", self.model_name, 1.0 if s.breaker_open else 0.0)
        for name, field in KV_SHARE_COUNTERS.items():
            yield _counter(f"kvmesh:kv_share_{name}", self.model_name, float(getattr(s, field)))


class ZmqPublisherCollector:
    """The ZMQ KV-event publisher's counters (`--kv-events-config`)."""

    def __init__(self, publisher: ZmqKVEventPublisher, model_name: str) -> None:
        self.publisher = publisher
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for name in ("batches_published", "batches_dropped", "replays_served"):
            yield _counter(f"kvmesh:kv_events_zmq_{name}", self.model_name,
                           float(getattr(self.publisher, name)))
