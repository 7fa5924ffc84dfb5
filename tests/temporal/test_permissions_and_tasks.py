"""Session permissions and task mode on Temporal (issue 23 items 8 and 1): a session run by a
workflow keeps its permissions (the engine's checks run inside it), a Restrict control reaches it as
a signal, and a task runs there with its acceptance checks."""

from __future__ import annotations

import uuid
from typing import Any

from fsm_agent import (AcceptanceCheck, Agent, Decision, OutputSchema, Permissions, Restrict, Restriction,
                       ScriptedProvider, StopReason, Task, TaskOutcome, tool)
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.temporal import TemporalHost, create_worker
from fsm_agent.types import ToolUseBlock
from fsm_agent_middleware.approval import HumanApproval

SENT: list[str] = []


@tool(effect="side_effect")
def send(to: str) -> str:
    """Send a message."""
    SENT.append(to)
    return f"sent to {to}"


def pair(temporal_client: Any, task_queue: str, store: Any, script: list[Any]) -> tuple[Agent, Agent, str]:
    name = "tests.perms:" + uuid.uuid4().hex[:6]
    worker = Agent(ScriptedProvider(script), tools=[send], middleware=[HumanApproval(tools=["send"])], store=store)
    client = Agent(ScriptedProvider([]), tools=[send], middleware=[HumanApproval(tools=["send"])], store=store,
                   host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))
    return worker, client, name


async def test_permissions_hold_in_the_workflow_and_a_restrict_signal_narrows_them(temporal_client, task_queue,
                                                                                 tmp_path) -> None:
    SENT.clear()
    store = SQLiteStore(tmp_path / "s.db")
    script = [tool_call_response(ToolUseBlock("c1", "send", {"to": "ann"})),
              tool_call_response(ToolUseBlock("c2", "send", {"to": "bob"})), "done"]
    worker, client, name = pair(temporal_client, task_queue, store, script)
    async with create_worker(temporal_client, {name: worker}, task_queue=task_queue):
        sid = "perm-p1-" + uuid.uuid4().hex[:6]
        first = await client.run("mail them", session_id=sid, permissions=Permissions(tools=["send"]))
        assert first.stop.reason is StopReason.WAITING_HUMAN
        await client.control(sid, Restrict(Restriction(tools=[]), "mail is off"))  # a signal; no resume by itself
        done = await client.resume(sid, decisions={"c1": Decision.approve()})
        assert done.stop.reason is StopReason.COMPLETED and SENT == []
        denied = [e.payload for e in await store.read_events(sid) if e.type == "permission_denied"]
        assert [(d["call_id"], d["permission"]) for d in denied] == [("c1", "restriction 1: tools"),
                                                                      ("c2", "restriction 1: tools")]


async def test_a_task_with_an_output_schema_runs_on_temporal(temporal_client, task_queue, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    city = OutputSchema("city", {"type": "object", "properties": {"name": {"type": "string"},
                                                                  "population": {"type": "integer"}},
                                 "required": ["name", "population"], "additionalProperties": False})
    script = ['{"name": "Paris", "population": 5}', '{"name": "Paris", "population": 2102650}']
    worker, client, name = pair(temporal_client, task_queue, store, script)
    task = Task("Find the largest city of France.", allowed_tools=[], output_schema=city,
                checks=[AcceptanceCheck.on_value("a real population", "output.population", gt=1_000_000)])
    async with create_worker(temporal_client, {name: worker}, task_queue=task_queue):
        result = await client.run_task(task, session_id="perm-t2-" + uuid.uuid4().hex[:6])
    assert result.outcome is TaskOutcome.SUCCEEDED, result.detail
    assert result.output == {"name": "Paris", "population": 2102650}


async def test_a_task_runs_on_temporal_with_its_checks(temporal_client, task_queue, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    worker, client, name = pair(temporal_client, task_queue, store, ["It is Lyon.", "It is Paris."])
    task = Task("Name the largest city of France.", allowed_tools=[],
                checks=[AcceptanceCheck.on_value("names Paris", "answer", contains="Paris")])
    async with create_worker(temporal_client, {name: worker}, task_queue=task_queue):
        sid = "perm-t1-" + uuid.uuid4().hex[:6]
        result = await client.run_task(task, session_id=sid)
    assert result.outcome is TaskOutcome.SUCCEEDED, result.detail
    assert result.output == "It is Paris."
    assert [(c.name, c.ok) for c in result.checks] == [("names Paris", True)]
    rec = await store.get_session(sid)
    assert rec is not None and rec.metadata["task_definition"]["goal"] == "Name the largest city of France."
