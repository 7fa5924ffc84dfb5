"""A2A interoperability with the official ``a2a-sdk`` (1.3, A2A 1.0) as the peer, both ways, over
real loopback TCP.

* The SDK's own client against fsm_agent's server: card resolution, SendMessage (streaming and
  not), GetTask, ListTasks, CancelTask, SubscribeToTask, and its error types for our error codes.
* fsm_agent's client and ``remote_agent_tool`` against a server built with the SDK (its Starlette
  routes run by uvicorn in a thread): a chunked streamed answer, polling, every final and
  interrupted state, a continued INPUT_REQUIRED task, CancelTask on the parent's cancel, and a
  stream dropped by a proxy (the SDK sends no frame ids: the reconnect is a snapshot).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from a2a_peers import GATE, DropProxy, Live, SdkExecutor, holding_tool, reset_gate, sdk_server
from fsm_agent import Agent, Cancel, ScriptedProvider, StopReason
from fsm_agent.orchestration.a2a import (A2AClient, A2ARemoteError, AgentCard, AgentCardError, RemoteTask,
                                         TaskState, fetch_agent_card, remote_agent_tool)
from fsm_agent.providers import tool_call_response
from fsm_agent.server import create_app
from fsm_agent.server.a2a import A2AConfig, add_a2a_routes
from fsm_agent.server.app import STORE_KEY
from fsm_agent.server.auth import Tenants
from fsm_agent.store import MemoryStore
from fsm_agent.types import ToolResultMessage, ToolUseBlock

try:
    import a2a  # noqa: F401 - the official SDK is the test peer: a missing one fails, it does not skip
except ImportError:  # pragma: no cover
    pytest.fail("the official a2a-sdk is the A2A test peer: pip install -e '.[dev]'", pytrace=False)

hold = holding_tool(result="held and released")


@pytest.fixture(autouse=True)
def _gate() -> None:
    reset_gate()


def our_agent() -> Agent:
    """Answers "slow" by holding at a tool; anything else with "hello from fsm_agent"."""

    def answer(request: Any) -> Any:
        last = request.messages[-1]
        if isinstance(last, ToolResultMessage):
            return "released: " + last.text
        if "slow" in last.text:
            return tool_call_response(("hold", {}))
        return "hello from fsm_agent"

    return Agent(ScriptedProvider([answer], repeat_last=True), tools=[hold], store=MemoryStore(), control_poll=0.05)


def our_server(tenants: Tenants | None = None) -> Live:
    app = create_app(our_agent(), tenants=tenants or Tenants(), live_deltas=False)
    add_a2a_routes(app, A2AConfig(name="fsm agent", description="an fsm_agent agent", cancel_wait=5.0))
    return Live(app)


def sdk_message(text: str, mid: str, **kw: Any) -> Any:
    from a2a.types import a2a_pb2 as p

    return p.SendMessageRequest(message=p.Message(message_id=mid, role=p.ROLE_USER, parts=[p.Part(text=text)], **kw))


# -- the SDK's client against our server -------------------------------------------------------------
async def test_the_sdk_client_against_our_server() -> None:
    from a2a.client import ClientConfig, create_client
    from a2a.types import a2a_pb2 as p
    from a2a.utils.errors import TaskNotCancelableError, TaskNotFoundError

    async with our_server() as live:
        client = await create_client(live.base, client_config=ClientConfig(streaming=True))
        assert client._card.name == "fsm agent" and client._card.capabilities.streaming  # the card resolved
        events = [ev async for ev in client.send_message(sdk_message("hi", "sdk-1"))]
        kinds = [ev.WhichOneof("payload") for ev in events]
        assert kinds[0] == "task" and events[0].task.status.state == p.TASK_STATE_SUBMITTED
        assert kinds[-1] == "status_update" and events[-1].status_update.status.state == p.TASK_STATE_COMPLETED
        answers = [ev.artifact_update for ev in events if ev.HasField("artifact_update")]
        assert answers[-1].artifact.parts[0].text == "hello from fsm_agent" and answers[-1].last_chunk
        tid = events[0].task.id

        got = await client.get_task(p.GetTaskRequest(id=tid))
        assert got.status.state == p.TASK_STATE_COMPLETED and got.artifacts[0].parts[0].text == "hello from fsm_agent"
        assert [m.role for m in got.history] == [p.ROLE_USER, p.ROLE_AGENT]
        listed = await client.list_tasks(p.ListTasksRequest())
        assert [t.id for t in listed.tasks] == [tid] and listed.total_size == 1
        with pytest.raises(TaskNotFoundError):
            await client.get_task(p.GetTaskRequest(id="no-such-task"))
        with pytest.raises(TaskNotCancelableError):
            await client.cancel_task(p.CancelTaskRequest(id=tid))

        # a long task: subscribe to it from another client, then cancel it
        slow = client.send_message(sdk_message("slow please", "sdk-2"))
        first = await anext(slow)
        slow_id = first.task.id
        await asyncio.wait_for(GATE["started"].wait(), 10)
        sub = client.subscribe(p.SubscribeToTaskRequest(id=slow_id))
        snapshot = await anext(sub)
        assert snapshot.task.id == slow_id and snapshot.task.status.state == p.TASK_STATE_WORKING
        cancelled = await client.cancel_task(p.CancelTaskRequest(id=slow_id))
        assert cancelled.status.state == p.TASK_STATE_CANCELED
        rest = [ev async for ev in sub]
        assert rest[-1].status_update.status.state == p.TASK_STATE_CANCELED
        assert [ev async for ev in slow][-1].status_update.status.state == p.TASK_STATE_CANCELED
        assert GATE["cancelled"] == 1
        await client.close()

        # non-streaming: one SendMessage, answered when the task is done
        blocking = await create_client(live.base, client_config=ClientConfig(streaming=False))
        (only,) = [ev async for ev in blocking.send_message(sdk_message("hi again", "sdk-3"))]
        assert only.task.status.state == p.TASK_STATE_COMPLETED
        assert only.task.artifacts[0].parts[0].text == "hello from fsm_agent"
        await blocking.close()


async def test_the_sdk_client_with_a_token_and_our_tenants() -> None:
    from a2a.client import A2AClientError, ClientConfig, create_client

    tenants = Tenants({"token-of-the-sdk-0001": "sdk"})
    async with our_server(tenants) as live:
        authed = httpx.AsyncClient(headers={"Authorization": "Bearer token-of-the-sdk-0001"})
        client = await create_client(live.base, client_config=ClientConfig(streaming=True, httpx_client=authed))
        events = [ev async for ev in client.send_message(sdk_message("hi", "tok-1"))]
        assert events[-1].status_update.status.state == 3  # TASK_STATE_COMPLETED
        rec = await live.app[STORE_KEY].get_session(events[0].task.id)
        assert rec.metadata["tenant"] == "sdk"
        await authed.aclose()
        anonymous = await create_client(live.base, client_config=ClientConfig(streaming=False))
        with pytest.raises(A2AClientError, match="401"):
            [ev async for ev in anonymous.send_message(sdk_message("hi", "tok-2"))]
        await anonymous.close()


# -- our client against the SDK's server -------------------------------------------------------------
def parent(tool_: Any, *calls: dict[str, Any]) -> Agent:
    """A parent that calls ``tool_`` with each of ``calls`` in turn, then answers "parent done"."""
    script: list[Any] = [tool_call_response(ToolUseBlock(f"c{i}", tool_.name, c)) for i, c in enumerate(calls)]
    return Agent(ScriptedProvider([*script, "parent done"]), tools=[tool_], store=MemoryStore(), control_poll=0.05)


def results(result: Any) -> list[ToolResultMessage]:
    return [m for m in result.messages if isinstance(m, ToolResultMessage)]


async def test_our_client_reads_the_sdk_card_and_follows_a_chunked_stream() -> None:
    ex = SdkExecutor()
    with sdk_server(ex) as base:
        card = await fetch_agent_card(base)
        assert (card.name, card.streaming, card.protocol_version, card.url) == ("sdk agent", True, "1.0", base + "/")
        ask = remote_agent_tool(card)
        assert ask.name == "sdk_agent" and "official a2a-sdk" in ask.description
        agent = parent(ask, {"message": "echo hello world"})
        result = await agent.run("use the remote")
        (res,) = results(result)
        assert not res.is_error and res.text == "echo: hello world"  # seven 3-char chunks appended
        assert result.output == "parent done"
        assert len(ex.executed) == 1
        events = await agent.store.read_events(result.session_id)
        rolled = [e.payload for e in events if e.type == "usage_rolled_up"]
        assert len(rolled) == 1 and rolled[0]["usage"]["input_tokens"] == 7 and rolled[0]["cost_usd"] == 0.002
        progress = [e.payload["message"] for e in events if e.type == "tool_progress"]
        assert progress[0] == f"remote task {ex.executed[0][0]} at {base}/"

        async with A2AClient(base) as client:
            task = await client.get_task(ex.executed[0][0])
            assert task.state is TaskState.COMPLETED and task.text == "echo: hello world"
            tasks, token = await client.list_tasks(context_id=task.context_id)
            assert [t.id for t in tasks] == [task.id] and token == ""
            assert task.context_id.startswith("fsm-ctx-")  # the tool's deterministic context


async def test_our_client_polls_a_server_without_streaming() -> None:
    ex = SdkExecutor()
    with sdk_server(ex, streaming=False) as base:
        ask = remote_agent_tool(await fetch_agent_card(base), name="ask", poll_interval=0.05)
        result = await parent(ask, {"message": "echo polled"}).run("go")
        assert results(result)[0].text == "echo: polled" and not results(result)[0].is_error


@pytest.mark.parametrize(("word", "kind", "fragment"), [
    ("fail", "a2a_failed", "ended FAILED: boom"),
    ("reject", "a2a_rejected", "ended REJECTED: not allowed"),
])
async def test_failed_and_rejected_remote_tasks_are_error_results_naming_the_state(word: str, kind: str,
                                                                                   fragment: str) -> None:
    ex = SdkExecutor()
    with sdk_server(ex) as base:
        ask = remote_agent_tool(await fetch_agent_card(base), name="ask")
        (res,) = results(await parent(ask, {"message": word}).run("go"))
        assert res.is_error and res.metadata == {"error": kind}
        assert fragment in res.text and ex.executed[0][0] in res.text


async def test_an_input_required_remote_task_is_continued_with_its_task_id() -> None:
    ex = SdkExecutor()
    with sdk_server(ex) as base:
        ask = remote_agent_tool(await fetch_agent_card(base), name="ask")

        def second(request: Any) -> Any:
            first = results_of(request)[0]
            tid = first.text.split("task_id='")[1].split("'")[0]
            return tool_call_response(ToolUseBlock("c1", "ask", {"message": "blue", "task_id": tid}))

        def results_of(request: Any) -> list[ToolResultMessage]:
            return [m for m in request.messages if isinstance(m, ToolResultMessage)]

        agent = Agent(ScriptedProvider([tool_call_response(ToolUseBlock("c0", "ask", {"message": "ask me"})), second,
                                        "parent done"]), tools=[ask], store=MemoryStore())
        result = await agent.run("go")
        first, answer = results(result)
        assert first.is_error and first.metadata == {"error": "a2a_input_required"}
        assert "which color?" in first.text and "call ask again with task_id=" in first.text
        assert not answer.is_error and answer.text == "you said blue"
        assert [t for t, _ in ex.executed] == [ex.executed[0][0]] * 2  # one remote task, continued


async def test_cancelling_the_parent_cancels_the_remote_task() -> None:
    ex = SdkExecutor()
    with sdk_server(ex) as base:
        ask = remote_agent_tool(await fetch_agent_card(base), name="ask")
        agent = parent(ask, {"message": "slow"})
        run = asyncio.ensure_future(agent.run("go", session_id="p-cancel"))
        await asyncio.to_thread(ex.started.wait, 10)
        await agent.control("p-cancel", Cancel("the user changed their mind"))
        result = await asyncio.wait_for(run, 20)
        tid = ex.executed[0][0]
        assert ex.cancelled == [tid]  # the SDK executor's cancel ran: CancelTask reached it
        async with A2AClient(base) as client:
            assert (await client.get_task(tid)).state is TaskState.CANCELED
        # the call was compensated by CancelTask: the parent ends CANCELLED, nothing to confirm
        assert result.stop.reason is StopReason.CANCELLED, result.stop  # on_compensate canceled it


@pytest.mark.parametrize("cut_after", [200, 1200])
async def test_a_dropped_stream_from_the_sdk_server_is_followed_by_a_resubscribe(cut_after: int) -> None:
    """Cut inside the first frame (the task's id unknown: the tool finds it by its context) or
    after a few frames (it resubscribes by id)."""
    ex = SdkExecutor()
    with sdk_server(ex) as base:
        raw = (await fetch_agent_card(base)).raw
        port = int(base.rsplit(":", 1)[1])
        async with DropProxy(port, cut_on=(b"SendStreamingMessage",), cut_after=cut_after) as proxy:
            card = {**raw, "supportedInterfaces": [{**raw["supportedInterfaces"][0], "url": proxy.base + "/"}]}
            ask = remote_agent_tool(card, name="ask")
            run = asyncio.ensure_future(parent(ask, {"message": "slow"}).run("go"))
            await asyncio.to_thread(ex.started.wait, 10)
            await asyncio.sleep(0.3)
            ex.gate.set()
            result = await asyncio.wait_for(run, 20)
        (res,) = results(result)
        assert not res.is_error and res.text == "done"
        assert proxy.cut == 1
        methods = [r for r in proxy.requests if b"SubscribeToTask" in r]
        assert methods and b"Last-Event-ID" not in methods[0]  # the SDK gave no ids: a snapshot reconnect
        assert len(ex.executed) == 1  # no second task


async def test_cards_our_client_refuses() -> None:
    with pytest.raises(AgentCardError, match="an A2A 0.3.0 card .* speaks A2A 1.0 only"):
        AgentCard.parse({"name": "old", "url": "http://x/", "protocolVersion": "0.3.0"})
    with pytest.raises(AgentCardError, match="no JSONRPC interface of A2A 1.x"):
        AgentCard.parse({"name": "grpc", "supportedInterfaces": [{"url": "x", "protocolBinding": "GRPC",
                                                                   "protocolVersion": "1.0"}]})
    with pytest.raises(AgentCardError, match="HTTP 404"):
        async with our_server() as live:
            await fetch_agent_card(live.base + "/nothing/here.json")
    with pytest.raises(AgentCardError, match="cannot fetch"):
        await fetch_agent_card("http://127.0.0.1:9")
    async with our_server() as live, A2AClient(live.base) as client:
        with pytest.raises(A2ARemoteError) as info:
            await client.get_task("nope")
        assert info.value.code == -32001 and info.value.reason == "TASK_NOT_FOUND"
        done = await client.send_message({"messageId": "x1", "role": "ROLE_USER", "parts": [{"text": "hi"}]})
        assert isinstance(done, RemoteTask) and done.text == "hello from fsm_agent"
