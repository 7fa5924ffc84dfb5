"""The event log of a session on Temporal is the in-process log of the same run, apart from what
names the host: event times, checkpoint ids."""

from __future__ import annotations

import uuid
from typing import Any

from fsm_agent import Agent, Decision, ScriptedProvider, StopReason, tool
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.temporal import TemporalHost, create_worker
from fsm_agent.types import ToolUseBlock
from fsm_agent_middleware.approval import HumanApproval


@tool
def lookup(city: str) -> str:
    """Weather for a city."""
    return f"{city}: 21 C"


@tool(effect="side_effect")
def book(city: str) -> str:
    """Book a trip."""
    return f"booked {city}"


def script() -> list[Any]:
    return [tool_call_response(ToolUseBlock("c1", "lookup", {"city": "Oslo"}),
                               ToolUseBlock("c2", "lookup", {"city": "Rome"})),
            tool_call_response(ToolUseBlock("c3", "book", {"city": "Rome"})), "Booked Rome."]


def agent(store: Any, **kw: Any) -> Agent:
    return Agent(ScriptedProvider(script()), tools=[lookup, book], middleware=[HumanApproval(tools=["book"])],
                 system_prompt="You plan trips.", store=store, **kw)


def normal(events: list[Any]) -> list[tuple[str, Any]]:
    def scrub(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: ("<id>" if k == "checkpoint_id" else scrub(x)) for k, x in v.items()
                    if k not in ("duration_s",)}
        if isinstance(v, list):
            return [scrub(x) for x in v]
        return v
    return [(e.seq, e.type, scrub(e.payload)) for e in events]


async def test_the_log_on_temporal_is_the_in_process_log(temporal_client, task_queue, tmp_path) -> None:
    local_store = SQLiteStore(tmp_path / "local.db")
    local = agent(local_store)
    first = await local.run("Plan a trip", session_id="s")
    assert first.stop.reason is StopReason.WAITING_HUMAN
    call = first.stop.pending_actions[0].call.id
    done = await local.resume("s", decisions={call: Decision.approve()})
    assert done.stop.reason is StopReason.COMPLETED

    store = SQLiteStore(tmp_path / "temporal.db")
    name = "tests.samelog:" + uuid.uuid4().hex[:6]
    client = Agent(ScriptedProvider([]), tools=[lookup, book], middleware=[HumanApproval(tools=["book"])],
                   system_prompt="You plan trips.", store=store,
                   host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))
    async with create_worker(temporal_client, {name: agent(store)}, task_queue=task_queue):
        t_first = await client.run("Plan a trip", session_id="s")
        assert t_first.stop.reason is StopReason.WAITING_HUMAN
        t_done = await client.resume("s", decisions={call: Decision.approve()})
    assert t_done.stop.reason is StopReason.COMPLETED and t_done.output == done.output
    assert t_done.messages == done.messages and t_done.usage == done.usage
    assert normal(await store.read_events("s")) == normal(await local_store.read_events("s"))
