"""The router's KV-event subscribers for vLLM backends: one per backend, as backends come and go.

    health round ─▶ sync(pool) ─┬─ new vLLM backend   ─▶ start a VllmEventSubscriber
                                ├─ backend gone        ─▶ stop it, clear its index entries
                                └─ every vLLM backend  ─▶ its health and /metrics load

A backend's publisher is on the backend's host (from --backends, or the pod IP that
--discover-headless-service resolved), at --kv-events-port / --kv-events-replay-port. The
subscriber (kvmesh.index.vllm_subscriber) writes the shared Redis index, so every router replica
sees the blocks every vLLM engine holds, keyed by kvmesh's own hash of their tokens.
"""
from __future__ import annotations

import logging
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvmesh.index.vllm_subscriber import IndexTarget, VllmEventSubscriber, VllmSource
from kvmesh.router.backends import BackendPool
from kvmesh.router.config import RouterConfig

logger = logging.getLogger("kvmesh.router")


def source_for(url: str, cfg: RouterConfig, ports: tuple[int, int] | None = None) -> VllmSource:
    """Where the vLLM engine serving at `url` publishes its KV events: its host, at `ports`
    (PUB, replay; from its --backends entry) or the router's --kv-events-port(s)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    pub_port, replay_port = ports or (cfg.kv_events_port, cfg.kv_events_replay_port)
    replay = f"tcp://{host}:{replay_port}" if replay_port else None
    return VllmSource(pod_id=f"{host}:{parts.port}", url=url,
                      endpoint=f"tcp://{host}:{pub_port}", replay_endpoint=replay,
                      topic=cfg.kv_events_topic)


class VllmEventSources:
    """Owns the subscribers; `sync` runs on the router's event loop after each health round."""

    def __init__(self, cfg: RouterConfig, model: str, heartbeat_interval_s: float = 1.0,
                 heartbeat_ttl_s: float = 5.0) -> None:
        self.cfg = cfg
        self.target = IndexTarget(cfg.redis_url or "", model, cfg.block_size, cfg.hash_seed,
                                  cfg.namespace, cfg.service, cfg.redis_password)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.subscribers: dict[str, VllmEventSubscriber] = {}     # backend url -> subscriber

    def sync(self, pool: BackendPool) -> None:
        """Start, stop and update subscribers to match the pool's vLLM backends."""
        wanted = {b.url: b for b in pool.states() if b.kind == "vllm"}
        for url in self.subscribers.keys() - wanted.keys():
            logger.info("vLLM backend %s left: stopping its KV event subscriber", url)
            self.subscribers.pop(url).stop(clear=True)
        for url, b in wanted.items():
            sub = self.subscribers.get(url)
            if sub is not None and not sub.running:
                logger.warning("KV event subscriber of %s stopped: restarting it", url)
                sub.stop(clear=False)
                sub = None
            if sub is None:
                sub = VllmEventSubscriber(source_for(url, self.cfg, pool.kv_events_ports.get(url)),
                                          self.target,
                                          self.heartbeat_interval_s, self.heartbeat_ttl_s)
                self.subscribers[url] = sub
                logger.info("following the KV events of vLLM backend %s at %s", url,
                            sub.source.endpoint)
            sub.set_healthy(b.healthy)
            load = pool.scraped_load.get(url)
            if load is not None:
                sub.set_load(*load)

    def stop(self) -> None:
        """Router shutdown: stop every subscriber; entries expire with their heartbeats (other
        router replicas keep them alive)."""
        for sub in self.subscribers.values():
            sub.stop(clear=False)
        self.subscribers.clear()


_COUNTERS = {
    "batches_applied": "KV event batches applied to the index",
    "replays": "Replay requests sent for sequence gaps",
    "lost_batches": "KV event batches neither the stream nor a replay supplied",
    "skipped_blocks": "Blocks left out of the index (LoRA, extra keys, block size, unknown parent)",
    "restarts": "Engine restarts seen (sequence numbers started again)",
    "decode_errors": "Undecodable KV event messages",
    "redis_errors": "Failed index writes (the pod is rewritten from memory)",
}


class VllmEventsCollector:
    """The subscribers' state on the router's /metrics, one series per vLLM backend."""

    def __init__(self, sources: VllmEventSources) -> None:
        self.sources = sources

    def collect(self):
        subs = list(self.sources.subscribers.items())
        live = GaugeMetricFamily("kvmesh_router_vllm_events_live",
                                 "1 while a vLLM backend's KV events count (healthy, publisher "
                                 "answering)", labels=["backend"])
        for url, sub in subs:
            live.add_metric([url], 1.0 if sub.live else 0.0)
        yield live
        for name, help_ in _COUNTERS.items():
            c = CounterMetricFamily(f"kvmesh_router_vllm_events_{name}", help_, labels=["backend"])
            for url, sub in subs:
                c.add_metric([url], float(getattr(sub, name)))
            yield c
