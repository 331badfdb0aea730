"""`kvmesh serve --redis-url` / `--kv-events-config`: publish this pod's KV events and load to the
Redis prefix index, and/or over ZMQ in vLLM's format (zmq_events.py); both may be on."""
from __future__ import annotations

import argparse
import logging
import os
import socket
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry

from kvmesh.index.kv_bytes import redis_kv_connector
from kvmesh.index.metrics import KVShareCollector, PublisherCollector, ZmqPublisherCollector
from kvmesh.index.publisher import KVEventPublisher, publish_engine_state
from kvmesh.index.zmq_events import KVEventsConfig, ZmqKVEventPublisher

if TYPE_CHECKING:     # NOTE: imports torch; the server hands the engine in at run time
    from kvmesh.engine.async_engine import AsyncLLMEngine
    from kvmesh.engine.kv_connector import KVConnectorFactory


class MetricsSink(Protocol):
    """Where the publishers' collectors go: the server's metrics (a layer above this one)."""
    registry: CollectorRegistry

logger = logging.getLogger("kvmesh.index.serve")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("prefix index")
    g.add_argument("--redis-url", default=None,
                   help="publish KV events to this Redis (password from KVMESH_REDIS_PASSWORD)")
    g.add_argument("--pod-id", default=None, help="this engine's id in the index (default: POD_NAME "
                   "in a pod, else host:port, unique per serving endpoint)")
    g.add_argument("--advertise-url", default=None, help="URL the router reaches this engine at "
                   "(default: http://$POD_IP:PORT, or the listen address)")
    g.add_argument("--kv-share", choices=("redis",), default=None,
                   help="also store full prefix blocks' KV bytes in Redis and load other pods' "
                   "blocks instead of recomputing them (needs --redis-url)")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="also publish KV events over ZMQ in vLLM's format, with vLLM's flag: "
                   '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
                   '"tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\'')


def kv_events_config(args: argparse.Namespace) -> KVEventsConfig | None:
    """The validated --kv-events-config (None: off); ValueError says what is wrong."""
    return KVEventsConfig.parse(getattr(args, "kv_events_config", None))


def kv_connector(args: argparse.Namespace) -> KVConnectorFactory | None:
    """--kv-share redis: the engine's store of other pods' KV blocks (None: off)."""
    if not getattr(args, "kv_share", None):
        return None
    return redis_kv_connector(args.redis_url, password=os.environ.get("KVMESH_REDIS_PASSWORD"))


def default_pod_id(args: argparse.Namespace) -> str:
    """--pod-id, else $POD_NAME, else host:port.

    NOTE: not the bare host name: engines on one machine would all publish as the same pod and
    the index could not tell their caches apart."""
    if getattr(args, "pod_id", None):
        return args.pod_id
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}:{args.port}"


def _advertise_url(args: argparse.Namespace) -> str:
    if args.advertise_url:
        return args.advertise_url.rstrip("/")
    host = os.environ.get("POD_IP") or args.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"http://{host}:{args.port}"


def attach(async_engine: AsyncLLMEngine, args: argparse.Namespace, metrics: MetricsSink) -> None:
    """An ENGINE_HOOK: with --redis-url, publish after every step; clear the pod's entries on exit.
    With --kv-events-config, also publish every step's events over ZMQ."""
    zmq_config = kv_events_config(args)
    if zmq_config is not None:
        engine = async_engine.engine
        zmq_publisher = ZmqKVEventPublisher(zmq_config)
        # NOTE: events recorded before the publisher existed (none after a fresh start) go out
        # as its first batch, so subscribers see every block the cache holds.
        zmq_publisher.publish(engine.take_kv_event_batch())
        engine.add_observer(zmq_publisher)
        metrics.registry.register(ZmqPublisherCollector(zmq_publisher, engine.model_name))
        logger.info("publishing KV events over ZMQ on %s (replay: %s, topic %r)",
                    zmq_config.endpoint, zmq_config.replay_endpoint, zmq_config.topic)
    if not getattr(args, "redis_url", None):
        return
    engine = async_engine.engine
    publisher = KVEventPublisher(
        args.redis_url,
        pod_id=default_pod_id(args),
        model=engine.model_name,
        pod_url=_advertise_url(args),
        password=os.environ.get("KVMESH_REDIS_PASSWORD"),
        snapshot_fn=engine.cached_blocks,
    )
    publish_engine_state(publisher, engine)
    engine.add_observer(publisher)
    metrics.registry.register(PublisherCollector(publisher, engine.model_name))
    if engine.kv_share is not None:
        metrics.registry.register(KVShareCollector(engine.kv_share, engine.model_name))
    logger.info("publishing KV events to the prefix index as pod %s (%s)", publisher.pod_id,
                publisher.pod_url)
