"""The router's backends: static URLs or a headless Service's DNS records, health and load.

Health: `GET /health` every `health_interval_s`, and `GET /ready` for kvmesh engines (a loading or
draining engine answers 503 there): one failure marks a backend unhealthy, one success heals it; a request that cannot connect marks it unhealthy at once. Load: the pods' Redis
heartbeats, matched to backends by URL; while Redis is down, each backend's `/metrics` instead.
vLLM backends (`--backend-kind vllm`, or `vllm=URL`) publish no heartbeat of their own: their
`/metrics` is scraped every round and the router's KV-event subscriber heartbeats for them
(vllm_events.py).
"""
from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from kvmesh.index.lookup import PodLoad
from kvmesh.router.pod_claims import PodClaims
from kvmesh.router.routing_policy import BackendState

logger = logging.getLogger("kvmesh.router")

_METRIC = re.compile(r"^(?:kvmesh|vllm):(num_requests_running|num_requests_waiting|"
                     r"gpu_cache_usage_perc|kv_cache_usage_perc)(?:\{[^}]*\})?\s+(\S+)", re.M)


BACKEND_KINDS = ("kvmesh", "vllm")


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One --backends entry: `[KIND=]URL[#kv-events=PORT[,REPLAY_PORT]]`."""
    kind: str                                   # kvmesh | vllm
    url: str                                    # normalised base URL
    kv_events_ports: tuple[int, int] | None     # this vLLM backend's PUB and replay ports (0:
    #                                             none); None: the router's --kv-events-port(s)


def parse_backend(entry: str, default_kind: str) -> BackendSpec:
    """A --backends entry -> BackendSpec; ValueError saying what is wrong.

    NOTE: the ports ride in the URL's fragment, which is never sent to a server: several vLLM
    engines on one host (each binds its own ports) can be told apart."""
    kind, sep, url = entry.partition("=")
    if not sep or "://" in kind or "/" in kind:
        kind, url = default_kind, entry
    if kind not in BACKEND_KINDS:
        raise ValueError(f"backend kind must be one of {', '.join(BACKEND_KINDS)}, got "
                         f"{kind!r} in {entry!r}")
    url, _, fragment = url.partition("#")
    if not url:
        raise ValueError(f"backend {entry!r} has no URL")
    ports = None
    if fragment:
        m = re.fullmatch(r"kv-events=(\d+)(?:,(\d+))?", fragment)
        if m is None or kind != "vllm":
            raise ValueError(f"backend {entry!r}: the only annotation is #kv-events=PORT"
                             "[,REPLAY_PORT], on a vllm backend")
        ports = (int(m.group(1)), int(m.group(2) or 0))
        if not 0 < ports[0] < 65536 or not 0 <= ports[1] < 65536 or ports[0] == ports[1]:
            raise ValueError(f"backend {entry!r}: kv-events ports must be two different TCP "
                             "ports (replay 0: none)")
    return BackendSpec(kind, normalize_url(url), ports)


def normalize_url(url: str) -> str:
    """scheme://host:port with the default port filled in, `localhost` as 127.0.0.1, no
    trailing slash: the form compared between --backends, DNS and pod heartbeats."""
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url.rstrip("/"))
    scheme = (parts.scheme or "http").lower()
    host = (parts.hostname or "").lower()
    if host == "localhost":
        host = "127.0.0.1"
    port = parts.port or (443 if scheme == "https" else 80)
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}{parts.path}"


def parse_load_metrics(text: str) -> tuple[int, int, float] | None:
    """(running, waiting, kv_usage) from a Prometheus page, or None if it has none of them."""
    found: dict[str, float] = {}
    for name, value in _METRIC.findall(text):
        try:
            found[name] = found.get(name, 0.0) + float(value)
        except ValueError:
            continue
    if not found:
        return None
    kv = found.get("kv_cache_usage_perc", found.get("gpu_cache_usage_perc", 0.0))
    return (int(found.get("num_requests_running", 0)), int(found.get("num_requests_waiting", 0)),
            kv)


class BackendPool:
    def __init__(self, urls: list[str] | None = None, discover: str | None = None,
                 backend_port: int = 8000, health_timeout_s: float = 1.0,
                 default_kind: str = "kvmesh") -> None:
        if not urls and not discover:
            raise ValueError("give --backends URL ... or --discover-headless-service NAME")
        self.discover = discover
        self.backend_port = backend_port
        self.health_timeout_s = health_timeout_s
        self.default_kind = default_kind        # the kind of discovered backends
        self.backends: dict[str, BackendState] = {}
        self.claims = PodClaims()
        self.duplicate_pod_ids: dict[str, set[str]] = {}   # pod id -> URLs sharing it
        self.scraped_load: dict[str, tuple[int, int, float]] = {}   # url -> last /metrics load
        self.kv_events_ports: dict[str, tuple[int, int]] = {}   # url -> its own ZMQ ports
        for entry in urls or ():
            spec = parse_backend(entry, default_kind)
            # NOTE: start healthy so the first requests need not wait for a health check.
            self.backends[spec.url] = BackendState(spec.url, kind=spec.kind)
            if spec.kv_events_ports is not None:
                self.kv_events_ports[spec.url] = spec.kv_events_ports

    def states(self) -> list[BackendState]:
        """Every backend, in a stable order (the policy's tie-break order)."""
        return [self.backends[u] for u in sorted(self.backends)]

    def healthy(self) -> list[BackendState]:
        return [b for b in self.states() if b.healthy]

    def mark_unhealthy(self, url: str, why: str) -> None:
        b = self.backends.get(url)
        if b is not None and b.healthy:
            b.healthy = False
            logger.warning("backend %s marked unhealthy: %s", url, why)

    async def discover_now(self) -> None:
        """Replace the backend set with the Service's current DNS records (no-op when static)."""
        if not self.discover:
            return
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.discover, self.backend_port,
                                           type=socket.SOCK_STREAM)
        except OSError as e:
            logger.warning("cannot resolve %s: %s (keeping %d backends)", self.discover, e,
                           len(self.backends))
            return
        urls = {normalize_url(f"http://{_host(info[4][0])}:{info[4][1]}") for info in infos}
        for u in urls - self.backends.keys():
            logger.info("discovered backend %s", u)
            self.backends[u] = BackendState(u, kind=self.default_kind)
        for u in self.backends.keys() - urls:
            logger.info("backend %s left %s", u, self.discover)
            del self.backends[u]
            self.scraped_load.pop(u, None)

    async def check_health(self, client: httpx.AsyncClient, scrape_load: bool) -> None:
        """GET /health on every backend at once (and /metrics for load when `scrape_load`)."""
        await asyncio.gather(*(self._check(client, b, scrape_load) for b in self.states()))

    async def _check(self, client: httpx.AsyncClient, b: BackendState, scrape: bool) -> None:
        try:
            r = await client.get(f"{b.url}/health", timeout=self.health_timeout_s)
            ok = r.status_code == 200
            if ok and b.kind == "kvmesh":
                # NOTE: a kvmesh engine answers /health while its model loads (and refuses requests
                # with 503); /ready says when it serves. A backend without /ready (404): /health decides.
                r = await client.get(f"{b.url}/ready", timeout=self.health_timeout_s)
                ok = r.status_code != 503
            if ok and (scrape or b.kind == "vllm"):
                m = await client.get(f"{b.url}/metrics", timeout=self.health_timeout_s)
                load = parse_load_metrics(m.text) if m.status_code == 200 else None
                if load is not None:
                    self.scraped_load[b.url] = load
                    if scrape:
                        b.running, b.waiting, b.kv_usage = load
        except httpx.HTTPError as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        else:
            why = f"{r.url.path} returned {r.status_code}"
        if ok and not b.healthy:
            logger.info("backend %s is healthy", b.url)
            b.healthy = True
        elif not ok:
            self.mark_unhealthy(b.url, why)

    def apply_heartbeats(self, pods: dict[str, PodLoad], now: float | None = None) -> None:
        """Take pod ids and loads from the Redis heartbeats of the pods behind our backends.
        A backend whose pod id another backend also claims (pod_claims.py) gets no pod id: no
        prefix hits, routed by load."""
        now = time.monotonic() if now is None else now
        by_url = {normalize_url(p.url): p for p in pods.values() if p.url}
        self.claims.observe({p.pod_id: u for u, p in by_url.items()}, now)
        self.duplicate_pod_ids = self.claims.duplicates(now)
        shared = set().union(*self.duplicate_pod_ids.values())
        for b in self.backends.values():
            p = by_url.get(b.url)
            if p is None:
                b.pod_id = None          # not publishing: no prefix hits, load = in-flight
                b.running = b.waiting = 0
                b.kv_usage = 0.0
                continue
            b.pod_id = None if b.url in shared else p.pod_id
            b.running, b.waiting, b.kv_usage = p.running, p.waiting, p.kv_usage


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
