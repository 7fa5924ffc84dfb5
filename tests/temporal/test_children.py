"""A sub-agent a tool starts on Temporal runs as a workflow of its own: its id is the child
session's id, it is served by the same workers under the name register() derived for it, and it is
linked to its parent in the store and by its memo."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from temporalio.client import WorkflowExecutionStatus

from fsm_agent import Agent, ScriptedProvider, StopReason, tool
from fsm_agent.control import Cancel, Interrupt
from fsm_agent.errors import SessionLinkError
from fsm_agent.orchestration.subagent import agent_tool
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.temporal import TemporalHost, create_worker
from fsm_agent.temporal.registry import child_agents, name_of
from fsm_agent.types.messages import ToolResultMessage


@tool
def lookup(city: str) -> str:
    """The weather in a city."""
    return f"{city}: 21 C, sunny"


def _agents(store: SQLiteStore, parent_script: list, child_script: list) -> tuple[Agent, ScriptedProvider]:
    child_provider = ScriptedProvider(child_script)
    researcher = Agent(child_provider, tools=[lookup], store=store, system_prompt="You look the weather up.")
    ask = agent_tool(researcher, name="researcher", description="Ask the researcher.")
    return Agent(ScriptedProvider(parent_script), tools=[ask], store=store), child_provider


async def test_register_serves_an_agent_tools_sub_agent_under_a_derived_name(tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    lead, _ = _agents(store, [], [])
    name = "tests.children:" + uuid.uuid4().hex[:6]
    [(child_name, researcher)] = child_agents(name, lead)
    assert child_name == f"{name}/researcher"
    from fsm_agent.temporal import register

    register(name, lead)
    assert name_of(researcher) == f"{name}/researcher"
    assert name_of(lead) == name


async def test_a_sub_agent_runs_as_its_own_workflow(temporal_client, task_queue, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    name = "tests.children:" + uuid.uuid4().hex[:6]
    parent_script = [tool_call_response(("researcher", {"task": "Weather in Oslo?"})), "Oslo is sunny, 21 C."]
    child_script = [tool_call_response(("lookup", {"city": "Oslo"})), "Oslo: 21 C, sunny."]
    lead, child_provider = _agents(store, parent_script, child_script)
    client_agent = Agent(ScriptedProvider([]), store=store,
                         host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))
    sid = "p-" + uuid.uuid4().hex[:8]
    async with create_worker(temporal_client, {name: lead}, task_queue=task_queue):
        result = await client_agent.run("How is the weather in Oslo?", session_id=sid)
    assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
    assert result.output == "Oslo is sunny, 21 C."

    [link] = await store.children(sid)
    assert link.kind == "agent_tool"
    child_id = link.child_id
    # the child's answer reached the parent's call
    [answer] = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert (answer.name, answer.text, answer.is_error) == ("researcher", "Oslo: 21 C, sunny.", False)

    # the child's workflow: id = the child session's id, completed, its memo names the parent
    found = {}
    async for wf in temporal_client.list_workflows(f"TaskQueue = '{task_queue}'"):
        found[wf.id] = wf
    assert set(found) == {sid, child_id}
    assert found[child_id].status is WorkflowExecutionStatus.COMPLETED
    assert found[sid].status is WorkflowExecutionStatus.COMPLETED
    desc = await temporal_client.get_workflow_handle(child_id).describe()
    assert (await desc.memo()) == {"child_of": {"session": sid, "call": link.call_id}}
    start = (await temporal_client.get_workflow_handle(child_id).fetch_history()).events[0]
    assert start.workflow_execution_started_event_attributes.workflow_type.name == "fsm_agent.Session"

    # the child's session log is in the store, linked to the parent, and completed
    rec = await store.get_session(child_id)
    assert rec is not None and rec.state == StopReason.COMPLETED.value
    assert (await store.parent(child_id)).parent_id == sid
    types = [e.type for e in await store.read_events(child_id)]
    assert types[0] == "session_started" and types[-1] == "run_stopped"
    # each model was called exactly as scripted: nothing twice
    assert len(child_provider.requests) == 2
    assert len(lead.provider.requests) == 2


STARTED: list[int] = []


@tool
async def slow(n: int) -> str:
    """Wait a while."""
    STARTED.append(n)
    await asyncio.sleep(n)
    return "slept"


async def test_an_interrupt_of_the_parent_interrupts_the_child_workflow_and_a_resume_continues_it(
        temporal_client, task_queue, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    name = "tests.children:" + uuid.uuid4().hex[:6]
    child_provider = ScriptedProvider([tool_call_response(("slow", {"n": 60})), "child done"])
    sleeper = Agent(child_provider, tools=[slow], store=store)
    lead = Agent(ScriptedProvider([tool_call_response(("sleeper", {"task": "sleep"})), "all done"]),
                 tools=[agent_tool(sleeper, name="sleeper", description="Sleeps.")], store=store)
    client_agent = Agent(ScriptedProvider([]), store=store,
                         host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))
    sid = "p-" + uuid.uuid4().hex[:8]
    async with create_worker(temporal_client, {name: lead}, task_queue=task_queue):
        STARTED.clear()
        run = asyncio.ensure_future(client_agent.run("go", session_id=sid))
        for _ in range(400):  # the workers run in this process: the child's tool start is seen here
            if STARTED:
                break
            await asyncio.sleep(0.05)
        assert STARTED == [60]
        await client_agent.control(sid, Interrupt("stop now"))
        first = await asyncio.wait_for(run, 30)
        assert first.stop.reason is StopReason.INTERRUPTED, first.stop.detail
        [link] = await store.children(sid)
        child = await store.get_session(link.child_id)
        assert child is not None and child.state == StopReason.INTERRUPTED.value
        child_wf = await temporal_client.get_workflow_handle(link.child_id).describe()
        assert child_wf.status is WorkflowExecutionStatus.RUNNING  # it waits for a resume, durably

        done = await asyncio.wait_for(client_agent.resume(sid), 30)
        assert done.stop.reason is StopReason.COMPLETED, done.stop.detail
        assert done.output == "all done"
        child_wf = await temporal_client.get_workflow_handle(link.child_id).describe()
    assert child_wf.status is WorkflowExecutionStatus.COMPLETED
    assert (await store.get_session(link.child_id)).state == StopReason.COMPLETED.value
    [answer] = [m for m in done.messages if isinstance(m, ToolResultMessage)]
    assert (answer.text, answer.is_error) == ("child done", False)
    assert STARTED == [60]  # the child's tool was not started again
    assert len(child_provider.requests) == 2 and len(lead.provider.requests) == 2


GATE: list[asyncio.Event] = []


@tool
async def gated(n: int) -> str:
    """Wait for the test to open the gate."""
    STARTED.append(n)
    await GATE[0].wait()
    return "opened"


async def test_a_call_run_again_while_its_child_runs_waits_for_that_workflow(temporal_client, task_queue,
                                                                             tmp_path) -> None:
    """What a retried tool activity (its worker lost) does: it finds the child's workflow by the
    child's session id and waits for its result; nothing is started or run twice."""
    from fsm_agent.orchestration._child import drive_child
    from fsm_agent.temporal.children import children_as_workflows

    store = SQLiteStore(tmp_path / "s.db")
    name = "tests.children:" + uuid.uuid4().hex[:6]
    child_provider = ScriptedProvider([tool_call_response(("gated", {"n": 1})), "gate passed"])
    child = Agent(child_provider, tools=[gated], store=store)
    lead = Agent(ScriptedProvider([]), tools=[agent_tool(child, name="gate", description="Waits.")], store=store)
    await Agent(ScriptedProvider(["parent"]), store=store).run("the parent", session_id="p-1")
    STARTED.clear()
    GATE[:] = [asyncio.Event()]
    async with create_worker(temporal_client, {name: lead}, task_queue=task_queue):
        with children_as_workflows(temporal_client, task_queue):
            first = asyncio.ensure_future(drive_child(child, "c-1", "go", parent_id="p-1", kind="agent_tool",
                                                      call_id="call_1"))
            for _ in range(400):
                if STARTED or first.done():
                    break
                await asyncio.sleep(0.05)
            assert STARTED == [1]
            again = asyncio.ensure_future(drive_child(child, "c-1", "go", parent_id="p-1", kind="agent_tool",
                                                      call_id="call_1"))
            await asyncio.sleep(0.5)
            assert not again.done()  # it waits for the running workflow
            GATE[0].set()
            one, two = await asyncio.wait_for(asyncio.gather(first, again), 30)
            # another call's claim on the same child session is refused
            with pytest.raises(SessionLinkError):
                await drive_child(child, "c-1", "go", parent_id="p-1", kind="agent_tool", call_id="call_2")
    assert (one.stop.reason, one.output) == (StopReason.COMPLETED, "gate passed")
    assert (two.stop.reason, two.output) == (StopReason.COMPLETED, "gate passed")
    assert STARTED == [1] and len(child_provider.requests) == 2
    ids = [wf.id async for wf in temporal_client.list_workflows(f"TaskQueue = '{task_queue}'")]
    assert ids == ["c-1"]


