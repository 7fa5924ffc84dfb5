"""The wire (issue 22): OTLP/HTTP to a loopback receiver that decodes the protobuf finds the same
spans and metrics; a run started over HTTP continues the caller's trace from ``traceparent``; the
CLI's ``--otel``; and without instrumentation nothing of OpenTelemetry is imported."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as G
from opentelemetry.semconv._incubating.metrics import gen_ai_metrics as GM

from fsm_agent import Agent, ScriptedProvider, SQLiteStore, StopReason, tool
from fsm_agent.otel import names as N
from fsm_agent.providers import tool_call_response
from fsm_agent.types import ToolUseBlock

from .conftest import Telemetry
from .receiver import OtlpReceiver, attrs

ROOT = Path(__file__).resolve().parents[2]


@tool
def weather(city: str) -> str:
    "Weather of a city."
    return f"{city}: sunny"


def script() -> list[Any]:
    return [tool_call_response(ToolUseBlock("c_w", "weather", {"city": "Lima"})), "Lima is sunny"]


async def test_otlp_http_export_to_a_loopback_receiver_carries_the_spans_and_metrics(monkeypatch: Any) -> None:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from fsm_agent.otel import OtelSettings

    receiver = OtlpReceiver()
    base = await receiver.start()
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=base + "/v1/traces")))
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=base + "/v1/metrics"),
                                           export_interval_millis=3_600_000)
    mp = MeterProvider(metric_readers=[reader])
    try:
        agent = Agent(ScriptedProvider(script()), tools=[weather],
                      instrument=OtelSettings(tracer_provider=tp, meter_provider=mp))
        result = await agent.run("Weather in Lima?", session_id="s-wire")
        assert result.stop.reason is StopReason.COMPLETED
        # the exporters post from their own threads: flush there, not on the loop
        await asyncio.to_thread(tp.force_flush)
        await asyncio.to_thread(mp.force_flush)
    finally:
        await asyncio.to_thread(tp.shutdown)
        await asyncio.to_thread(mp.shutdown)
        await receiver.close()
    names = sorted(s.name for s in receiver.spans)
    assert names == ["chat scripted", "chat scripted", "execute_tool weather", "invoke_agent fsm_agent"]
    by_name = {s.name: s for s in receiver.spans}
    root, call = by_name["invoke_agent fsm_agent"], by_name["execute_tool weather"]
    assert attrs(root)[G.GEN_AI_CONVERSATION_ID] == "s-wire" and attrs(root)[N.STOP_REASON] == "COMPLETED"
    assert call.parent_span_id == root.span_id and call.trace_id == root.trace_id
    assert attrs(call)[G.GEN_AI_TOOL_CALL_ID] == "c_w" and attrs(call)[N.TOOL_OUTCOME] == "completed"
    metrics = {m.name for m in receiver.metrics}
    assert {GM.GEN_AI_CLIENT_TOKEN_USAGE, GM.GEN_AI_CLIENT_OPERATION_DURATION, N.METRIC_TOOL_CALLS,
            N.METRIC_STOPS} <= metrics


async def test_a_run_started_over_http_continues_the_callers_trace(telemetry: Telemetry, tmp_path: Path) -> None:
    from fsm_agent.server import create_app

    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    store = SQLiteStore(tmp_path / "s.db")

    def make(st: Any) -> Agent:
        return Agent(ScriptedProvider(script()), tools=[weather], store=st, instrument=telemetry.settings())

    client = TestClient(TestServer(create_app(make, store), host="127.0.0.1"))
    await client.start_server()
    try:
        resp = await client.post("/sessions/s-http/runs", json={"task": "Weather in Lima?"},
                                 headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "k=v"})
        assert resp.status == 202, await resp.text()
        deadline = time.monotonic() + 10
        while not telemetry.named("invoke_agent") and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        await client.close()
        await store.close()
    [root] = telemetry.named("invoke_agent")
    assert f"{root.context.trace_id:032x}" == trace_id
    assert root.parent is not None and f"{root.parent.span_id:016x}" == parent_id and root.parent.is_remote
    assert root.attributes[G.GEN_AI_CONVERSATION_ID] == "s-http"
    assert all(s.context.trace_id == root.context.trace_id for s in telemetry.spans)


def test_import_fsm_agent_imports_nothing_of_opentelemetry() -> None:
    code = ("import sys, fsm_agent, fsm_agent.agent, fsm_agent.otel\n"
            "from fsm_agent import Agent, ScriptedProvider\n"
            "import asyncio; asyncio.run(Agent(ScriptedProvider(['hi'])).run('x'))\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_cli_exports_a_run_over_otlp_with_otel(tmp_path: Path) -> None:
    """``fsm-agent run --otel`` against a scripted OpenAI-compatible server, exporting to a loopback
    receiver named by OTEL_EXPORTER_OTLP_ENDPOINT (each in a thread of this test)."""
    import threading

    from fsm_agent.testing import RecordedResponse, ReplayServer

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def serve() -> None:
        box["receiver"] = OtlpReceiver()
        box["otlp"] = await box["receiver"].start()
        body = (b'{"id":"r1","object":"chat.completion","model":"m","choices":[{"index":0,"message":'
                b'{"role":"assistant","content":"Lima is sunny"},"finish_reason":"stop"}],'
                b'"usage":{"prompt_tokens":5,"completion_tokens":3}}')
        box["model"] = ReplayServer([RecordedResponse(200, body, "application/json")])
        box["base"] = await box["model"].start()
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(30)
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": box["otlp"], "OTEL_SERVICE_NAME": "cli-test",
           "FSM_AGENT_STORE": str(tmp_path / "s.db"), "PYTHONPATH": str(ROOT)}
    try:
        out = subprocess.run([sys.executable, "-m", "fsm_agent.cli", "run", "--otel", "--provider", "openai-compatible",
                              "--base-url", box["base"], "--model", "m", "--api-key", "k", "--no-default-middleware",
                              "Weather in Lima?"], capture_output=True, text=True, env=env, timeout=120)
    finally:
        async def close() -> None:
            await box["model"].close()
            await box["receiver"].close()
        asyncio.run_coroutine_threadsafe(close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
    assert out.returncode == 0, out.stderr
    names = sorted(s.name for s in box["receiver"].spans)
    assert names == ["chat m", "invoke_agent fsm_agent"]
    assert box["receiver"].resources[0]["service.name"] == "cli-test"
