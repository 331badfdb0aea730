"""The producer's bootstrap side channel (`remote_bootstrap_addr`): a small HTTP server where a
consumer asks for a transfer's blocks and the cache layout, and says when it has read them.

    GET  /query?transfer_id=T  200 {"engine_id", "rpc_addr", "layout", "block_ids", "block_hashes"}
                               404 when T is not pinned here (never was, read, or timed out)
    POST /done?transfer_id=T   200 {"released": true|false}

NOTE: stdlib's ThreadingHTTPServer on its own threads: a slow or stuck consumer never holds
the engine thread, which only reads what the handlers queued (PinTable). A consumer passes the
one `httpx.Client` it keeps: a new client per call (`httpx.get`) built a TLS context each time,
~100 ms of CPU per call on a loaded core, far more than the KV read itself.
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import httpx

from kvmesh.engine.kv_transfer.pins import PinTable

logger = logging.getLogger("kvmesh.engine.kv_transfer")


class SideChannelError(RuntimeError):
    """The producer's side channel did not answer, or not as expected."""


class SideChannel:
    def __init__(self, host: str, port: int, pins: PinTable,
                 describe: Callable[[], dict]) -> None:
        """`describe()`: engine_id, rpc_addr and layout (the same for every transfer)."""
        channel = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                channel._handle(self, "GET")

            def do_POST(self) -> None:  # noqa: N802
                channel._handle(self, "POST")

            def log_message(self, *args) -> None:   # NOTE: no stderr line per request
                pass

        self.pins = pins
        self._describe = describe
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="kv-transfer-side-channel", daemon=True)
        self._thread.start()

    @property
    def addr(self) -> str:
        """remote_bootstrap_addr, as vLLM writes it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(h.path)
        tid = (parse_qs(url.query).get("transfer_id") or [""])[0]
        if method == "GET" and url.path == "/query":
            pin = self.pins.get(tid)
            if pin is None:
                return _reply(h, 404, {"error": f"transfer {tid!r} is not pinned here"})
            return _reply(h, 200, {**self._describe(), "block_ids": list(pin.block_ids),
                                   "block_hashes": list(pin.block_hashes)})
        if method == "POST" and url.path == "/done":
            return _reply(h, 200, {"released": self.pins.mark_read(tid)})
        _reply(h, 404, {"error": f"no {method} {url.path}"})

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _reply(h: BaseHTTPRequestHandler, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def query(http: httpx.Client, bootstrap_addr: str, transfer_id: str, timeout_s: float) -> dict:
    """The producer's answer to /query; SideChannelError when it has none."""
    try:
        r = http.get(f"{bootstrap_addr}/query", params={"transfer_id": transfer_id},
                     timeout=timeout_s)
    except httpx.HTTPError as e:
        raise SideChannelError(f"{bootstrap_addr} did not answer: {e!r}") from None
    if r.status_code != 200:
        raise SideChannelError(f"{bootstrap_addr}/query: {r.status_code} {r.text[:200]}")
    return r.json()


def notify_done(http: httpx.Client, bootstrap_addr: str, transfer_id: str, timeout_s: float) -> bool:
    """Tell the producer it may free the transfer's blocks; False when it could not be told
    (its pin then times out there)."""
    try:
        r = http.post(f"{bootstrap_addr}/done", params={"transfer_id": transfer_id},
                      timeout=timeout_s)
        return r.status_code == 200
    except httpx.HTTPError:
        return False