async def test_a_teams_workers_run_as_workflows_of_their_own(temporal_client, task_queue, tmp_path) -> None:
    from fsm_agent.orchestration.team import DISPATCH, Team
    from fsm_agent.providers import text_response

    store = SQLiteStore(tmp_path / "s.db")
    name = "tests.children.team:" + uuid.uuid4().hex[:6]
    asked: list[str] = []

    def answer(request: Any) -> Any:
        task = next(m.text for m in request.messages if m.role == "user")
        asked.append(task)
        return text_response(f"result of {task}")

    leader_p = ScriptedProvider([tool_call_response((DISPATCH, {"subtasks": [{"task": "a"}, {"task": "b"}]})),
                                 "a+b merged"])
    worker = Agent(ScriptedProvider([answer], repeat_last=True), store=store)
    team = Team(Agent(leader_p, store=store), worker, max_workers=2)
    assert [n for n, _ in child_agents(name, team.leader)] == [f"{name}/{DISPATCH}"]
    client_agent = Agent(ScriptedProvider([]), store=store,
                         host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))
    sid = "L-" + uuid.uuid4().hex[:8]
    async with create_worker(temporal_client, {name: team.leader}, task_queue=task_queue):
        result = await client_agent.run("do ab", session_id=sid)
    assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
    assert result.output == "a+b merged"
    links = await store.children(sid)
    assert [(x.kind, x.metadata["task"]) for x in links] == [("worker", "a"), ("worker", "b")]
    found = {wf.id: wf.status async for wf in temporal_client.list_workflows(f"TaskQueue = '{task_queue}'")}
    assert found == {sid: WorkflowExecutionStatus.COMPLETED, links[0].child_id: WorkflowExecutionStatus.COMPLETED,
                     links[1].child_id: WorkflowExecutionStatus.COMPLETED}
    assert sorted(asked) == ["a", "b"] and len(leader_p.requests) == 2
    for link in links:
        rec = await store.get_session(link.child_id)
        assert rec is not None and rec.state == StopReason.COMPLETED.value


