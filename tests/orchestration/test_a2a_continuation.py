"""``remote_agent_tool`` continuing a remote task (``task_id`` and a data part), against fsm_agent's
own A2A server over loopback TCP: a Cancel of the parent cancels the continued task, an Interrupt
and resume after the remote finished takes its result, and the remote's usage is counted once.

Found by a review: the tool looked for its continuation message in the task's history, where the
server had renamed it (and had not listed a decisions-only message at all), so a Cancel left the
remote task running, and a resume after the remote finished sent the message again and got -32004;
and the remote reports a task's usage so far, which the parent added up on every call of one task.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from a2a_peers import GATE, Live, holding_tool, reset_gate
from fsm_agent import Agent, Cancel, Interrupt, ScriptedProvider, StopReason
from fsm_agent.orchestration.a2a import A2AClient, TaskState, fetch_agent_card, remote_agent_tool
from fsm_agent.providers import tool_call_response
from fsm_agent.server import create_app
from fsm_agent.server.a2a import A2AConfig, add_a2a_routes
from fsm_agent.server.app import STORE_KEY
from fsm_agent.server.auth import Tenants
from fsm_agent.store import MemoryStore, Store
from fsm_agent.tools import ToolContext
from fsm_agent.types import ToolResultMessage, ToolUseBlock, Usage
from fsm_agent_middleware.approval import HumanApproval
from server.common import RAN, approval_agent

hold = holding_tool(effect="side_effect")


@pytest.fixture(autouse=True)
def _gate() -> None:
    reset_gate()
    RAN.clear()


def b_model(req: Any) -> Any:
    if any(isinstance(m, ToolResultMessage) for m in req.messages):
        return "B finished after released"
    return tool_call_response(ToolUseBlock("h0", "hold", {}))


def serve(agent: Agent) -> Live:
    app = create_app(agent, tenants=Tenants(), live_deltas=False)
    add_a2a_routes(app, A2AConfig(name="B", description="the remote agent", cancel_wait=5.0))
    return Live(app)


def serve_holding_b() -> Live:
    """B asks for approval of ``hold``; once approved, ``hold`` waits for the test."""
    return serve(Agent(ScriptedProvider([b_model], repeat_last=True), tools=[hold], store=MemoryStore(),
                       middleware=[HumanApproval(["hold"])], control_poll=0.05))


def continuing_parent(ask: Any, call_id: str, store: Store | None = None) -> Agent:
    """Asks B, then answers B's approval question with a continuation (task_id + decisions)."""
    def second(req: Any) -> Any:
        first = [m for m in req.messages if isinstance(m, ToolResultMessage)][0]
        tid = first.text.split("task_id='")[1].split("'")[0]
        return tool_call_response(ToolUseBlock("c1", "ask", {"message": "ok", "task_id": tid,
                                                             "data": {"decisions": {call_id: {"decision": "approve"}}}}))
    return Agent(ScriptedProvider([tool_call_response(ToolUseBlock("c0", "ask", {"message": "go"})), second,
                                   "parent done"]), tools=[ask], store=store or MemoryStore(), control_poll=0.05)


async def test_a_cancel_of_the_parent_cancels_the_task_it_was_continuing() -> None:
    async with serve_holding_b() as live:
        agent = continuing_parent(remote_agent_tool(await fetch_agent_card(live.base), name="ask"), "h0")
        run = asyncio.ensure_future(agent.run("go", session_id="p"))
        await asyncio.wait_for(GATE["started"].wait(), 15)  # approved by the continuation, holding
        await agent.control("p", Cancel("stop"))
        result = await asyncio.wait_for(run, 20)
        assert result.stop.reason is StopReason.CANCELLED, result.stop
        (b,) = await live.app[STORE_KEY].list_sessions()
        assert b.state == StopReason.CANCELLED.value and GATE["cancelled"] == 1


