"""A session runs as a workflow: the same Agent API, the same stops, the same event log."""

from __future__ import annotations

import uuid

from fsm_agent import Agent, ScriptedProvider, StopReason, tool
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.temporal import TemporalHost, create_worker


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def test_a_run_with_a_tool_completes_on_temporal(temporal_client, task_queue, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    name = "tests.basic:" + uuid.uuid4().hex[:6]
    worker_agent = Agent(ScriptedProvider([tool_call_response(("add", {"a": 2, "b": 3})), "5"]), tools=[add],
                         store=store)
    client_agent = Agent(ScriptedProvider([]), tools=[add], store=store,
                         host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))
    async with create_worker(temporal_client, {name: worker_agent}, task_queue=task_queue):
        result = await client_agent.run("What is 2 + 3?", session_id="t1")
    assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
    assert result.output == "5"
    events = await store.read_events("t1")
    types = [e.type for e in events]
    assert types[0] == "session_started" and types[-1] == "run_stopped"
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
