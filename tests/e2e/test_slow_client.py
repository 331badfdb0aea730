"""A client that stops reading its stream: the server's memory stays bounded, the request is
aborted, and the stream ends with an OpenAI-style `client_too_slow` error event, then [DONE].
A non-streaming answer never overflows its queue, and a failure mid-stream is an error event.

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


def _serve(smollm, limits: RequestLimits):
    llm = LLMEngine(EngineConfig(num_kv_blocks=32, max_model_len=256), loaded=smollm)
    engine = AsyncLLMEngine(llm, limits=limits)
    engine.start()
    app = create_app(ServerState(engine=engine, model_name="m", max_model_len=256, ready=True,
                                 limits=limits))
    return llm, engine, app


async def _call(app, path: str, body: dict, while_running=None) -> tuple[int, bytes]:
    """POST through the ASGI app; `while_running()` runs on the loop once the request is in."""
    raw = json.dumps(body).encode()
    sent, status, chunks, done = False, [], [], asyncio.Event()

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()                            # the client stays until the answer ends
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    task = asyncio.create_task(app(_scope(path, raw), receive, send))
    try:
        if while_running is not None:
            await while_running()
        async with asyncio.timeout(300):
            await task
    finally:
        done.set()
    return status[0], b"".join(chunks)


async def test_a_non_streaming_answer_never_overflows_its_output_queue(smollm):
    """The event loop stalls (a long tokenization, say) while a non-streaming request generates:
    its stream carries the final output alone, so it answers 200 in full, not ClientTooSlowError
    (with every step's output queued, 60 outputs would overflow a bound of 2: a 500)."""
    import time

    llm, engine, app = _serve(smollm, RequestLimits(max_pending_outputs=2))

    async def stall_the_loop():
        while not llm.scheduler.requests:
            await asyncio.sleep(0.01)
        (req,) = llm.scheduler.requests.values()
        while req.num_output_tokens < 20 and not req.is_finished:
            time.sleep(0.01)  # noqa: ASYNC251 - NOTE: blocks the loop; the engine thread goes on
    try:
        status, body = await _call(app, "/v1/completions",
                                   {"prompt": "Hi", "max_tokens": 60, "ignore_eos": True,
                                    "temperature": 0}, stall_the_loop)
    finally:
        engine.shutdown()
    answer = json.loads(body)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 60
    assert answer["choices"][0]["finish_reason"] == "length"
    assert llm.kv_manager.num_free_blocks == 32


async def test_a_failure_mid_stream_ends_it_with_an_error_event_and_frees_the_request(
        smollm, monkeypatch):
    """A bug after the 200 (injected: building the logprobs of a chunk raises) is told in the
    stream, one OpenAI-style error event then [DONE], and the request is aborted."""
    from kvmesh.api import serving_completions

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")
    monkeypatch.setattr(serving_completions, "completion_logprobs", broken)
    llm, engine, app = _serve(smollm, RequestLimits())
    try:
        status, body = await _call(app, "/v1/completions",
                                   {"prompt": "Hi", "max_tokens": 40, "ignore_eos": True,
                                    "logprobs": 1, "stream": True})
        async with asyncio.timeout(60):                  # the abort reaches the engine thread
            while llm.has_unfinished_requests() or engine._commands.qsize():
                await asyncio.sleep(0.01)
        assert llm.kv_manager.num_free_blocks == 32 and engine.num_in_flight == 0
    finally:
        engine.shutdown()
    events = [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {"error": {
        "message": "internal server error while streaming the response",
        "type": "internal_server_error", "param": None, "code": "internal_error"}}
