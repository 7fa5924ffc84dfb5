"""A loopback OTLP/HTTP receiver (no collector binary ships here): accepts ``POST /v1/traces`` and
``/v1/metrics`` and decodes each body with ``opentelemetry-proto``."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class OtlpReceiver:
    """Keeps every decoded span (``spans``) and metric (``metrics``), and the raw bytes received."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.metrics: list[Any] = []
        self.resources: list[dict[str, Any]] = []
        self.bytes = 0
        self._runner: web.AppRunner | None = None
        self.endpoint = ""

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.bytes += len(body)
        msg = ExportTraceServiceRequest.FromString(body)
        for rs in msg.resource_spans:
            self.resources.append({a.key: a.value.string_value for a in rs.resource.attributes})
            for ss in rs.scope_spans:
                self.spans.extend(ss.spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def _metrics(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.bytes += len(body)
        msg = ExportMetricsServiceRequest.FromString(body)
        for rm in msg.resource_metrics:
            for sm in rm.scope_metrics:
                self.metrics.extend(sm.metrics)
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        app.router.add_post("/v1/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.endpoint = f"http://127.0.0.1:{port}"
        return self.endpoint

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def attrs(span: Any) -> dict[str, Any]:
    """A decoded span's (or data point's) attributes as plain values."""
    out: dict[str, Any] = {}
    for a in span.attributes:
        v = a.value
        kind = v.WhichOneof("value")
        if kind == "array_value":
            out[a.key] = tuple(getattr(x, x.WhichOneof("value")) for x in v.array_value.values)
        else:
            out[a.key] = getattr(v, kind) if kind else None
    return out
