"""An OpenTelemetry SDK with in-memory export, for the tests that read UndoLog's spans and metrics."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from undolog_core import _observe


@contextlib.contextmanager
def in_memory_otel(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    """An SDK tracer and meter provider with in-memory export, for one test: yields (span exporter, metric reader).

    .ci/run sets OTEL_SDK_DISABLED for CrewAI; the SDK would then hand out no-op tracers. The API lets a global
    provider be set once per process, so the globals are swapped in and monkeypatch puts them back."""
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    import opentelemetry.metrics._internal as metrics_internal
    import opentelemetry.trace as trace_api
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    monkeypatch.setattr(trace_api, "_TRACER_PROVIDER", tracer_provider)
    monkeypatch.setattr(metrics_internal, "_METER_PROVIDER", meter_provider)
    monkeypatch.setattr(_observe, "_instruments", None)
    assert _observe.tracing() and _observe.metering()
    try:
        yield exporter, reader
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()
