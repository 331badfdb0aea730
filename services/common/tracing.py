"""The process's OpenTelemetry tracer: set up from the standard OTEL_* variables, W3C propagation.

Tracing is OFF unless an exporter is asked for: an endpoint (`--otlp-traces-endpoint`,
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT) or OTEL_TRACES_EXPORTER=otlp |
console. Off, `get_tracer()` is None and every instrumented place skips its work after one check.

NOTE: the provider is ours, not installed as OpenTelemetry's global one: `set_tracer_provider` may
be called once per process, and tests (and the benchmark) set tracing up several times.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Callable, Iterator, Mapping
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter,
                                            SimpleSpanProcessor, SpanExporter)
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger("kvmesh.tracing")

PROTOCOLS = ("http/protobuf", "grpc")
DEFAULT_SERVICE_NAME = "kvmesh"

_provider: TracerProvider | None = None
_tracer: Tracer | None = None
_propagator = TraceContextTextMapPropagator()


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def _http_traces_url(endpoint: str) -> str:
    """An endpoint without a path gets OTLP/HTTP's standard `/v1/traces`."""
    if urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def _otlp_exporter(endpoint: str | None, protocol: str) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        insecure = None if endpoint is None else urlsplit(endpoint).scheme != "https"
        return OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import \
        OTLPSpanExporter as HTTPExporter
    # NOTE: the exporter itself appends /v1/traces only to OTEL_EXPORTER_OTLP_ENDPOINT; an
    # explicit endpoint (the flag) is taken as is, so the flag gets the same treatment here.
    return HTTPExporter(endpoint=_http_traces_url(endpoint) if endpoint else None)


def _exporters(endpoint: str | None, protocol: str | None) -> list[SpanExporter]:
    names = [n.strip().lower() for n in (_env("OTEL_TRACES_EXPORTER") or "").split(",") if n.strip()]
    env_endpoint = _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    if "none" in names and endpoint is None:
        return []
    protocol = (protocol or _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").lower()
    if protocol == "http":
        protocol = "http/protobuf"
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTLP protocol must be one of {PROTOCOLS}, got {protocol!r}; set "
                         "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL to grpc or http/protobuf")
    exporters: list[SpanExporter] = []
    if endpoint is not None or env_endpoint is not None or "otlp" in names:
        exporters.append(_otlp_exporter(endpoint, protocol))
    if "console" in names:
        exporters.append(ConsoleSpanExporter(out=sys.stdout))  # NOTE: now, not at import
    return exporters


def init_tracing(service_name: str | None = None, endpoint: str | None = None,
                 protocol: str | None = None, exporter: SpanExporter | None = None,
                 sampler: Sampler | None = None, simple: bool = False) -> TracerProvider | None:
    """Set up the process's tracer; returns its provider, or None when tracing stays off.

    `endpoint` (the --otlp-traces-endpoint flag) wins over OTEL_EXPORTER_OTLP_*_ENDPOINT;
    `protocol` over OTEL_EXPORTER_OTLP_*_PROTOCOL (default http/protobuf). `exporter` replaces
    the configured ones (tests: an in-memory exporter; the benchmark: one that discards).
    The sampler defaults to OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (default: parent-based,
    always on). Spans go through a BatchSpanProcessor (bounded queue, background export, drops
    rather than blocks when full) unless `simple` (tests: exported on end, in the caller).
    """
    global _provider, _tracer
    shutdown_tracing()
    exporters = [exporter] if exporter is not None else _exporters(endpoint, protocol)
    if not exporters:
        return None
    name = service_name or _env("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
    provider = TracerProvider(sampler=sampler, resource=Resource.create({SERVICE_NAME: name}))
    for exp in exporters:
        provider.add_span_processor(SimpleSpanProcessor(exp) if simple else BatchSpanProcessor(exp))
    _provider = provider
    _tracer = provider.get_tracer("kvmesh")
    logger.info("tracing on: service %s, exporters %s", name,
                ", ".join(type(e).__name__ for e in exporters))
    return provider


def get_tracer() -> Tracer | None:
    """The process's tracer, or None when tracing is off."""
    return _tracer


def shutdown_tracing() -> None:
    """Flush what is queued and stop the exporters; tracing is off afterwards."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def extract_context(headers: Mapping[str, str]) -> otel_context.Context:
    """The context of an incoming W3C `traceparent` / `tracestate` (empty when absent or bad).
    Header names must be lower case."""
    return _propagator.extract(headers)


def inject_context(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """W3C headers carrying `ctx` (default: the current context) to a downstream service."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return carrier


OPERATION_KEY = otel_context.create_key("kvmesh.gen_ai.operation")


def current_context(operation: str = "text_completion") -> otel_context.Context | None:
    """The caller's context (holding the HTTP server span) to hand to the engine, carrying the
    GenAI operation name ("chat" or "text_completion"); None when tracing is off."""
    if _tracer is None:
        return None
    return otel_context.set_value(OPERATION_KEY, operation, otel_context.get_current())


@contextlib.contextmanager
def server_span(scope: Mapping, headers: Mapping[str, str]) -> Iterator[Callable[[dict], None]]:
    """The HTTP server span of one ASGI request, current inside the block and parented on an
    incoming `traceparent`. Yields a callback for each ASGI send message (records the status)."""
    assert _tracer is not None, "server_span needs tracing on (check get_tracer() first)"
    method = scope.get("method", "GET")
    attrs: dict[str, object] = {"http.request.method": method, "url.path": scope.get("path", ""),
                                "url.scheme": scope.get("scheme", "http"),
                                "network.protocol.version": scope.get("http_version", "1.1")}
    if scope.get("server"):
        attrs["server.address"], attrs["server.port"] = scope["server"][0], scope["server"][1]
    if scope.get("client"):
        attrs["client.address"] = scope["client"][0]
    if "user-agent" in headers:
        attrs["user_agent.original"] = headers["user-agent"]
    if "x-request-id" in headers:
        attrs["kvmesh.http.request_id"] = headers["x-request-id"]
    with _tracer.start_as_current_span(f"{method} {scope.get('path', '')}",
                                       context=extract_context(headers),
                                       kind=trace.SpanKind.SERVER, attributes=attrs) as span:
        def on_send(message: dict) -> None:
            if message.get("type") == "http.response.start":
                status = int(message.get("status", 200))
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(trace.StatusCode.ERROR)
        yield on_send
