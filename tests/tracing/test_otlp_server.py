"""`kvmesh serve --otlp-traces-endpoint` delivers its spans over OTLP/HTTP to a receiver here."""
from __future__ import annotations

import http.server
import threading

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)
from servers import start_server  # tests/support

TRACE_ID = "5b8efff798038103d269b633813fc60c"
PARENT_ID = "eee19b7ec3c1b174"


class _Receiver(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list = []          # (resource service name, protobuf Span)
        self.paths: list[str] = []
        self.lock = threading.Lock()


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        req = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            self.server.paths.append(self.path)
            for rs in req.resource_spans:
                service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name")
                for ss in rs.scope_spans:
                    self.server.spans.extend((service, s) for s in ss.spans)
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def receiver():
    srv = _Receiver()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_server_exports_spans_over_otlp_http(tmp_path, receiver, monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "kvmesh-e2e")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    port = receiver.server_address[1]
    server = start_server(tmp_path, "--otlp-traces-endpoint", f"http://127.0.0.1:{port}",
                          "--num-kv-blocks", "32", "--max-model-len", "256")
    try:
        resp = httpx.post(f"{server.url}/v1/completions",
                          json={"prompt": "The capital of France is", "max_tokens": 4,
                                "temperature": 0},
                          headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}, timeout=60)
        assert resp.status_code == 200, resp.text
    finally:
        code = server.stop()        # SIGTERM: the lifespan flushes the queued spans
    assert code == 0, server.log()[-3000:]
    with receiver.lock:
        spans = list(receiver.spans)
        paths = set(receiver.paths)
    assert paths == {"/v1/traces"}
    assert {service for service, _ in spans} == {"kvmesh-e2e"}
    spans = [s for _, s in spans]
    ours = [s for s in spans if s.trace_id.hex() == TRACE_ID]
    (http_span,) = [s for s in ours if s.name == "POST /v1/completions"]
    assert http_span.parent_span_id.hex() == PARENT_ID
    (request,) = [s for s in ours if s.name == "kvmesh.request"]
    assert request.parent_span_id == http_span.span_id
    kids = sorted(s.name for s in ours if s.parent_span_id == request.span_id)
    assert kids == ["kvmesh.decode", "kvmesh.prefill", "kvmesh.queue"]
    attrs = {a.key: a.value for a in request.attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == 4
    steps = [s for s in spans if s.name == "kvmesh.step"]
    step_ids = {s.span_id for s in steps}
    assert steps and all(not s.parent_span_id for s in steps)
    (decode,) = [s for s in ours if s.name == "kvmesh.decode"]
    assert decode.links and all(link.span_id in step_ids for link in decode.links)
