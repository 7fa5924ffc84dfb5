"""``remote_agent_tool`` against fsm_agent's own A2A server (and, for the crash, the SDK's too),
over real loopback TCP.

* Typed results per remote state; usage and cost rolled up once; the remote task linked to the
  parent's call in the store; progress in the parent's log.
* A stream dropped by a proxy mid-run: the reconnect sends Last-Event-ID = the id of the last
  complete frame, and the parent's progress reports are exactly the remote's (none twice, none lost).
* Nothing twice: the parent process SIGKILLed mid-call and resumed in another process makes no
  second remote task (counted on the server), and gets the first task's answer (on_reconcile).
* The parent's Cancel cancels the remote task; its Interrupt leaves it running and the resume
  reattaches; the tool's own timeout cancels it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from a2a_peers import (GATE, DropProxy, Live, SdkExecutor, dechunk, holding_tool, parse_frames, reset_gate, sdk_server,
                       sse_frames, step, user_message)
from fsm_agent import Agent, Cancel, Interrupt, RunConfig, ScriptedProvider, StopReason
from fsm_agent.orchestration.a2a import A2AClient, TaskState, fetch_agent_card, remote_agent_tool
from fsm_agent.providers import tool_call_response
from fsm_agent.server import create_app
from fsm_agent.server.a2a import A2AConfig, add_a2a_routes
from fsm_agent.server.app import STORE_KEY
from fsm_agent.server.auth import Tenants
from fsm_agent.store import MemoryStore, SQLiteStore
from fsm_agent.types import AssistantMessage, MessageResponse, ModelStopReason, TextBlock, ToolResultMessage, ToolUseBlock

from server.common import RAN, approval_agent

WORKER = Path(__file__).with_name("a2a_crash_worker.py")
hold = holding_tool()


@pytest.fixture(autouse=True)
def _gate() -> None:
    reset_gate()
    RAN.clear()


def remote_agent(answer: Any) -> Agent:
    """Agent B, served over A2A; ``answer(request)`` is its model."""
    return Agent(ScriptedProvider([answer], repeat_last=True), tools=[hold, step], store=MemoryStore(),
                 control_poll=0.05)


def holding(request: Any) -> Any:
    """B's model: hold at a tool once, then answer with the tool's result."""
    last = request.messages[-1]
    if isinstance(last, ToolResultMessage):
        return f"B finished after {last.text}"
    return tool_call_response(("hold", {}))


def serve_b(agent: Agent) -> Live:
    app = create_app(agent, tenants=Tenants(), live_deltas=False)
    add_a2a_routes(app, A2AConfig(name="agent B", description="the remote agent", cancel_wait=5.0))
    return Live(app)


def parent(ask: Any, *calls: dict[str, Any], store: Any = None, **kw: Any) -> Agent:
    script: list[Any] = [tool_call_response(ToolUseBlock(f"c{i}", ask.name, c)) for i, c in enumerate(calls)]
    return Agent(ScriptedProvider([*script, "parent done"]), tools=[ask], store=store or MemoryStore(),
                 control_poll=0.05, **kw)


def tool_results(result: Any) -> list[ToolResultMessage]:
    return [m for m in result.messages if isinstance(m, ToolResultMessage)]


async def b_tasks(live: Live) -> list[Any]:
    return await live.app[STORE_KEY].list_sessions()


# -- results ---------------------------------------------------------------------------------------
async def test_a_completed_remote_task_answers_rolls_up_usage_and_is_linked() -> None:
    async with serve_b(remote_agent(lambda r: "B says hi")) as live:
        card = await fetch_agent_card(live.base)
        store = MemoryStore()
        ask = remote_agent_tool(card, store=store)
        assert ask.name == "agent_B" and ask.effect.value == "side_effect" and ask.resumable
        result = await parent(ask, {"message": "hello B"}, store=store).run("go")
        (res,) = tool_results(result)
        assert (res.text, res.is_error) == ("B says hi", False)
        (b,) = await b_tasks(live)
        assert b.state == "COMPLETED"
        events = await store.read_events(result.session_id)
        rolled = [e.payload for e in events if e.type == "usage_rolled_up"]
        assert [(r["usage"]["input_tokens"], r["usage"]["output_tokens"]) for r in rolled] == [(10, 5)]
        assert result.usage.input_tokens == 2 * 10 + 10  # the parent's two calls and B's one, counted once
        (link,) = await store.children(result.session_id)
        assert (link.child_id, link.kind, link.call_id) == (b.session_id, "remote", "c0")
        assert link.metadata == {"url": live.rpc_url, "agent": "agent B"}
        progress = [e.payload["message"] for e in events if e.type == "tool_progress"]
        assert progress[0] == f"remote task {b.session_id} at {live.rpc_url}"


def refusal(request: Any) -> Any:
    return MessageResponse("r", "scripted", AssistantMessage((TextBlock(""),)), ModelStopReason.REFUSAL, "refusal",
                           None, "scripted", refusal="not my job")


async def test_failed_rejected_and_input_required_remote_tasks_are_typed_error_results() -> None:
    from fsm_agent.errors import InvalidRequestError

    for answer, kind, fragment in (
            (lambda r: InvalidRequestError("bad request", status=400), "a2a_failed", "ended FAILED"),
            (refusal, "a2a_rejected", "ended REJECTED: the model refused: not my job")):
        async with serve_b(remote_agent(answer)) as live:
            ask = remote_agent_tool(await fetch_agent_card(live.base), name="ask")
            (res,) = tool_results(await parent(ask, {"message": "x"}).run("go"))
            assert res.is_error and res.metadata == {"error": kind}, res
            assert fragment in res.text and (await b_tasks(live))[0].session_id in res.text

    # B waits for an approval: the parent is told how to answer, and answers with a data part
    async with serve_b(approval_agent(MemoryStore())) as live:
        ask = remote_agent_tool(await fetch_agent_card(live.base), name="ask")

        def answer(request: Any) -> Any:
            first = [m for m in request.messages if isinstance(m, ToolResultMessage)][0]
            tid = first.text.split("task_id='")[1].split("'")[0]
            return tool_call_response(ToolUseBlock("c1", "ask", {"message": "approved", "task_id": tid,
                                                                 "data": {"decisions": {"c0": {"decision": "approve"}}}}))

        agent = Agent(ScriptedProvider([tool_call_response(ToolUseBlock("c0", "ask", {"message": "mail a0"})), answer,
                                        "parent done"]), tools=[ask], store=MemoryStore())
        first, second = tool_results(await agent.run("go"))
        assert first.is_error and first.metadata == {"error": "a2a_input_required"}
        assert "send_mail(c0)" in first.text and '"decisions"' in first.text
        assert (second.text, second.is_error) == ("done", False)
        assert RAN == ["a0@x"] and len(await b_tasks(live)) == 1


# -- a dropped stream ------------------------------------------------------------------------------
async def test_a_dropped_stream_is_resumed_with_last_event_id_and_nothing_is_reported_twice() -> None:
    script = [tool_call_response(("step", {"n": i}), text=f"working on {i}") for i in range(4)]

    def b_model(request: Any) -> Any:
        done = sum(isinstance(m, ToolResultMessage) for m in request.messages)
        if done < 4:
            return script[done]
        if done == 4:
            return tool_call_response(("hold", {}))
        return "all steps done"

    async with serve_b(remote_agent(b_model)) as live, DropProxy(live.port, cut_on=(b"SendStreamingMessage",),
                                                                 cut_after=2500) as proxy:
        raw = (await fetch_agent_card(live.base)).raw
        card = {**raw, "supportedInterfaces": [{**raw["supportedInterfaces"][0], "url": proxy.base + "/a2a"}]}
        store = MemoryStore()
        run = asyncio.ensure_future(parent(remote_agent_tool(card, name="ask"), {"message": "go"}, store=store).run("x"))
        await asyncio.wait_for(GATE["started"].wait(), 10)
        await asyncio.sleep(0.2)
        GATE["release"].set()
        result = await asyncio.wait_for(run, 20)
        (res,) = tool_results(result)
        assert (res.text, res.is_error) == ("all steps done", False)
        assert proxy.cut == 1
        head, body = proxy.delivered[0].split(b"\r\n\r\n", 1)
        assert b"transfer-encoding: chunked" in head.lower()
        received = parse_frames(dechunk(body))
        last_id = received[-1]["id"]
        (resub,) = [r for r in proxy.requests if b"SubscribeToTask" in r]
        assert f"Last-Event-ID: {last_id}".encode() in resub
        (b,) = await b_tasks(live)
        # every WORKING update with a message became one progress report: none twice, none lost
        whole = await sse_frames_of(live, b.session_id)
        want = [f["statusUpdate"]["status"]["message"]["parts"][0]["text"] for f in whole
                if "statusUpdate" in f and f["statusUpdate"]["status"]["state"] == "TASK_STATE_WORKING"
                and "message" in f["statusUpdate"]["status"]]
        got = [e.payload["message"] for e in await store.read_events(result.session_id, types=("tool_progress",))]
        assert got[1:] == want and len(want) == 5
        assert len(received) >= 3 and received[0]["id"] == 0


async def sse_frames_of(live: Live, task_id: str) -> list[dict[str, Any]]:
    import aiohttp

    async with aiohttp.ClientSession() as cs:
        frames = await sse_frames(cs, live.rpc_url, "SubscribeToTask", {"id": task_id}, headers={"Last-Event-ID": "0"})
    return [f["data"]["result"] for f in frames]


# -- nothing twice: a crash mid-call -----------------------------------------------------------------
@pytest.mark.parametrize("remote", ["fsm_agent", "a2a-sdk"])
async def test_a_parent_killed_mid_call_and_resumed_creates_no_second_remote_task(remote: str, tmp_path: Path) -> None:
    db = tmp_path / "parent.db"
    ex = SdkExecutor()

    async def crash_and_resume(card: dict[str, Any], started: Any, release: Any, text: str) -> Any:
        proc = await asyncio.create_subprocess_exec(sys.executable, str(WORKER), str(db), orjson.dumps(card).decode(),
                                                    "p1", text, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            await asyncio.wait_for(started(), 30)
        finally:
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
        assert proc.returncode == -signal.SIGKILL
        await asyncio.sleep(1.3)  # the dead worker's lease (1 s) expires
        store = SQLiteStore(db)
        try:
            ledger = await store.ledger("p1")
            assert ledger["call_remote"].status.value == "started"  # it died in the call
            agent = Agent(ScriptedProvider(["parent done"]), store=store,
                          tools=[remote_agent_tool(card, name="ask_remote", timeout=60, store=store)])
            asyncio.get_running_loop().call_later(0.5, release)
            result = await asyncio.wait_for(agent.resume("p1"), 30)
            ledger = await store.ledger("p1")
            links = await store.children("p1")
            return result, ledger, links
        finally:
            await store.close()

    if remote == "fsm_agent":
        async with serve_b(remote_agent(holding)) as live:
            card = (await fetch_agent_card(live.base)).raw
            result, ledger, links = await crash_and_resume(card, GATE["started"].wait, GATE["release"].set, "hold on")
            tasks = await b_tasks(live)
            assert len(tasks) == 1 and tasks[0].state == "COMPLETED"
            answer = "B finished after released"
            task_id = tasks[0].session_id
    else:
        with sdk_server(ex) as base:
            card = (await fetch_agent_card(base)).raw
            result, ledger, links = await crash_and_resume(card, lambda: asyncio.to_thread(ex.started.wait, 30),
                                                           ex.gate.set, "slow")
            assert len(ex.executed) == 1
            answer = "done"
            task_id = ex.executed[0][0]
    assert result.stop.reason is StopReason.COMPLETED and result.output == "parent done"
    (res,) = tool_results(result)
    assert (res.text, res.is_error) == (answer, False)
    assert ledger["call_remote"].status.value == "completed" and res.metadata == {"reconciled": True}
    assert [(x.child_id, x.kind) for x in links] == [(task_id, "remote")]  # linked by the run that died


# -- cancel, interrupt, timeout ----------------------------------------------------------------------
async def test_the_parents_cancel_cancels_the_remote_task_and_its_interrupt_does_not() -> None:
    async with serve_b(remote_agent(holding)) as live:
        card = await fetch_agent_card(live.base)
        agent = parent(remote_agent_tool(card, name="ask"), {"message": "hold"})
        run = asyncio.ensure_future(agent.run("go", session_id="p-cancel"))
        await asyncio.wait_for(GATE["started"].wait(), 10)
        await agent.control("p-cancel", Cancel("changed my mind"))
        result = await asyncio.wait_for(run, 20)
        assert result.stop.reason is StopReason.CANCELLED, result.stop
        (b,) = await b_tasks(live)
        assert b.state == "CANCELLED" and GATE["cancelled"] == 1
        async with A2AClient(card) as client:
            assert (await client.get_task(b.session_id)).state is TaskState.CANCELED

    GATE.update(started=asyncio.Event(), release=asyncio.Event(), cancelled=0)
    async with serve_b(remote_agent(holding)) as live:
        card = await fetch_agent_card(live.base)
        store = MemoryStore()
        agent = parent(remote_agent_tool(card, name="ask"), {"message": "hold"}, store=store)
        run = asyncio.ensure_future(agent.run("go", session_id="p-int"))
        await asyncio.wait_for(GATE["started"].wait(), 10)
        await agent.control("p-int", Interrupt("pause"))
        paused = await asyncio.wait_for(run, 20)
        assert paused.stop.reason is StopReason.INTERRUPTED
        (b,) = await b_tasks(live)
        assert b.state not in ("CANCELLED", "COMPLETED") and GATE["cancelled"] == 0  # still running remotely
        GATE["release"].set()
        resumed = await asyncio.wait_for(agent.resume("p-int"), 20)
        assert resumed.stop.reason is StopReason.COMPLETED
        results = [r for r in tool_results(resumed) if not r.metadata or "synthetic" not in r.metadata]
        assert results[-1].text == "B finished after released"
        assert len(await b_tasks(live)) == 1  # reattached, not sent again


async def test_the_tools_timeout_cancels_the_remote_task() -> None:
    async with serve_b(remote_agent(holding)) as live:
        ask = remote_agent_tool(await fetch_agent_card(live.base), name="ask", timeout=0.5)
        result = await parent(ask, {"message": "hold"}, config=RunConfig(max_iterations=5)).run("go")
        (res,) = tool_results(result)
        assert res.is_error and res.metadata == {"error": "a2a_timeout"} and "within 0.5 s" in res.text
        (b,) = await b_tasks(live)
        deadline = asyncio.get_running_loop().time() + 10
        while (await live.app[STORE_KEY].get_session(b.session_id)).state != "CANCELLED":
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        assert GATE["cancelled"] == 1


async def test_our_client_keeps_a_direct_stream_of_our_server_whole() -> None:
    """Our client following our server's stream without faults: the answer, the last frame's
    usage, and SubscribeToTask by Last-Event-ID from the client API."""
    async with serve_b(remote_agent(lambda r: "plain answer")) as live, A2AClient(live.base) as client:
        events = [ev async for ev in client.stream_message(user_message("hi", "direct-1"))]
        assert [e.kind for e in events][0] == "task" and events[-1].kind == "status_update"
        assert all(e.event_id is not None for e in events)
        tid = events[0].data["id"]
        replay = [ev async for ev in client.subscribe(tid, last_event_id=events[1].event_id)]
        assert [e.event_id for e in replay] == [e.event_id for e in events[2:]]
        final = await client.get_task(tid)
        assert final.text == "plain answer" and final.metadata["fsm_agent"]["usage"] == {"input_tokens": 10,
                                                                                          "output_tokens": 5}
        assert os.environ.get("A2A_NEVER_SET") is None
