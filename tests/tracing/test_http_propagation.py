"""The HTTP server span: an incoming W3C traceparent is honoured and parents the request tree."""
from __future__ import annotations

import httpx
import pytest

from kvmesh.api.app import ServerState, create_app
from kvmesh.common.config import EngineConfig
from kvmesh.common.tracing import get_tracer
from kvmesh.engine.async_engine import AsyncLLMEngine
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.tracing_hooks import EngineTracer

from .conftest import by_name, children

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


@pytest.fixture
def app(smollm, spans_exporter):
    engine = LLMEngine(EngineConfig(block_size=16, num_kv_blocks=16, max_model_len=256),
                       loaded=smollm)
    EngineTracer(get_tracer(), engine.model_name).attach(engine)
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()
    state = ServerState(engine=async_engine, model_name=engine.model_name,
                        max_model_len=engine.max_model_len, ready=True)
    yield create_app(state)
    async_engine.shutdown()


async def _post(app, path: str, body: dict, headers: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
async def test_traceparent_parents_server_span_and_request_tree(app, spans_exporter, stream):
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    resp = await _post(app, "/v1/completions",
                       {"prompt": "Hello, my name is", "max_tokens": 3, "temperature": 0,
                        "stream": stream}, headers)
    assert resp.status_code == 200, resp.text
    spans = spans_exporter.get_finished_spans()
    (server,) = [s for s in spans if s.name == "POST /v1/completions"]
    assert server.kind.name == "SERVER"
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    assert f"{server.parent.span_id:016x}" == PARENT_ID and server.parent.is_remote
    assert server.attributes["http.request.method"] == "POST"
    assert server.attributes["http.response.status_code"] == 200
    (request,) = children(spans, server)
    assert request.name == "kvmesh.request"
    assert request.attributes["gen_ai.usage.output_tokens"] == 3
    assert request.attributes["gen_ai.request.max_tokens"] == 3
    assert request.attributes["gen_ai.operation.name"] == "text_completion"
    assert {k.name for k in children(spans, request)} == {"kvmesh.queue", "kvmesh.prefill",
                                                          "kvmesh.decode"}
    assert server.start_time <= request.start_time <= request.end_time <= server.end_time
    assert by_name(spans, "kvmesh.step")


async def test_chat_without_traceparent_starts_a_trace(app, spans_exporter):
    resp = await _post(app, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                        "temperature": 0}, {})
    assert resp.status_code == 200, resp.text
    spans = spans_exporter.get_finished_spans()
    (server,) = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert server.parent is None
    (request,) = children(spans, server)
    assert request.attributes["gen_ai.usage.output_tokens"] == 2
    assert request.attributes["gen_ai.operation.name"] == "chat"


async def test_health_and_errors(app, spans_exporter):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.post("/v1/completions", json={"prompt": ""})).status_code == 400
    spans = spans_exporter.get_finished_spans()
    assert [s.name for s in spans] == ["POST /v1/completions"]     # probes are not traced
    assert spans[0].attributes["http.response.status_code"] == 400
