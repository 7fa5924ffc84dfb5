"""Stops, approvals and controls in Temporal's terms: a WAITING_HUMAN or PAUSED_BUDGET stop is a
durable wait; a decision is a validated Update; controls are signals; the snapshot is a query."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from fsm_agent import Agent, Decision, ScriptedProvider, StopReason, tool
from fsm_agent.control import Cancel, Interrupt, Steer
from fsm_agent.errors import ResumeError
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.temporal import TemporalHost, create_worker
from fsm_agent_middleware.approval import HumanApproval

SENT: list[str] = []


@tool(effect="side_effect")
def send(to: str) -> str:
    """Send a message."""
    SENT.append(to)
    return f"sent to {to}"


def pair(temporal_client: Any, task_queue: str, store: Any, script: list[Any], **kw: Any) -> tuple[Agent, Agent, str]:
    name = "tests.waits:" + uuid.uuid4().hex[:6]
    mw = [HumanApproval(tools=["send"])]
    worker = Agent(ScriptedProvider(script), tools=[send], middleware=mw, store=store, **kw)
    client = Agent(ScriptedProvider([]), tools=[send], middleware=[HumanApproval(tools=["send"])], store=store,
                   host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue), **kw)
    return worker, client, name


async def test_an_approval_is_a_durable_wait_and_a_decision_resumes_it(temporal_client, task_queue, tmp_path) -> None:
    SENT.clear()
    store = SQLiteStore(tmp_path / "s.db")
    worker, client, name = pair(temporal_client, task_queue, store,
                                [tool_call_response(("send", {"to": "ann"})), "done"])
    async with create_worker(temporal_client, {name: worker}, task_queue=task_queue):
        first = await client.run("mail ann", session_id="w1")
        assert first.stop.reason is StopReason.WAITING_HUMAN and SENT == []
        [pending] = first.stop.pending_actions
        snap = await client.host.snapshot("w1")
        assert snap["waiting"] and [p["call"]["id"] for p in snap["pending"]] == [pending.call.id]
        # two clients send the same decision at once: one outcome, the call runs once
        outcomes = await asyncio.gather(client.decide("w1", pending.call.id, Decision.approve()),
                                        client.decide("w1", pending.call.id, Decision.approve()))
        assert sorted(o.replayed for o in outcomes) == [False, True]
        with pytest.raises(ResumeError, match="already decided"):
            await client.decide("w1", pending.call.id, Decision.reject("no"))
        done = await client.host._result(client, client.host.handle("w1"), 1)
    assert done.stop.reason is StopReason.COMPLETED and SENT == ["ann"]


async def test_a_decision_for_an_unknown_call_or_of_a_kind_not_allowed_is_refused(temporal_client, task_queue,
                                                                                  tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    worker, client, name = pair(temporal_client, task_queue, store,
                                [tool_call_response(("send", {"to": "bob"})), "done"])
    async with create_worker(temporal_client, {name: worker}, task_queue=task_queue):
        first = await client.run("mail bob", session_id="w2")
        assert first.stop.reason is StopReason.WAITING_HUMAN
        with pytest.raises(ResumeError, match="no pending tool call"):
            await client.decide("w2", "call_nope", Decision.approve())
        result = await client.resume("w2", decisions={first.stop.pending_actions[0].call.id: Decision.reject("no")})
    assert result.stop.reason is StopReason.COMPLETED
    assert "rejected" in [m for m in result.messages if getattr(m, "tool_call_id", None)][0].text


async def test_a_budget_pause_resumes_with_a_raised_budget(temporal_client, task_queue, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    name = "tests.budget:" + uuid.uuid4().hex[:6]
    script = [tool_call_response(("send", {"to": "x"})), tool_call_response(("send", {"to": "y"})), "done"]
    worker = Agent(ScriptedProvider(script), tools=[send], store=store)
    client = Agent(ScriptedProvider([]), tools=[send], store=store,
                   host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))
    async with create_worker(temporal_client, {name: worker}, task_queue=task_queue):
        first = await client.run("go", session_id="b1", max_iterations=1)
        assert first.stop.reason is StopReason.PAUSED_BUDGET
        done = await client.resume("b1", max_iterations=5)
    assert done.stop.reason is StopReason.COMPLETED and done.turns == 3


async def test_a_cancel_signal_to_a_waiting_session_cancels_it_and_ends_the_workflow(temporal_client, task_queue,
                                                                                    tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    worker, client, name = pair(temporal_client, task_queue, store, [tool_call_response(("send", {"to": "c"}))])
    async with create_worker(temporal_client, {name: worker}, task_queue=task_queue):
        first = await client.run("mail c", session_id="c1")
        assert first.stop.reason is StopReason.WAITING_HUMAN
        await client.control("c1", Cancel("changed my mind"))
        final = await client.host.handle("c1").result()
    assert final["stop"]["reason"] == "CANCELLED"
    rec = await store.get_session("c1")
    assert rec is not None and rec.state == "CANCELLED"


STARTED: list[int] = []


@tool
async def slow(n: int) -> str:
    """Wait a while."""
    STARTED.append(n)
    await asyncio.sleep(n)
    return "slept"


async def test_an_interrupt_signal_cuts_a_running_tool_and_steer_goes_on(temporal_client, task_queue, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    name = "tests.ctl:" + uuid.uuid4().hex[:6]
    script = [tool_call_response(("slow", {"n": 30})), "after steer"]
    worker = Agent(ScriptedProvider(script), tools=[slow], store=store)
    client = Agent(ScriptedProvider([]), tools=[slow], store=store,
                   host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))
    async with create_worker(temporal_client, {name: worker}, task_queue=task_queue):
        STARTED.clear()
        run = asyncio.ensure_future(client.run("sleep", session_id="i1"))
        for _ in range(200):  # the worker runs in this process: the tool's start is seen here
            if STARTED:
                break
            await asyncio.sleep(0.05)
        await client.control("i1", Interrupt("stop now"))
        first = await asyncio.wait_for(run, 20)
        assert first.stop.reason is StopReason.INTERRUPTED and "stop now" in first.stop.detail
        await client.control("i1", Steer("answer without sleeping"))
        done = await client.host._result(client, client.host.handle("i1"), 1)
    assert done.stop.reason is StopReason.COMPLETED and done.output == "after steer"
