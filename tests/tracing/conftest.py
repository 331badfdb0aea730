"""Tracing fixtures: an in-memory exporter behind the process's tracer, and span lookups."""
from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.common.tracing import init_tracing, shutdown_tracing


@pytest.fixture
def spans_exporter():
    """Tracing on for one test; every span is exported to memory as it ends."""
    exporter = InMemorySpanExporter()
    assert init_tracing(service_name="kvmesh-test", exporter=exporter, simple=True) is not None
    yield exporter
    shutdown_tracing()


def by_name(spans, name: str) -> list:
    return [s for s in spans if s.name == name]


def children(spans, parent) -> list:
    pid = parent.context.span_id
    return [s for s in spans if s.parent is not None and s.parent.span_id == pid]
