"""Fixtures for the OpenTelemetry tests: the SDK's in-memory span exporter and metric reader, and
helpers to read a run's span tree."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

# The otel extra is part of the dev extra the test command installs: a missing SDK fails here.
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fsm_agent.otel import OtelSettings, uninstrument


class Telemetry:
    """What a test's runs sent: spans and metrics, and the settings that send them here."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def settings(self, **kw: Any) -> OtelSettings:
        return OtelSettings(tracer_provider=self.tracer_provider, meter_provider=self.meter_provider, **kw)

    @property
    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, prefix: str) -> list[ReadableSpan]:
        return [s for s in self.spans if s.name.startswith(prefix)]

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        return sorted((s for s in self.spans if s.parent is not None and s.parent.span_id == parent.context.span_id),
                      key=lambda s: s.start_time or 0)

    def metrics(self) -> dict[str, list[Any]]:
        """Metric name -> its data points (with ``attributes`` and ``value`` / ``sum`` / ``count``)."""
        out: dict[str, list[Any]] = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    out.setdefault(m.name, []).extend(m.data.data_points)
        return out

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    t = Telemetry()
    yield t
    uninstrument()
    t.shutdown()


def every_string(span: ReadableSpan) -> list[str]:
    """Every string a span carries: name, status, attributes, events' names and attributes, links'."""
    out = [span.name, span.status.description or ""]

    def take(attrs: Any) -> None:
        for k, v in (attrs or {}).items():
            out.append(str(k))
            if isinstance(v, (tuple, list)):
                out.extend(str(x) for x in v)
            else:
                out.append(str(v))

    take(span.attributes)
    for e in span.events:
        out.append(e.name)
        take(e.attributes)
    for link in span.links:
        take(link.attributes)
    return out