async def test_an_interrupted_continuation_resumed_after_the_remote_finished_takes_its_result() -> None:
    async with serve_holding_b() as live:
        agent = continuing_parent(remote_agent_tool(await fetch_agent_card(live.base), name="ask"), "h0")
        run = asyncio.ensure_future(agent.run("go", session_id="p"))
        await asyncio.wait_for(GATE["started"].wait(), 15)
        await agent.control("p", Interrupt("pause"))
        assert (await asyncio.wait_for(run, 20)).stop.reason is StopReason.INTERRUPTED
        GATE["release"].set()
        (b,) = await live.app[STORE_KEY].list_sessions()
        async with A2AClient(live.base) as c:
            for _ in range(100):
                if (await c.get_task(b.session_id)).state is TaskState.COMPLETED:
                    break
                await asyncio.sleep(0.05)
            resumed = await asyncio.wait_for(agent.resume("p"), 20)
            assert resumed.stop.reason is StopReason.COMPLETED, resumed.stop
            last = [m for m in resumed.messages if isinstance(m, ToolResultMessage)][-1]
            assert (last.is_error, last.text) == (False, "B finished after released"), last
            assert len(await live.app[STORE_KEY].list_sessions()) == 1
            assert [h["messageId"] for h in (await c.get_task(b.session_id)).history if h["role"] == "ROLE_USER"] \
                == ["fsm-" + ctx_key("p", "c0"), "fsm-" + ctx_key("p", "c1")]
        assert len(await live.app[STORE_KEY].read_events(b.session_id, types=("resume",))) == 1


def ctx_key(session_id: str, call_id: str) -> str:
    from fsm_agent.tools import idempotency_key

    return idempotency_key(session_id, call_id)


async def test_a_cancel_compensates_a_continuation_whose_message_never_arrived() -> None:
    async with serve_holding_b() as live:
        ask = remote_agent_tool(await fetch_agent_card(live.base), name="ask")
        first = await continuing_parent(ask, "h0").run("go", max_iterations=1)  # B waits for its approval
        assert first.stop.reason is StopReason.PAUSED_BUDGET
        (b,) = await live.app[STORE_KEY].list_sessions()
        assert b.state == StopReason.WAITING_HUMAN.value
        assert ask.compensate is not None
        ctx = ToolContext("c9", "never-sent-key", first.session_id, 2, "ask")
        undone = await ask.compensate({"message": "ok", "task_id": b.session_id}, None, ctx)
        assert undone is True
        (b,) = await live.app[STORE_KEY].list_sessions()
        assert b.state == StopReason.CANCELLED.value
        assert GATE["cancelled"] == 0 and not GATE["started"].is_set()


@pytest.mark.parametrize("with_store", [False, True])
async def test_a_remote_task_continued_over_two_calls_is_counted_once(with_store: bool) -> None:
    async with serve(approval_agent(MemoryStore())) as live:
        store = MemoryStore()
        ask = remote_agent_tool(await fetch_agent_card(live.base), name="ask", store=store if with_store else None)
        result = await continuing_parent(ask, "c0", store).run("go", session_id="p")
        assert result.stop.reason is StopReason.COMPLETED, result.stop
        assert RAN == ["a0@x"]
        (b,) = await live.app[STORE_KEY].list_sessions()
        b_usage = Usage()
        for ev in await live.app[STORE_KEY].read_events(b.session_id, types=("model_call",)):
            b_usage = b_usage + Usage(**{k: v for k, v in ev.payload["usage"].items()})
        assert b_usage.input_tokens == 20  # B's two model calls
        rolled = [e.payload for e in await store.read_events("p", types=("usage_rolled_up",))]
        assert [r["child_session_id"] for r in rolled] == [b.session_id, b.session_id]
        assert sum(r["usage"]["input_tokens"] for r in rolled) == b_usage.input_tokens
        assert sum(r["usage"]["output_tokens"] for r in rolled) == b_usage.output_tokens
        assert result.usage.input_tokens == 3 * 10 + b_usage.input_tokens  # the parent's 3 calls, B's once
