"""The gRPC and console exporters deliver an engine's spans (OTLP/HTTP: test_otlp_server.py)."""
from __future__ import annotations

import json
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvmesh.common.config import EngineConfig
from kvmesh.common.tracing import get_tracer, init_tracing, shutdown_tracing
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.tracing_hooks import EngineTracer


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, str]] = []      # (service.name, span name)
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - the gRPC service's naming
        with self.lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((attrs.get("service.name"), s.name) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def _generate(smollm) -> int:
    """Two greedy tokens through a traced engine; returns the number of steps."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=16, max_model_len=128), loaded=smollm)
    EngineTracer(get_tracer(), engine.model_name).attach(engine)
    engine.add_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0.0,
                                                         ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.num_steps


def test_grpc_exporter_delivers_to_a_collector(smollm):
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        init_tracing(service_name="kvmesh-grpc", endpoint=f"http://127.0.0.1:{port}",
                     protocol="grpc")
        steps = _generate(smollm)
        shutdown_tracing()                               # flushes the batch processor
    finally:
        server.stop(grace=None)
    names = [name for _, name in collector.spans]
    assert {service for service, _ in collector.spans} == {"kvmesh-grpc"}
    assert names.count("kvmesh.step") == steps == 2
    assert names.count("kvmesh.request") == 1


def test_console_exporter_prints_spans(smollm, monkeypatch, capsys):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    capsys.readouterr()
    assert init_tracing(service_name="kvmesh-console") is not None
    steps = _generate(smollm)
    shutdown_tracing()
    out = capsys.readouterr().out
    # ConsoleSpanExporter writes one JSON object per span
    spans = json.loads("[" + out.replace("}\n{", "},\n{") + "]")
    assert [s["name"] for s in spans].count("kvmesh.step") == steps
    assert {s["resource"]["attributes"]["service.name"] for s in spans} == {"kvmesh-console"}
