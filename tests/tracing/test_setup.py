"""init_tracing / get_tracer: off unless asked for, the standard OTEL_* variables, W3C helpers."""
from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.common import tracing

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
OTEL_VARS = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER",
             "OTEL_TRACES_SAMPLER_ARG")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    tracing.shutdown_tracing()


def _exporters(provider):
    procs = provider._active_span_processor._span_processors
    return [(type(p), p.span_exporter if hasattr(p, "span_exporter") else p._batch_processor._exporter)
            for p in procs]


def test_off_by_default():
    assert tracing.init_tracing() is None
    assert tracing.get_tracer() is None
    assert tracing.current_context() is None


def test_otel_traces_exporter_none_keeps_it_off(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.init_tracing() is None


def test_endpoint_flag_http_gets_v1_traces_and_batch_processor():
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    provider = tracing.init_tracing(endpoint="http://127.0.0.1:4318")
    assert tracing.get_tracer() is not None
    ((proc, exp),) = _exporters(provider)
    assert proc is BatchSpanProcessor
    assert isinstance(exp, OTLPSpanExporter)
    assert exp._endpoint == "http://127.0.0.1:4318/v1/traces"
    assert provider.resource.attributes["service.name"] == "kvmesh"


def test_env_endpoint_grpc_protocol_service_name_and_console(monkeypatch):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp,console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "engine-7")
    provider = tracing.init_tracing()
    kinds = [type(exp) for _, exp in _exporters(provider)]
    assert kinds == [OTLPSpanExporter, ConsoleSpanExporter]
    assert provider.resource.attributes["service.name"] == "engine-7"


def test_bad_protocol_fails_fast(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "thrift")
    with pytest.raises(ValueError, match="grpc or http/protobuf"):
        tracing.init_tracing(endpoint="http://127.0.0.1:4318")


def test_sampler_from_env(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    provider = tracing.init_tracing(exporter=InMemorySpanExporter())
    assert "0.25" in provider.sampler.get_description()


def test_extract_and_inject_w3c():
    exporter = InMemorySpanExporter()
    tracing.init_tracing(exporter=exporter, simple=True)
    ctx = tracing.extract_context({"traceparent": TRACEPARENT})
    assert tracing.inject_context(ctx)["traceparent"] == TRACEPARENT
    with tracing.get_tracer().start_as_current_span("child", context=ctx):
        pass
    (span,) = exporter.get_finished_spans()
    assert span.context.trace_id == int(TRACEPARENT.split("-")[1], 16)
    assert span.parent.span_id == int(TRACEPARENT.split("-")[2], 16)
    assert tracing.extract_context({"traceparent": "garbage"}) == {}
