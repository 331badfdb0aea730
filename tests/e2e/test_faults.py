"""Fault injection over real processes (issue 12): what a client sees when a part of the stack
dies, and what is left behind. Each case records what it injected and what it observed in
docs/RELIABILITY.md.

One routed cluster (redis-server, engines pod-0 and pod-1, a router) and one cluster whose Redis
is a blackhole (a TCP listener that accepts and never answers; one engine and a router) start
together, once. The cases run in file order; a case that kills an engine starts it again on the
same port, so the next case finds the cluster whole. After every case the live engines' /metrics
say no request is running or waiting and the KV cache is back to its idle usage.

Nothing here depends on speed: requests that must be in flight when a fault lands ask for many
tokens (ignore_eos) and the fault is injected when a condition (a streamed chunk, a running
request on the engine's /metrics) says so; every wait has a generous deadline.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from processes import RedisServer, free_port
from waiting import wait_until

from .router_fixtures import MODEL, Proc, _spawn, _wait_ready, metric_sum, scrape

ENGINE_ARGS = ("--num-kv-blocks", "64", "--max-model-len", "512", "--max-num-seqs", "8",
               "--log-level", "warning")
LONG = 400               # tokens a request asks for when it must still be running at the fault
SHORT = 4                # tokens of the requests that must complete
HANG = 60.0              # a client still waiting this long after a fault is hung
RERUN = 300.0            # ... unless its LONG request runs again from the start on the survivor


class Blackhole:
    """A TCP listener that accepts every connection and never answers (a Redis behind a
    dropped network path): clients connect, then time out reading."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        self.accepted: list[socket.socket] = []
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted.append(conn)       # held open, never read, never answered

    def close(self) -> None:
        self._stop = True
        self.thread.join(2)
        for c in self.accepted:
            c.close()
        self.sock.close()


@dataclass
class Stack:
    """Engines and a router over one Redis URL; engines restart on their own port."""
    redis_url: str
    engines: list[Proc]
    router: Proc
    log_dir: Path
    engine_argv: dict[str, list[str]] = field(default_factory=dict)
    router_argv: list[str] = field(default_factory=list)
    idle_kv: dict[str, float] = field(default_factory=dict)
    redis: RedisServer | None = None      # the real redis-server (None: the blackhole's stack)

    def live(self) -> list[Proc]:
        return [e for e in self.engines if e.alive()]

    def by_url(self, url: str) -> Proc:
        return next(e for e in self.engines if e.url == url.rstrip("/"))

    def restart_engine(self, e: Proc) -> Proc:
        """SIGKILLed `e` comes back on its port, with its pod id; the router sees it healthy."""
        assert not e.alive()
        port = int(e.url.rsplit(":", 1)[1])
        new = _spawn(e.name, self.engine_argv[e.name], port, self.log_dir / "restarts", 1)
        _wait_ready([new], 240.0)
        self.engines[self.engines.index(e)] = new
        assert wait_until(lambda: router_metric(self, "kvmesh_router_backend_healthy",
                                                backend=new.url) == 1, timeout=30, interval=0.1)
        return new

    def restart_router(self) -> None:
        assert not self.router.alive()
        port = int(self.router.url.rsplit(":", 1)[1])
        self.router = _spawn("router", self.router_argv, port, self.log_dir / "restarts", None)


def _start_stack(log_dir: Path, redis_url: str, names: list[str]) -> Stack:
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "restarts").mkdir(exist_ok=True)
    engines, argv = [], {}
    for name in names:
        port = free_port()
        argv[name] = ["serve", "--host", "127.0.0.1", "--port", str(port), "--redis-url",
                      redis_url, "--pod-id", name, "--advertise-url", f"http://127.0.0.1:{port}",
                      *ENGINE_ARGS]
        engines.append(_spawn(name, argv[name], port, log_dir, 1))
    rport = free_port()
    rargv = ["router", "--host", "127.0.0.1", "--port", str(rport), "--redis-url", redis_url,
             "--backends", *[e.url for e in engines], "--strategy", "kv-aware",
             "--lookup-timeout", "2", "--expose-route-headers", "--log-level", "warning"]
    router = _spawn("router", rargv, rport, log_dir, None)
    return Stack(redis_url, engines, router, log_dir, argv, rargv)


