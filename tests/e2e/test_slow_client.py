"""A client that stops reading its stream: the server's memory stays bounded, the request is
aborted, and the stream ends with an OpenAI-style `client_too_slow` error event, then [DONE].

The app is driven in-process through ASGI, with a `send` that blocks like a client that reads
nothing (over a real socket, the kernel's buffers would take megabytes first)."""
from __future__ import annotations

import asyncio
import json
import re

import pytest

from kvmesh.api.app import ServerState, create_app
from kvmesh.common.config import EngineConfig
from kvmesh.engine.async_engine import AsyncLLMEngine
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.limits import RequestLimits


def _scope(path: str, body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
], ids=["completions", "chat"])
async def test_a_client_that_stops_reading_is_aborted_with_client_too_slow(smollm, path, body):
    llm = LLMEngine(EngineConfig(num_kv_blocks=32, max_model_len=256), loaded=smollm)
    limits = RequestLimits(max_pending_outputs=3)
    engine = AsyncLLMEngine(llm, limits=limits)
    engine.start()
    app = create_app(ServerState(engine=engine, model_name="m", max_model_len=256, ready=True,
                                 limits=limits))
    raw = json.dumps({**body, "max_tokens": 60, "ignore_eos": True, "temperature": 0,
                      "stream": True}).encode()
    requested, gone, resume = False, asyncio.Event(), asyncio.Event()
    chunks: list[bytes] = []

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if len(chunks) == 1:
                await resume.wait()          # the client reads its first chunk, then nothing

    try:
        serving = asyncio.create_task(app(_scope(path, raw), receive, send))
        sizes = []
        async with asyncio.timeout(300):
            while not chunks:
                await asyncio.sleep(0.01)
            while llm.has_unfinished_requests():          # until the engine aborted it
                sizes.append(max((s.queue.qsize() for s in engine._streams.values()), default=0))
                await asyncio.sleep(0.005)
            assert max(sizes) <= 3 and llm.kv_manager.num_free_blocks == 32
            resume.set()
            await serving
    finally:
        gone.set()
        engine.shutdown()
    events = [e.removeprefix("data: ") for e in b"".join(chunks).decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert re.fullmatch(r"the client fell 3 outputs behind the generation of request "
                        r"'(cmpl|chatcmpl)-[0-9a-f]{32}(-0)?', which was aborted; read the "
                        r"stream as it arrives", error.pop("message"))
    assert error == {"type": "invalid_request_error", "param": None, "code": "client_too_slow"}
    tokens = sum(1 for e in events[:-2] if '"finish_reason":null' in e)
    assert tokens < 60                       # aborted well before the end
    assert engine.num_in_flight == 0
