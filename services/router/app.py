"""The router: an OpenAI-compatible reverse proxy that picks an engine per request.

    request ─▶ auth ─▶ tokenize (chat template) ─▶ block hashes ─▶ Redis lookup (1 round trip)
            ─▶ policy.choose(backends, hits, load) ─▶ forward ─▶ stream the backend's bytes back

A backend that refuses the connection is marked unhealthy and the request goes to one other
backend: a request is re-sent only when it provably never reached a backend (the connection was
never made) or provably died there (the connection broke before an answer and the backend now
refuses new connections: its process is gone), so no request ever runs twice. A backend that took
the request and then failed any other way answers the client 502; so does a stream the client
already receives. Backend responses, errors included, pass through with their status.
A client that goes away before its non-streaming answer closes the backend connection, which
aborts the request on the engine. With Redis unreachable the kv-aware strategy falls back to
least-loaded. In P/D mode (disagg.py) a prefill hop on a prefill engine comes first; what follows
is the decode hop, on the decode engines.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
from contextlib import asynccontextmanager, suppress

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvmesh.common.auth import check_bearer
from kvmesh.common.cache_salt import CacheSaltSource
from kvmesh.common.disconnect import ClientDisconnected, until_disconnect
from kvmesh.common.openai_errors import error_body, error_json
from kvmesh.index.connect import redis_client_kwargs
from kvmesh.index.hashing import prompt_block_hashes
from kvmesh.index.lookup import PrefixIndex
from kvmesh.router.adapters import AdapterDirectory, AdapterRoute, UnknownModel
from kvmesh.router.backends import BackendPool
from kvmesh.router.config import RouterConfig
from kvmesh.router.disagg import Disaggregation, RoutingInputs
from kvmesh.router.hold import RequestHold
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.prompt import prompt_token_ids
from kvmesh.router.routing_policy import BackendState, choose
from kvmesh.router.recent import RecentRoutes, merge_hits
from kvmesh.router.vllm_events import VllmEventsCollector, VllmEventSources

logger = logging.getLogger("kvmesh.router")

_HOP_BY_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
               "trailer", "upgrade", "proxy-authorization", "proxy-connection",
               "accept-encoding"}
_PASS_BACK = ("content-type", "x-request-id", "retry-after")
# NOTE: only a connection that was never made is retried (once) on another backend. A reset or a
# close after the request was written (ReadError, RemoteProtocolError) is ambiguous: the backend
# may have read the body and started generating, so re-sending could run the request twice.
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
# NOTE: ... unless the backend's process is gone. A read error on a request the backend took,
# followed by a refused connection to the same address, means its process died (the kernel closed
# its sockets; nothing listens there now) and the request died with it: it can never be answered
# and never run again there, so it is sent once to another backend. Any other outcome of the probe
# (it connects, it times out) keeps the rule: 502, not re-sent.
_LOST_WITH_PROCESS = (httpx.NetworkError, httpx.RemoteProtocolError)
_MAX_RETRIES = 1
# NOTE: a pooled connection idle this long is dropped, well before the backends close idle ones
# (uvicorn's keep-alive timeout, kvmesh's and vLLM's, is 5 s; httpx's own default is the same 5 s).
# With equal timeouts a request written on a connection the backend is closing at that moment
# breaks unread as RemoteProtocolError: ambiguous, so the client got a 502.
BACKEND_KEEPALIVE_S = 2.0
PROBE_LINGER_S = 1.0     # how long an accepted probe must stay open to count as a live backend
_DISCONNECT_POLL_S = 0.25
_INLINE_TOKENIZE_BYTES = 16 * 1024


async def process_gone(url: str, timeout_s: float, linger_s: float = PROBE_LINGER_S) -> bool:
    """Whether nothing serves at `url` any more: a new TCP connection is refused, or is accepted
    and then reset or closed within `linger_s` without a byte sent.

    NOTE: a process being killed still holds its listening socket for a moment after its
    connections broke (the kernel closes them one by one): the probe is then accepted into the
    listener's backlog and reset as the listener closes. A live HTTP server keeps an idle new
    connection open for seconds (uvicorn's keep-alive timeout is 5 s)."""
    u = httpx.URL(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(u.host, port), timeout_s)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    try:
        return await asyncio.wait_for(reader.read(1), linger_s) == b""
    except TimeoutError:
        return False            # still open: something serves there
    except OSError:             # reset
        return True
    finally:
        writer.close()
        with suppress(OSError):
            await writer.wait_closed()


class _Release:
    """Close a streamed backend response and drop its in-flight count, exactly once."""

    def __init__(self, resp: httpx.Response, backend: BackendState) -> None:
        self.resp = resp
        self.backend = backend
        self.done = False

    async def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        self.backend.in_flight -= 1
        await self.resp.aclose()


class RouterState:
    """Everything one router instance owns: backends, index, metrics, background loops."""

    def __init__(self, cfg: RouterConfig, tokenizer=None, model_name: str | None = None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_name = model_name or cfg.model or ""
        self.salt_from = CacheSaltSource.parse(cfg.cache_salt_from)
        # NOTE: in P/D mode the decode engines are the pool that answers clients
        self.pool = BackendPool(list(cfg.decode_backends or cfg.backends),
                                cfg.decode_discover or cfg.discover, cfg.backend_port,
                                default_kind=cfg.backend_kind)
        self.metrics = RouterMetrics()
        self.hold = RequestHold(cfg.hold_timeout_s, cfg.max_held_requests,
                                self.metrics.pending_requests.labels(self.model_name),
                                self.metrics.held_requests)
        # vLLM backends' KV events -> the shared index (None: every backend is a kvmesh engine)
        self.vllm: VllmEventSources | None = None
        if cfg.redis_url and (cfg.backend_kind == "vllm"
                              or any(b.kind == "vllm" for b in self.pool.states())):
            self.vllm = VllmEventSources(cfg, self.model_name)
            self.metrics.registry.register(VllmEventsCollector(self.vllm))
        self.rr = itertools.count()
        self.rng = random.Random()
        self.recent = RecentRoutes()
        self.adapters = AdapterDirectory()       # which backend holds which LoRA adapter
        self.redis = None
        self.index: PrefixIndex | None = None
        self.redis_ok = False
        self._redis_warned = False
        self.http: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task] = []
        # P/D mode (disagg.py): the prefill engines and the prefill hop; None: colocated engines
        self.disagg = Disaggregation(self) if cfg.disaggregated else None

    def _pools(self) -> list[BackendPool]:
        return [self.pool] if self.disagg is None else [self.pool, self.disagg.pool]

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=self.cfg.connect_timeout_s, read=None, write=60.0,
                                  pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                keepalive_expiry=BACKEND_KEEPALIVE_S))
        if self.cfg.redis_url:
            import redis.asyncio as aioredis  # noqa: PLC0415
            from redis.backoff import NoBackoff  # noqa: PLC0415
            from redis.asyncio.retry import Retry  # noqa: PLC0415

            self.redis = aioredis.from_url(
                self.cfg.redis_url, password=self.cfg.redis_password, decode_responses=True,
                # NOTE: the socket waits as long as the slowest caller (the heartbeat read);
                # each prefix lookup is cut short by its own, tighter deadline.
                socket_timeout=self.cfg.heartbeat_timeout_s,
                socket_connect_timeout=self.cfg.heartbeat_timeout_s,
                **redis_client_kwargs(self.cfg.redis_url),
                # NOTE: one immediate retry: after Redis restarts, every pooled connection is
                # stale and fails once; without a retry each of them would flip routing to the
                # no-Redis fallback. The lookup's own deadline still bounds the whole call.
                retry=Retry(NoBackoff(), 1))
            self.index = PrefixIndex(self.redis, self.cfg.namespace, self.cfg.service)
        for pool in self._pools():
            await pool.discover_now()
        if self.vllm is not None:
            await asyncio.to_thread(self.vllm.sync, self.pool)
        await self.refresh_load()
        await self.refresh_adapters()
        self._tasks = [asyncio.create_task(self._health_loop()),
                       asyncio.create_task(self._load_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with suppress(asyncio.CancelledError, Exception):
                await t
        if self.http is not None:
            await self.http.aclose()
        if self.vllm is not None:
            await asyncio.to_thread(self.vllm.stop)
        if self.redis is not None:
            with suppress(Exception):
                await self.redis.aclose()

    # ---- background loops ------------------------------------------------------------------
    async def _health_loop(self) -> None:
        next_discover = time.monotonic() + self.cfg.discover_interval_s
        while True:
            try:
                if time.monotonic() >= next_discover:
                    for pool in self._pools():
                        await pool.discover_now()
                    next_discover = time.monotonic() + self.cfg.discover_interval_s
                await asyncio.gather(*(pool.check_health(self.http, scrape_load=not self.redis_ok)
                                       for pool in self._pools()))
                self.hold.wake()        # held requests re-check: a backend may have healed
                await self.refresh_adapters()
                if self.vllm is not None:
                    await asyncio.to_thread(self.vllm.sync, self.pool)
                self._export_health()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad round
                logger.exception("health check round failed")
            await asyncio.sleep(self.cfg.health_interval_s)

    async def _load_loop(self) -> None:
        next_purge = 0.0
        while True:
            await asyncio.sleep(self.cfg.load_interval_s)
            await self.refresh_load()
            if self.redis_ok and time.monotonic() >= next_purge:
                next_purge = time.monotonic() + 5.0
                with suppress(Exception):
                    purged = await self.index.purge_dead_pods()
                    if purged:
                        logger.info("purged expired pods from the prefix index: %s", purged)

    async def refresh_adapters(self) -> None:
        """Read the healthy backends' `/v1/models` (their LoRA adapters). NOTE: with
        --api-key the router sends its own key: the engines are expected to accept it."""
        headers = {"authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        await self.adapters.refresh(self.http, self.pool.healthy(), headers,
                                    self.pool.health_timeout_s)

    async def refresh_load(self) -> None:
        if self.index is None:
            return
        try:
            pods = await asyncio.wait_for(self.index.live_pods(), self.cfg.heartbeat_timeout_s)
        except Exception as e:  # noqa: BLE001 - any Redis failure means: route by load
            self._set_redis(False, e)
            return
        for pool in self._pools():
            pool.apply_heartbeats(pods)
        self.metrics.duplicate_pod_ids.set(sum(len(p.duplicate_pod_ids) for p in self._pools()))
        self._set_redis(True)

    def _set_redis(self, ok: bool, error: Exception | None = None) -> None:
        if ok and not self.redis_ok and self._redis_warned:
            logger.info("Redis prefix index reachable again: kv-aware routing resumes")
            self._redis_warned = False
        if not ok and not self._redis_warned:
            logger.warning("Redis prefix index unreachable (%s: %s): routing by least load "
                           "until it returns", type(error).__name__, error)
            self._redis_warned = True
        self.redis_ok = ok
        self.metrics.redis_up.set(1 if ok else 0)

    def _export_health(self) -> None:
        g = self.metrics.backend_healthy
        for pool in self._pools():
            for b in pool.states():
                g.labels(b.url).set(1 if b.healthy else 0)

    # ---- one request -----------------------------------------------------------------------
    async def lookup(self, model: str, hashes: list[bytes]) -> tuple[dict[str, int], str]:
        """(prefix hits per pod, how the index answered: "ok", "down" or "slow").

        A lookup that only misses its deadline ("slow") falls back for this request alone: a
        burst on a busy event loop can delay a healthy Redis' reply, and that must not switch
        every other request to the fallback. Redis counts as down on a connection error, or when
        the heartbeat read (with its longer deadline) fails."""
        if self.index is None or not self.redis_ok:
            return {}, "down"
        if not hashes:
            return {}, "ok"
        t0 = time.perf_counter()
        try:
            hits = await asyncio.wait_for(self.index.lookup(model, hashes),
                                          self.cfg.lookup_timeout_s)
        except (TimeoutError, RedisTimeoutError):
            self.metrics.lookup_timeouts.inc()
            return {}, "slow"
        except Exception as e:  # noqa: BLE001 - any other Redis failure: route by load
            self._set_redis(False, e)
            return {}, "down"
        self.metrics.lookup_seconds.observe(time.perf_counter() - t0)
        return hits, "ok"

    async def proxy(self, request: Request, endpoint: str | None, path: str) -> Response:
        """Forward one POST to a backend chosen by the strategy. `endpoint` ("completion" or
        "chat") says how to read the prompt for kv-aware routing; None: no prompt to match."""
        arrived = time.monotonic()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_json(400, f"request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return error_json(400, "request body must be a JSON object")
        cfg = self.cfg
        model = body.get("model") if isinstance(body.get("model"), str) else None
        try:
            route = self.adapters.route(model, self.model_name, cfg.lora_load_on_demand)
        except UnknownModel as e:
            return error_json(404, str(e), "model_not_found", param="model")
        session_key = request.headers.get(cfg.session_header) if cfg.session_header else None
        hits: dict[str, int] = {}
        hashes: list[bytes] = []
        num_blocks = 0
        index = "ok"
        if cfg.strategy == "kv-aware" and not session_key and endpoint is not None:
            if len(raw) > _INLINE_TOKENIZE_BYTES:
                # NOTE: a long prompt would stall every other request on the event loop.
                ids = await asyncio.to_thread(prompt_token_ids, self.tokenizer, endpoint, body)
            else:
                ids = prompt_token_ids(self.tokenizer, endpoint, body)
            # NOTE: the engine derives the same salt from the same forwarded headers.
            salt = self.salt_from.salt(request.headers, body.get("cache_salt"))
            hashes = prompt_block_hashes(ids, cfg.block_size, cfg.hash_seed, salt,
                                         route.lora_name)
            num_blocks = len(hashes)
            hits, index = await self.lookup(route.index_model, hashes)
            if index != "ok":
                self.metrics.fallbacks.inc()
            else:
                hits = merge_hits(hits, self.recent.hits(hashes, time.monotonic()))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        stream = body.get("stream") is True
        strategy = cfg.strategy
        fallback_reason = "fallback-slow-lookup" if index == "slow" else "fallback-no-redis"
        handoff = None
        if self.disagg is not None and endpoint is not None:
            handoff = await self.disagg.prefill(request, body, headers, path, RoutingInputs(
                hits, hashes, num_blocks, index == "ok", fallback_reason, session_key))
            if isinstance(handoff, Response):
                return handoff
            # NOTE: the decode engine is chosen by load and free KV: the prompt's KV comes
            # with the request, so its own prefix hits matter little
            raw, strategy, hits, num_blocks = handoff.raw, "least-loaded", {}, 0
        tried: set[str] = set()
        while True:
            candidates = [b for b in self.pool.states() if b.url not in tried
                          and (route.holders is None or b.url in route.holders)]
            decision = choose(candidates, hits, num_blocks, strategy, next(self.rr),
                              self.rng, session_key, index == "ok", cfg.policy,
                              fallback_reason)
            if decision is None:
                if route.holders is not None and self.pool.healthy():
                    # the adapter's holders failed: the healthy backends cannot serve it
                    return _no_backend(route)
                held = await self.hold.wait(request, lambda: bool(self.pool.healthy()), arrived)
                if held is not None:
                    return held
                # NOTE: a backend tried before the hold provably never ran this request (see
                # _NEVER_SENT, _LOST_WITH_PROCESS): once healed it may take it.
                tried.clear()
                continue
            b = decision.backend
            if hashes and b.pod_id is not None:
                self.recent.record(b.pod_id, hashes, time.monotonic())
            b.in_flight += 1
            req = self.http.build_request("POST", b.url + path, content=raw, headers=headers)
            try:
                if stream:
                    resp = await self.http.send(req, stream=True)
                else:
                    resp = await until_disconnect(request, self._send_and_read(req), _DISCONNECT_POLL_S)
            except _NEVER_SENT as e:
                b.in_flight -= 1
                tried.add(b.url)
                self._backend_failed(b, e)
                if len(tried) > _MAX_RETRIES and self.pool.healthy():
                    return error_json(502, f"could not connect to a backend ({len(tried)} "
                                      f"tried; last: {type(e).__name__})", "backend_unreachable")
                self.metrics.retries.inc()
                continue
            except ClientDisconnected:
                b.in_flight -= 1
                self.metrics.client_disconnects.inc()
                return Response(status_code=499)
            except httpx.HTTPError as e:
                b.in_flight -= 1
                self._backend_failed(b, e)
                # NOTE: the request may have reached the backend: re-sent only when the backend's
                # process is provably gone, and the request with it (see _LOST_WITH_PROCESS).
                if (isinstance(e, _LOST_WITH_PROCESS) and len(tried) < _MAX_RETRIES
                        and await process_gone(b.url, self.cfg.connect_timeout_s)):
                    logger.warning("backend %s died holding a request (%s; it now refuses "
                                   "connections): re-sending it to another backend", b.url,
                                   type(e).__name__)
                    tried.add(b.url)
                    self.metrics.retries.inc()
                    continue
                logger.warning("backend %s failed before answering (%s): not re-sent (it may "
                               "still run the request)", b.url, type(e).__name__)
                return error_json(502, f"backend {b.url} failed before answering "
                                  f"({type(e).__name__}); the request was not retried "
                                  "because the backend may have received it", "backend_failed")
            except BaseException:
                b.in_flight -= 1
                raise
            break
        self.metrics.decisions.labels(decision.reason).inc()
        self.metrics.prefix_hit_blocks.observe(decision.prefix_blocks)
        out_headers = {k: resp.headers[k] for k in _PASS_BACK if k in resp.headers}
        if cfg.expose_route_headers:
            # NOTE: off by default: they tell any client which pod holds which prefix.
            out_headers["x-kvmesh-backend"] = b.url
            out_headers["x-kvmesh-route-reason"] = decision.reason
            if handoff is not None and handoff.prefill_backend is not None:
                out_headers["x-kvmesh-prefill-backend"] = handoff.prefill_backend
        if stream and resp.status_code == 200:
            done = _Release(resp, b)
            # NOTE: the background task releases the backend even if the client disconnects
            # before the body generator ever starts (its `finally` would never run).
            return StreamingResponse(self._relay(resp, b, done), status_code=resp.status_code,
                                     headers=out_headers, background=BackgroundTask(done))
        try:
            content = resp.content if not stream else await resp.aread()
        except httpx.HTTPError as e:
            return error_json(502, f"backend {b.url} failed mid-response: {e}",
                              "backend_failed")
        finally:
            await resp.aclose()
            b.in_flight -= 1
        return Response(content, status_code=resp.status_code, headers=out_headers)

    async def _send_and_read(self, req: httpx.Request) -> httpx.Response:
        """A non-streaming exchange, body read (so a client disconnect can cancel all of it)."""
        resp = await self.http.send(req, stream=True)
        try:
            await resp.aread()
        except BaseException:
            await resp.aclose()
            raise
        return resp

    def _backend_failed(self, b: BackendState, error: Exception) -> None:
        self.pool.mark_unhealthy(b.url, f"{type(error).__name__}: {error}")
        self._export_health()

    async def _relay(self, resp: httpx.Response, b: BackendState, done: _Release):
        """The backend's bytes, chunk by chunk, as they arrive. NOTE: if the backend dies
        mid-stream, the client is told in the stream (an OpenAI-style error event, then [DONE],
        as an engine does when it fails) instead of getting a silently truncated answer."""
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            logger.warning("stream from %s broke: %s", b.url, e)
            self._backend_failed(b, e)
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                body = error_body(502, f"backend {b.url} failed mid-stream "
                                  f"({type(e).__name__}); the answer is incomplete",
                                  "backend_failed")
                # the blank line first ends any event the backend left half-written
                yield f"\n\ndata: {json.dumps(body, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()
        finally:
            await done()

    async def models(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        seen: dict[str, dict] = {}
        last_error: Response | None = None
        for b in self.pool.healthy():
            try:
                r = await self.http.get(f"{b.url}/v1/models", headers=headers, timeout=5.0)
            except httpx.HTTPError as e:
                self.pool.mark_unhealthy(b.url, f"{type(e).__name__}: {e}")
                continue
            if r.status_code != 200:
                last_error = Response(r.content, status_code=r.status_code,
                                      media_type=r.headers.get("content-type"))
                continue
            for m in r.json().get("data", []):
                seen.setdefault(m.get("id"), m)
        if not seen:
            return last_error or error_json(503, "no healthy backend answered /v1/models",
                                            "no_healthy_backend")
        return JSONResponse({"object": "list", "data": list(seen.values())})


def _no_backend(route: AdapterRoute) -> Response:
    if route.holders is not None:
        return error_json(503, f"no healthy backend holds the LoRA adapter `{route.lora_name}`",
                          "no_healthy_backend")
    return error_json(503, "no healthy backend to serve the request", "no_healthy_backend")


def create_app(cfg: RouterConfig, tokenizer=None, model_name: str | None = None) -> FastAPI:
    """The router app; `tokenizer` (an engine `Tokenizer`) enables prefix-aware routing."""
    state = RouterState(cfg, tokenizer, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="kvmesh router", lifespan=lifespan)
    app.state.router = state

    def unauthorized(request: Request) -> Response | None:
        if not cfg.api_key:
            return None
        return check_bearer(request.headers.get("authorization", ""), cfg.api_key)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return unauthorized(request) or await state.proxy(request, "completion",
                                                          "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return unauthorized(request) or await state.proxy(request, "chat",
                                                          "/v1/chat/completions")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        # NOTE: an embedding request keeps no KV on the engine: no prefix to match, by load.
        return unauthorized(request) or await state.proxy(request, None, "/v1/embeddings")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return unauthorized(request) or await state.proxy(request, None, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return unauthorized(request) or await state.proxy(request, None, "/detokenize")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return unauthorized(request) or await state.models(request)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        n = len(state.pool.healthy())
        # NOTE: a router that holds requests (scale to zero) is ready with no engine: it must
        # stay behind its Service to take the requests that wake the engines.
        ok = n > 0 or state.hold.enabled
        body = {"ready": ok, "healthy_backends": n, "backends": len(state.pool.backends),
                "redis": state.redis_ok, "held_requests": state.hold.held}
        if state.disagg is not None:
            # NOTE: ready without a prefill engine: the decode engines then prefill themselves
            body["healthy_prefill_backends"] = len(state.disagg.pool.healthy())
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        state._export_health()
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