def _stop_stack(stack: Stack) -> list[int | None]:
    procs = [stack.router, *stack.engines]
    for p in procs:
        if p.alive():
            p.proc.terminate()
    return [p.wait(30) for p in procs]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    """(the Redis stack, the blackholed stack), started together and ready."""
    root = tmp_path_factory.mktemp("faults")
    redis = RedisServer()
    redis.start()
    hole = Blackhole()
    main = _start_stack(root / "main", redis.url, ["pod-0", "pod-1"])
    holed = _start_stack(root / "blackhole", hole.url, ["pod-h"])
    main.redis = redis
    try:
        _wait_ready([*main.engines, main.router, *holed.engines, holed.router], 300.0)
        for s in (main, holed):
            s.idle_kv = {e.url: kv_usage(e) for e in s.engines}
        yield main, holed
    finally:
        codes = _stop_stack(main) + _stop_stack(holed)
        redis.stop()
        hole.close()
    # a clean SIGTERM exits 0, Redis or no Redis (the blackhole included)
    assert codes == [0] * len(codes), codes


@pytest.fixture(scope="module")
def stack(stacks) -> Stack:
    return stacks[0]


@pytest.fixture(scope="module")
def observed() -> dict:
    """What one case saw, for a case that only judges it (no second fault injected)."""
    return {}


# ---- metrics -----------------------------------------------------------------------------------
def engine_metric(e: Proc, name: str) -> float:
    return metric_sum(scrape(e.url), name)


def kv_usage(e: Proc) -> float:
    return engine_metric(e, "kvmesh:kv_cache_usage_perc")


def aborted(e: Proc) -> float:
    return metric_sum(scrape(e.url), "kvmesh:request_success_total", finished_reason="abort")


def router_metric(stack: Stack, name: str, **labels: str) -> float:
    return metric_sum(scrape(stack.router.url), name, **labels)


def in_flight(e: Proc) -> float:
    text = scrape(e.url)
    return (metric_sum(text, "kvmesh:num_requests_running")
            + metric_sum(text, "kvmesh:num_requests_waiting"))


def assert_idle(stack: Stack) -> None:
    """No request stuck and no KV block leaked on any live engine (within a deadline)."""
    for e in stack.live():
        ok = wait_until(lambda: in_flight(e) == 0 and kv_usage(e) == stack.idle_kv[e.url],
                        timeout=60, interval=0.2)
        assert ok, (e.name, scrape(e.url)[-2000:])
        assert metric_sum(scrape(e.url), "kvmesh:num_requests_swapped") == 0


# ---- clients -----------------------------------------------------------------------------------
@dataclass
class Outcome:
    status: int | None = None
    backend: str | None = None
    events: list[dict] = field(default_factory=list)
    done: bool = False                 # saw `data: [DONE]`
    body: dict | None = None
    error: str | None = None           # a transport error the client got
    finished_at: float | None = None
    first_chunk: threading.Event = field(default_factory=threading.Event)


def _body(max_tokens: int, stream: bool, prompt: str = "Tell me a long story about a cat.") -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": stream}


def request(url: str, max_tokens: int, stream: bool, out: Outcome | None = None,
            prompt: str = "Tell me a long story about a cat.", read_timeout: float = HANG) -> Outcome:
    """One completion; a client with a generous read timeout (a hang shows as HANG s)."""
    out = out or Outcome()
    timeout = httpx.Timeout(10.0, read=read_timeout)
    try:
        if stream:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=timeout,
                              json=_body(max_tokens, True, prompt)) as r:
                out.status, out.backend = r.status_code, r.headers.get("x-kvmesh-backend")
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        out.done = True
                    elif line.startswith("data: "):
                        out.events.append(json.loads(line[6:]))
                        out.first_chunk.set()
        else:
            r = httpx.post(f"{url}/v1/completions", json=_body(max_tokens, False, prompt),
                           timeout=timeout)
            out.status, out.backend = r.status_code, r.headers.get("x-kvmesh-backend")
            out.body = r.json()
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.finished_at = time.monotonic()
    return out


