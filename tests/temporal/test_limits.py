"""Temporal's limits: a long session continues as new (its history stays bounded) and carries on to
the same stop; a payload over the limit is refused with a typed error that says what to change; a
provider error that cannot be retried stops the run as in process (never a task retried forever)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from fsm_agent import Agent, ScriptedProvider, StopReason, tool
from fsm_agent.errors import AuthenticationError, PayloadTooLargeError
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.temporal import TemporalHost, Timeouts, create_worker
from fsm_agent.types import ToolUseBlock


@tool
def step(i: int) -> str:
    """One step."""
    return f"step {i} done"


@tool
def echo(text: str) -> str:
    """Say it back."""
    return text


async def pair(temporal_client: Any, task_queue: str, store: Any, script: list[Any], **host: Any) -> tuple[Agent, Agent, str]:
    name = "tests.limits:" + uuid.uuid4().hex[:6]
    worker = Agent(ScriptedProvider(script), tools=[step, echo], store=store)
    client = Agent(ScriptedProvider([]), tools=[step, echo], store=store,
                   host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue, **host))
    return worker, client, name


async def test_a_long_session_continues_as_new_and_reaches_its_stop(temporal_client, task_queue, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    script = [tool_call_response(ToolUseBlock(f"s{i}", "step", {"i": i})) for i in range(12)] + ["all done"]
    worker, client, name = await pair(temporal_client, task_queue, store, script, history_limit=60)
    async with create_worker(temporal_client, {name: worker}, task_queue=task_queue):
        result = await client.run("do twelve steps", session_id="long")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "all done"
    assert sum(1 for m in result.messages if getattr(m, "tool_call_id", None)) == 12
    events = await store.read_events("long")
    stops = [e.payload["stop"]["reason"] for e in events if e.type == "run_stopped"]
    assert "INTERRUPTED" in stops and stops[-1] == "COMPLETED"  # the self-interrupt before continuing as new
    runs = [w async for w in temporal_client.list_workflows(f"WorkflowId = 'long'")]
    assert len(runs) >= 2  # the workflow continued as new at least once


async def test_a_task_over_the_payload_limit_is_refused_before_anything_starts(temporal_client, task_queue,
                                                                              tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    worker, client, name = await pair(temporal_client, task_queue, store, ["ok"],
                                      timeouts=Timeouts(max_payload=2_000))
    async with create_worker(temporal_client, {name: worker}, task_queue=task_queue):
        with pytest.raises(PayloadTooLargeError) as info:
            await client.run("x" * 5_000, session_id="big-" + name[-6:])
    assert info.value.limit == 2_000 and info.value.size > 5_000
    assert "compaction" in str(info.value) and "2,000 bytes" in str(info.value)
    assert await store.get_session("big-" + name[-6:]) is None
    assert [w async for w in temporal_client.list_workflows(f"WorkflowId = 'big-{name[-6:]}'")] == []


async def test_writes_go_in_parts_and_one_over_the_payload_limit_is_a_typed_stop_stored_with_the_session(
        temporal_client, task_queue, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    # two calls whose writes fit, then one whose arguments alone (20,000 characters) are over the limit
    script = [tool_call_response(ToolUseBlock(f"b{i}", "echo", {"text": "y" * (700 if i < 2 else 20_000)}))
              for i in range(3)]
    worker, client, name = await pair(temporal_client, task_queue, store, [*script, "never sent"],
                                      timeouts=Timeouts(max_payload=14_000))
    sid = "parts-" + name[-6:]
    async with create_worker(temporal_client, {name: worker}, task_queue=task_queue):
        result = await client.run("echo three times", session_id=sid)
    assert result.stop.reason is StopReason.FAILED_TERMINAL and not result.stop.resumable
    error = result.stop.error
    assert error["kind"] == "payload_too_large" and error["limit"] == 14_000 and error["size"] > 20_000
    assert error["writes_not_stored"] >= 1
    assert "14,000 bytes" in result.stop.detail and "compaction" in result.stop.detail
    # the store holds everything up to the write that could not go, and the stop, saying why
    rec = await store.get_session(sid)
    assert rec is not None and rec.state == "FAILED_TERMINAL"
    assert rec.stop is not None and rec.stop["error"]["kind"] == "payload_too_large"
    ledger = await store.ledger(sid)
    assert {k: v.status.value for k, v in ledger.items()} == {"b0": "completed", "b1": "completed"}  # b2 never ran
    assert len(worker.provider.requests) == 3  # "never sent" was never asked for
    history = await temporal_client.get_workflow_handle(sid).fetch_history()
    kinds = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
             if e.HasField("activity_task_scheduled_event_attributes")]
    assert kinds.count("fsm_agent.apply_writes") >= 1  # writes that fit went on their own


async def test_a_non_retryable_provider_error_stops_the_run_as_in_process(temporal_client, task_queue,
                                                                         tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    worker, client, name = await pair(temporal_client, task_queue, store,
                                      [AuthenticationError("bad key", provider="scripted", status=401)])
    async with create_worker(temporal_client, {name: worker}, task_queue=task_queue):
        result = await client.run("hello", session_id="auth")
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error["kind"] == "authentication" and result.stop.error["status"] == 401
    desc = await temporal_client.get_workflow_handle("auth").describe()
    assert desc.status.name == "COMPLETED"  # a result of the workflow, not a task retried forever
