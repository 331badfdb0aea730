"""A tiny fake OpenAI engine: records what it gets, streams SSE, reports load, fails on demand."""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def make_fake_backend(name: str, chunks: int = 3, chunk_delay_s: float = 0.0) -> FastAPI:
    app = FastAPI()
    app.state.name = name
    app.state.requests = []            # (path, body) in arrival order
    app.state.authorization = []       # each request's Authorization header (None: absent)
    app.state.peers = []               # each request's client (host, port): its TCP connection
    app.state.delay_s = 0.0            # before answering
    app.state.die_after_chunks = None  # streams: the connection breaks after this many chunks
    app.state.disconnects = []         # bodies of requests whose client left during the delay
    app.state.load = (0, 0, 0.0)       # running, waiting, kv usage for /metrics
    app.state.chunks = chunks
    app.state.chunk_delay_s = chunk_delay_s

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        r, w, kv = app.state.load
        return Response(f"kvmesh:num_requests_running{{model_name=\"m\"}} {r}\n"
                        f"kvmesh:num_requests_waiting{{model_name=\"m\"}} {w}\n"
                        f"kvmesh:gpu_cache_usage_perc{{model_name=\"m\"}} {kv}\n",
                        media_type="text/plain")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                            "owned_by": "kvmesh"}]}

    async def handle(request: Request, kind: str):
        body = await request.json()
        app.state.requests.append((request.url.path, body))
        app.state.authorization.append(request.headers.get("authorization"))
        app.state.peers.append((request.client.host, request.client.port))
        if app.state.delay_s:
            # like the engine: while it works, notice a client (the router) that went away
            deadline = time.monotonic() + app.state.delay_s
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    app.state.disconnects.append(body)
                    return Response(status_code=499)
                await asyncio.sleep(0.05)
        if body.get("model") != "m":
            return JSONResponse({"error": {"message": f"The model `{body.get('model')}` does "
                                           "not exist.", "type": "NotFoundError", "param": None,
                                           "code": 404}}, status_code=404)
        if body.get("max_tokens", 1) < 1:
            return JSONResponse({"error": {"message": "max_tokens must be at least 1",
                                           "type": "BadRequestError", "param": "max_tokens",
                                           "code": 400}}, status_code=400)
        created = int(time.time())
        if body.get("stream"):
            async def sse():
                for i in range(app.state.chunks):
                    if i == app.state.die_after_chunks:
                        raise RuntimeError("the fake backend dies mid-stream")
                    if kind == "chat":
                        choice = {"index": 0, "delta": {"content": f"{name}-{i} "},
                                  "finish_reason": None}
                        obj = "chat.completion.chunk"
                    else:
                        choice = {"index": 0, "text": f"{name}-{i} ", "finish_reason": None}
                        obj = "text_completion"
                    chunk = {"id": "x", "object": obj, "created": created, "model": "m",
                             "choices": [choice]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    if app.state.chunk_delay_s:
                        await asyncio.sleep(app.state.chunk_delay_s)
                yield b"data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")
        if kind == "chat":
            return {"id": "x", "object": "chat.completion", "created": created, "model": "m",
                    "choices": [{"index": 0, "finish_reason": "stop", "message": {
                        "role": "assistant", "content": name}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        return {"id": "x", "object": "text_completion", "created": created, "model": "m",
                "choices": [{"index": 0, "text": name, "finish_reason": "stop",
                             "logprobs": None}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat")

    return app