def in_thread(fn, *args, **kw) -> tuple[threading.Thread, Outcome]:
    out = Outcome()
    t = threading.Thread(target=fn, args=args, kwargs={**kw, "out": out}, daemon=True)
    t.start()
    return t, out


def completed(o: Outcome, max_tokens: int = SHORT) -> bool:
    if o.status != 200 or o.error:
        return False
    if o.body is not None:
        return o.body["usage"]["completion_tokens"] == max_tokens
    return o.done and [e["choices"][0]["finish_reason"] for e in o.events
                       if e.get("choices")][-1:] == ["length"]


def serves(url: str, n: int = 2) -> list[Outcome]:
    """n short requests, streamed and not, one after the other; all must complete."""
    outs = [request(url, SHORT, stream=bool(i % 2)) for i in range(n)]
    assert all(completed(o) for o in outs), outs
    return outs


def running_on(stack: Stack) -> Proc | None:
    return next((e for e in stack.live() if in_flight(e) > 0), None)


# ---- cases -------------------------------------------------------------------------------------
def test_backend_killed_mid_stream_ends_the_stream_and_the_survivor_serves(stack, observed):
    assert_idle(stack)
    t, out = in_thread(request, stack.router.url, LONG, True)
    assert out.first_chunk.wait(HANG), out
    victim = stack.by_url(out.backend)
    victim.kill()
    killed_at = time.monotonic()
    t.join(HANG + 15)
    assert not t.is_alive() and out.finished_at - killed_at < HANG, "the client hung"
    # the stream ended early: some tokens, no finish_reason, then one OpenAI-style error event
    # from the router (not a silently truncated answer) and [DONE]
    assert out.status == 200 and out.events and out.done
    assert all(e["choices"][0]["finish_reason"] is None for e in out.events if e.get("choices"))
    assert out.events[-1]["error"]["code"] == "backend_failed", out.events[-1]
    assert all("error" not in e for e in out.events[:-1])
    # the router routes around the dead backend at once
    after = serves(stack.router.url, 4)
    assert {o.backend for o in after} == {e.url for e in stack.live()}
    assert router_metric(stack, "kvmesh_router_backend_healthy", backend=victim.url) == 0
    assert_idle(stack)
    stack.restart_engine(victim)
    serves(victim.url, 1)
    assert_idle(stack)


def test_backend_killed_mid_non_stream_is_answered_once_by_the_survivor(stack):
    """The request died with the victim's process (its port now refuses connections): the router
    sends it once to the survivor, which runs it once; the client gets one whole answer."""
    assert_idle(stack)
    # NOTE: the survivor generates all LONG tokens again: on a busy CPU that may take longer than
    # HANG, so this client waits RERUN s for its answer
    t, out = in_thread(request, stack.router.url, LONG, False, read_timeout=RERUN)
    assert wait_until(lambda: running_on(stack) is not None, timeout=HANG, interval=0.1)
    victim = running_on(stack)
    survivor = next(e for e in stack.live() if e is not victim)
    before = metric_sum(scrape(survivor.url), "kvmesh:request_success_total")
    victim.kill()
    killed_at = time.monotonic()
    t.join(RERUN + 15)
    assert not t.is_alive() and out.finished_at - killed_at < RERUN, "the client hung"
    assert out.error is None and out.status == 200 and completed(out, LONG), out
    assert out.backend == survivor.url
    assert metric_sum(scrape(survivor.url), "kvmesh:request_success_total") - before == 1
    assert router_metric(stack, "kvmesh_router_retries_total") >= 1
    after = serves(stack.router.url, 4)
    assert {o.backend for o in after} == {e.url for e in stack.live()}
    assert_idle(stack)
    stack.restart_engine(victim)
    assert_idle(stack)