async def test_a_handoffs_successor_runs_as_a_workflow_of_its_own(temporal_client, task_queue, tmp_path) -> None:
    from fsm_agent.orchestration.handoff import Handoffs

    store = SQLiteStore(tmp_path / "s.db")
    name = "tests.children.handoff:" + uuid.uuid4().hex[:6]
    package = {"goal": "Refund invoice 17", "verified_facts": ["invoice 17 was charged twice"],
               "open_actions": ["refund the second charge"], "summary": "The customer was billed twice."}
    triage_p = ScriptedProvider([tool_call_response(("handoff_to_billing", package))])
    billing_p = ScriptedProvider(["Refunded the second charge of invoice 17."])
    chain = Handoffs({"triage": Agent(triage_p, store=store), "billing": Agent(billing_p, store=store)})
    entry = chain.agents["triage"]
    assert [n for n, _ in child_agents(name, entry)] == [f"{name}/handoff_to_billing"]
    client_agent = Agent(ScriptedProvider([]), store=store,
                         host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))
    sid = "t-" + uuid.uuid4().hex[:8]
    async with create_worker(temporal_client, {name: entry}, task_queue=task_queue):
        result = await client_agent.run("My invoice 17 is wrong", session_id=sid)
    assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
    [link] = await store.children(sid)
    assert (link.kind, link.metadata["to"]) == ("handoff", "billing")
    found = {wf.id: wf.status async for wf in temporal_client.list_workflows(f"TaskQueue = '{task_queue}'")}
    assert found == {sid: WorkflowExecutionStatus.COMPLETED, link.child_id: WorkflowExecutionStatus.COMPLETED}
    rec = await store.get_session(link.child_id)
    assert rec is not None and rec.state == StopReason.COMPLETED.value
    assert len(triage_p.requests) == 1 and len(billing_p.requests) == 1


async def test_a_cancel_of_the_parent_cancels_the_child_workflow(temporal_client, task_queue, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    name = "tests.children:" + uuid.uuid4().hex[:6]
    child_provider = ScriptedProvider([tool_call_response(("slow", {"n": 61})), "never"])
    sleeper = Agent(child_provider, tools=[slow], store=store)
    lead = Agent(ScriptedProvider([tool_call_response(("sleeper", {"task": "sleep"})), "never"]),
                 tools=[agent_tool(sleeper, name="sleeper", description="Sleeps.")], store=store)
    client_agent = Agent(ScriptedProvider([]), store=store,
                         host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))
    sid = "p-" + uuid.uuid4().hex[:8]
    async with create_worker(temporal_client, {name: lead}, task_queue=task_queue):
        STARTED.clear()
        run = asyncio.ensure_future(client_agent.run("go", session_id=sid))
        for _ in range(400):
            if STARTED or run.done():
                break
            await asyncio.sleep(0.05)
        assert STARTED == [61]
        await client_agent.control(sid, Cancel("not needed any more"))
        stopped = await asyncio.wait_for(run, 60)
        [link] = await store.children(sid)
        child_wf = await temporal_client.get_workflow_handle(link.child_id).describe()
    assert stopped.stop.reason is StopReason.CANCELLED, stopped.stop.detail
    assert (await store.get_session(link.child_id)).state == StopReason.CANCELLED.value
    assert child_wf.status is WorkflowExecutionStatus.COMPLETED  # its workflow ended with the CANCELLED stop
    assert STARTED == [61] and len(child_provider.requests) == 1 and len(lead.provider.requests) == 1
