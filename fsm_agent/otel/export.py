"""OTLP/HTTP export set up from the standard ``OTEL_*`` environment variables (the CLI's ``--otel``)."""

from __future__ import annotations

import os
from collections.abc import Callable

from opentelemetry import metrics, trace
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

__all__ = ["configure"]


def configure(*, service_name: str = "fsm-agent") -> tuple[TracerProvider, MeterProvider, Callable[[], None]]:
    """Global providers exporting over OTLP/HTTP (batched spans, periodic metrics), as the ``OTEL_*``
    variables configure the exporters, processor and reader. Returns the tracer provider, the meter
    provider and ``shutdown()``: flush and stop both providers."""
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    resource = Resource.create({} if named else {"service.name": service_name})
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    meter_provider = MeterProvider(resource=resource, metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter())])
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)

    def shutdown() -> None:
        tracer_provider.shutdown()
        meter_provider.shutdown()

    return tracer_provider, meter_provider, shutdown
