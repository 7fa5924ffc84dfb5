"""OpenTelemetry on Temporal (issues 21 and 22): with Temporal's TracingInterceptor on the client
and the worker, a session's run is one trace from the caller's span through the workflow to the
activities, whose ``chat`` and ``execute_tool`` spans are those of a run in process; the workflow
code, which Temporal replays, makes no span of its own, so nothing is traced twice."""

from __future__ import annotations

import uuid
from typing import Any

# The otel extra is part of the dev extra the test command installs: a missing SDK fails here.
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from temporalio.client import Client
from temporalio.contrib.opentelemetry import TracingInterceptor

from fsm_agent import Agent, ScriptedProvider, StopReason, tool
from fsm_agent.otel import OtelSettings
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.temporal import TemporalHost, create_worker
from fsm_agent.types import ToolUseBlock


@tool
def lookup(city: str) -> str:
    """The weather of a city."""
    return f"sunny in {city}"


async def test_a_run_on_temporal_is_one_trace_from_the_caller_to_its_model_and_tool_spans(temporal_target, task_queue,
                                                                                        tmp_path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    client = await Client.connect(temporal_target, interceptors=[TracingInterceptor(tracer)])
    store = SQLiteStore(tmp_path / "s.db")
    name = "tests.otel:" + uuid.uuid4().hex[:6]
    script: list[Any] = [tool_call_response(ToolUseBlock("c1", "lookup", {"city": "Oslo"})), "It is sunny."]
    worker = Agent(ScriptedProvider(script), tools=[lookup], store=store,
                   instrument=OtelSettings(tracer_provider=provider))
    caller = Agent(ScriptedProvider([]), tools=[lookup], store=store,
                   host=TemporalHost(client, agent_name=name, task_queue=task_queue))
    # max_cached_workflows=0: every workflow task replays the history from the start, as after a
    # worker's loss; the workflow code must still make no span of its own
    async with create_worker(client, {name: worker}, task_queue=task_queue, max_cached_workflows=0):
        with tracer.start_as_current_span("caller") as root:
            result = await caller.run("weather in Oslo?", session_id="otel-" + name[-6:])
    provider.force_flush()
    assert result.stop.reason is StopReason.COMPLETED and result.output == "It is sunny."
    spans = exporter.get_finished_spans()
    trace_id = root.get_span_context().trace_id
    assert {s.context.trace_id for s in spans} == {trace_id}  # one trace, the caller's
    chats = [s for s in spans if s.name.startswith("chat")]
    tools = [s for s in spans if s.name.startswith("execute_tool")]
    assert len(chats) == 2 and len(tools) == 1  # one span per model call and per tool call, none twice
    assert not [s for s in spans if s.name.startswith("invoke_agent")]  # the replayed workflow makes none
    by_id = {s.context.span_id: s for s in spans}
    for span in [*chats, *tools]:
        parent = by_id[span.parent.span_id]
        assert parent.name.startswith("RunActivity:fsm_agent."), parent.name
        assert span.attributes["gen_ai.conversation.id"] == "otel-" + name[-6:]
    assert tools[0].attributes["gen_ai.tool.name"] == "lookup"
    assert tools[0].attributes["gen_ai.tool.call.id"] == "c1"
    assert {s.attributes["gen_ai.operation.name"] for s in chats} == {"chat"}
