"""An HTTP relay on loopback in front of a real server that records the JSON bodies it carries.

Not a mock: every request goes on to the real server and its answer comes back unchanged
(streamed as it arrives). A test reads `exchanges` to see exactly what a router sent an engine
and what the engine answered (a non-streamed JSON answer is recorded; a stream is not)."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from processes import free_port

_HOP = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


@dataclass
class Exchange:
    path: str
    body: Any                   # the request's JSON body
    status: int | None = None   # the server's status
    answer: Any = None          # the server's JSON answer (None when streamed)


def relay_app(target: str, exchanges: list[Exchange]):
    """An ASGI app forwarding everything to `target` (a base URL)."""
    app = FastAPI()
    client = httpx.AsyncClient(base_url=target, timeout=httpx.Timeout(None))

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def relay(path: str, request: Request):
        raw = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        ex = None
        if request.method == "POST":
            ex = Exchange("/" + path, json.loads(raw) if raw else None)
            exchanges.append(ex)
        resp = await client.send(client.build_request(request.method, "/" + path, content=raw,
                                                      headers=headers), stream=True)
        out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
        if ex is not None:
            ex.status = resp.status_code
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            async def body():
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()
            return StreamingResponse(body(), status_code=resp.status_code, headers=out)
        content = await resp.aread()
        await resp.aclose()
        if ex is not None and resp.headers.get("content-type", "").startswith("application/json"):
            ex.answer = json.loads(content)
        return Response(content, status_code=resp.status_code, headers=out)

    return app


class RecordingRelay:
    """`relay.url` -> `target`, in a daemon thread; `relay.posts(path)` the recorded exchanges."""

    def __init__(self, target: str, port: int | None = None) -> None:
        import uvicorn
        self.target = target
        self.exchanges: list[Exchange] = []
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(relay_app(target, self.exchanges),
                                                    host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the relay did not start")
            time.sleep(0.01)

    def posts(self, path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.path == path]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