def test_an_engine_killed_while_holding_requests_fails_them_and_its_restart_serves(stack):
    assert_idle(stack)
    victim = stack.engines[0]
    # 4 clients on the engine itself (2 streaming, 2 not) and 2 through the router
    direct = [in_thread(request, victim.url, LONG, bool(i % 2), prompt=f"Story {i}: a cat")
              for i in range(4)]
    assert wait_until(lambda: in_flight(victim) >= 4, timeout=HANG, interval=0.1)
    assert all(out.first_chunk.wait(HANG) for _, out in direct[1::2])
    victim.kill()
    killed_at = time.monotonic()
    for t, _ in direct:
        t.join(HANG + 15)
    outs = [o for _, o in direct]
    assert all(o.finished_at - killed_at < HANG for o in outs), "a client hung"
    # non-streaming clients get a transport error; streaming ones a stream cut mid-way
    for o in outs[0::2]:
        assert o.error is not None and o.body is None, o
    for o in outs[1::2]:
        assert (o.error is not None or not o.done) and o.events, o
    # the other engine was untouched and the router serves from it meanwhile
    serves(stack.router.url, 2)
    assert_idle(stack)
    new = stack.restart_engine(victim)
    serves(new.url, 2)
    assert_idle(stack)


def test_redis_killed_requests_still_complete(stack):
    assert_idle(stack)
    redis = stack.redis
    redis.stop()
    try:
        outs = serves(stack.router.url, 4)
        assert wait_until(lambda: router_metric(stack, "kvmesh_router_redis_up") == 0,
                          timeout=15, interval=0.1)
        outs += serves(stack.router.url, 4)
        assert {o.backend for o in outs} == {e.url for e in stack.engines}
        for e in stack.engines:
            assert wait_until(lambda: engine_metric(e, "kvmesh:kv_index_connected") == 0,
                              timeout=15, interval=0.1)
        assert router_metric(stack, "kvmesh_router_fallbacks_total") >= 1
    finally:
        redis.start()
    assert wait_until(lambda: router_metric(stack, "kvmesh_router_redis_up") == 1, timeout=30,
                      interval=0.1)
    for e in stack.engines:
        assert wait_until(lambda: engine_metric(e, "kvmesh:kv_index_connected") == 1,
                          timeout=30, interval=0.1)
    serves(stack.router.url, 2)
    assert_idle(stack)


def test_redis_blackholed_requests_still_complete(stacks):
    _, holed = stacks
    assert_idle(holed)
    t0 = time.monotonic()
    outs = serves(holed.router.url, 4)
    # the router never got an answer from its Redis: it routes by load, and says so
    assert router_metric(holed, "kvmesh_router_redis_up") == 0
    assert router_metric(holed, "kvmesh_router_decisions_total", reason="fallback-no-redis") \
        + router_metric(holed, "kvmesh_router_decisions_total", reason="fallback-slow-lookup") \
        >= len(outs)
    assert engine_metric(holed.engines[0], "kvmesh:kv_index_connected") == 0
    assert engine_metric(holed.engines[0], "kvmesh:kv_index_redis_errors_total") >= 1
    assert time.monotonic() - t0 < 4 * HANG
    assert_idle(holed)


def test_router_restarted_clients_retry_and_succeed(stack):
    assert_idle(stack)
    aborts = {e.url: aborted(e) for e in stack.engines}
    t, out = in_thread(request, stack.router.url, LONG, True)
    assert out.first_chunk.wait(HANG), out
    backend = stack.by_url(out.backend)
    stack.router.kill()
    killed_at = time.monotonic()
    t.join(HANG + 15)
    assert not t.is_alive() and out.finished_at - killed_at < HANG, "the client hung"
    assert out.error is not None or not out.done, out       # cut, and it can tell
    # the engine saw its client (the router) go: the request was aborted, its blocks freed
    assert_idle(stack)
    assert {e.url: aborted(e) for e in stack.engines} == \
        {u: n + (u == backend.url) for u, n in aborts.items()}
    # while the router is down a client gets connection errors; it retries until one succeeds
    stack.restart_router()
    attempts, outcome = 0, None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        attempts += 1
        outcome = request(stack.router.url, SHORT, stream=False)
        if outcome.error is None and outcome.status != 503:
            break
        time.sleep(0.5)     # NOTE: a client's retry back-off, not a synchronisation
    assert outcome is not None and completed(outcome), (attempts, outcome, stack.router.log())
    assert attempts >= 1
    serves(stack.router.url, 2)
    assert_idle(stack)
