"""The A2A server under retries, odd scalars and clients that hang up (findings of a review).

* Integers given as strings are ASCII digits only: ``"²"``, Arabic-Indic digits or 5,000 digits
  are invalid params (-32602), never an internal error (``int()`` raised ValueError).
* Booleans and floats are not enum numbers (``True == 1``): a message whose role is ``true`` or
  ``1.0`` is refused, a status ``false`` is not "unspecified"; a time without a time zone is refused.
* A task's history keeps the ``messageId`` of every message a client sent, the ones that continued
  the task too (a decisions-only message has no transcript message: it is listed as sent).
* A retried message is answered from its record even after the task ended; a message whose
  handling failed half way is applied by its retry (the record is written last), once.
* A blocking SendMessage or a stream whose client hung up stops waiting within about a second.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import aiohttp
import orjson
import pytest

from a2a_peers import Live, rpc, sse_frames, user_message
from fsm_agent import Agent, ScriptedProvider, tool
from fsm_agent.providers import tool_call_response
from fsm_agent.server import create_app
from fsm_agent.server.a2a import COMPLETED, INPUT_REQUIRED, A2AConfig, add_a2a_routes
from fsm_agent.server.app import RUNNER_KEY, STORE_KEY, TAIL_KEY
from fsm_agent.server.auth import Tenants
from fsm_agent.server.runs import RunRequest
from fsm_agent.store import MemoryStore
from fsm_agent.types import ToolResultMessage

from .common import RAN, approval_agent

GATE: dict[str, Any] = {}


@tool
async def hold() -> str:
    """Wait until the test lets go."""
    GATE["started"].set()
    await GATE["release"].wait()
    return "released"


@pytest.fixture(autouse=True)
def _gate() -> None:
    GATE.update(started=asyncio.Event(), release=asyncio.Event())


def holding_agent() -> Agent:
    def model(req: Any) -> Any:
        if isinstance(req.messages[-1], ToolResultMessage):
            return "done after the hold"
        if req.messages[-1].role == "user" and "also" in req.messages[-1].text:
            return "done with the followup too"
        return tool_call_response(("hold", {}))
    return Agent(ScriptedProvider([model], repeat_last=True), tools=[hold], store=MemoryStore())


def serve(agent: Agent | None = None, **config: Any) -> Live:
    agent = agent or Agent(ScriptedProvider(["hello"], repeat_last=True), store=MemoryStore())
    app = create_app(agent, tenants=Tenants(), live_deltas=False)
    add_a2a_routes(app, A2AConfig(name="t", description="d", **{"blocking_timeout": 20.0, **config}))
    return Live(app)


# -- odd scalars ----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["²", "٣", "9" * 5000, "99999999999", "1e3", "0x10", True, 2.0])
async def test_integers_are_integers_or_ascii_digit_strings(value: Any) -> None:
    async with serve() as live, aiohttp.ClientSession() as cs:
        task = (await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("hi", "m1")}))["result"]["task"]
        calls = [("ListTasks", {"pageSize": value}), ("ListTasks", {"historyLength": value}),
                 ("GetTask", {"id": task["id"], "historyLength": value}),
                 ("SendMessage", {"message": user_message("hi", "m2"), "configuration": {"historyLength": value}})]
        for method, params in calls:
            r = await rpc(cs, live.rpc_url, method, params)
            assert r["error"]["code"] == -32602, (method, r)
        ok = await rpc(cs, live.rpc_url, "ListTasks", {"pageSize": " 7 ", "historyLength": "-0"})
        assert ok["result"]["pageSize"] == 7


@pytest.mark.parametrize("role", [True, 1.0, "1", 2, None, "ROLE_AGENT"])
async def test_only_the_user_role_is_a_user_message(role: Any) -> None:
    async with serve() as live, aiohttp.ClientSession() as cs:
        msg = {"messageId": "m-role", "role": role, "parts": [{"text": "x"}]}
        r = await rpc(cs, live.rpc_url, "SendMessage", {"message": msg})
        assert r["error"]["code"] == -32602 and "ROLE_USER" in r["error"]["message"], r
        assert await live.app[STORE_KEY].list_sessions() == []
        for ok_role, mid in (("ROLE_USER", "m-a"), ("user", "m-b"), (1, "m-c")):
            r = await rpc(cs, live.rpc_url, "SendMessage", {"message": {**msg, "role": ok_role, "messageId": mid}})
            assert r["result"]["task"]["status"]["state"] == COMPLETED, (ok_role, r)


@pytest.mark.parametrize("params", [{"status": False}, {"status": 0.0}, {"statusTimestampAfter": "2026-01-01T00:00:00"},
                                    {"statusTimestampAfter": "9999-12-31T23:59:59"},
                                    {"pageToken": base64.urlsafe_b64encode(b'{"ts":"NaN","id":"x"}').decode()},
                                    {"pageToken": base64.urlsafe_b64encode(b'{"ts":"inf","id":"x"}').decode()}])
async def test_list_tasks_refuses_look_alike_values(params: dict[str, Any]) -> None:
    async with serve() as live, aiohttp.ClientSession() as cs:
        r = await rpc(cs, live.rpc_url, "ListTasks", params)
        assert r["error"]["code"] == -32602, r
        ok = await rpc(cs, live.rpc_url, "ListTasks", {"status": 0, "statusTimestampAfter": "2026-01-01T00:00:00Z"})
        assert ok["result"]["tasks"] == []


# -- history --------------------------------------------------------------------------------------
async def test_history_keeps_the_message_ids_of_every_message_the_client_sent() -> None:
    async with serve(holding_agent()) as live, aiohttp.ClientSession() as cs:
        first = await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("go", "m-first"),
                                                            "configuration": {"returnImmediately": True}})
        tid = first["result"]["task"]["id"]
        await asyncio.wait_for(GATE["started"].wait(), 10)
        follow = await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("also this", "m-follow",
                                                                                     taskId=tid),
                                                             "configuration": {"returnImmediately": True}})
        assert "result" in follow, follow
        # queued, not read by the run yet: listed as sent
        queued = (await rpc(cs, live.rpc_url, "GetTask", {"id": tid}))["result"]["history"]
        assert [h["messageId"] for h in queued if h["role"] == "ROLE_USER"] == ["m-first", "m-follow"]
        GATE["release"].set()
        done = (await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("go", "m-first")}))
        assert done["result"]["task"]["status"]["state"] == COMPLETED, done
        history = (await rpc(cs, live.rpc_url, "GetTask", {"id": tid}))["result"]["history"]
        users = [(h["messageId"], h["parts"][0]["text"]) for h in history if h["role"] == "ROLE_USER"]
        assert users == [("m-first", "go"), ("m-follow", "also this")], history


async def test_a_decisions_only_message_is_in_the_history() -> None:
    async with serve(approval_agent(MemoryStore())) as live, aiohttp.ClientSession() as cs:
        task = (await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("mail a0", "m-1")}))["result"]
        tid = task["task"]["id"]
        assert task["task"]["status"]["state"] == INPUT_REQUIRED
        answer = {"messageId": "m-2", "taskId": tid, "role": "ROLE_USER",
                  "parts": [{"data": {"decisions": {"c0": {"decision": "approve"}}}}]}
        done = await rpc(cs, live.rpc_url, "SendMessage", {"message": answer})
        history = done["result"]["task"]["history"]
        assert [h["messageId"] for h in history if h["role"] == "ROLE_USER"] == ["m-1", "m-2"], history
        (sent,) = [h for h in history if h["messageId"] == "m-2"]
        assert sent["parts"] == [{"data": {"decisions": {"c0": {"decision": "approve"}}}}]
        # it sits where it arrived: after the question, before the answer that followed it
        assert history[-1]["role"] == "ROLE_AGENT" and history[-1]["parts"][0]["text"] == "done"
        assert history.index(sent) == len(history) - 2


# -- retries --------------------------------------------------------------------------------------
async def test_a_retry_after_the_task_ended_gets_the_task_not_an_error() -> None:
    async with serve(approval_agent(MemoryStore())) as live, aiohttp.ClientSession() as cs:
        tid = (await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("mail a0", "m-1")}))["result"][
            "task"]["id"]
        answer = {"messageId": "m-2", "taskId": tid, "role": "ROLE_USER",
                  "parts": [{"data": {"decisions": {"c0": {"decision": "approve"}}}}]}
        assert (await rpc(cs, live.rpc_url, "SendMessage", {"message": answer}))["result"]["task"]["status"][
            "state"] == COMPLETED
        for method in ("SendMessage", "SendStreamingMessage"):
            if method == "SendMessage":
                again = await rpc(cs, live.rpc_url, method, {"message": answer})
                assert again["result"]["task"]["status"]["state"] == COMPLETED, again
            else:
                frames = await sse_frames(cs, live.rpc_url, method, {"message": answer})
                assert frames[-1]["data"]["result"]["statusUpdate"]["status"]["state"] == COMPLETED
                assert all("error" not in f["data"] for f in frames)
        assert RAN == ["a0@x"]
        assert len(await live.app[STORE_KEY].read_events(tid, types=("resume",))) == 1


async def test_a_message_whose_handling_failed_half_way_is_applied_by_its_retry() -> None:
    async with serve(approval_agent(MemoryStore())) as live, aiohttp.ClientSession() as cs:
        tid = (await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("mail a0", "m-1")}))["result"][
            "task"]["id"]
        runner = live.app[RUNNER_KEY]
        real, failures = runner.submit, []

        async def submit_fails_once(request: RunRequest) -> None:
            if request.kind == "resume" and not failures:
                failures.append(request)
                raise RuntimeError("queue unavailable")  # after the decision was stored
            await real(request)

        runner.submit = submit_fails_once  # type: ignore[method-assign]
        answer = {"messageId": "m-2", "taskId": tid, "role": "ROLE_USER",
                  "parts": [{"data": {"decisions": {"c0": {"decision": "approve"}}}}]}
        first = await rpc(cs, live.rpc_url, "SendMessage", {"message": answer})
        assert first["error"]["code"] == -32603 and failures, first
        assert (await rpc(cs, live.rpc_url, "GetTask", {"id": tid}))["result"]["status"]["state"] == INPUT_REQUIRED
        retry = await rpc(cs, live.rpc_url, "SendMessage", {"message": answer})
        assert retry["result"]["task"]["status"]["state"] == COMPLETED, retry
        again = await rpc(cs, live.rpc_url, "SendMessage", {"message": answer})
        assert again["result"]["task"]["status"]["state"] == COMPLETED
        assert RAN == ["a0@x"]
        assert len(await live.app[STORE_KEY].read_events(tid, types=("resume",))) == 1


# -- clients that hang up -------------------------------------------------------------------------
async def _hang_up(port: int, body: bytes) -> None:
    """Send a whole request, read nothing, and drop the connection."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /a2a HTTP/1.1\r\nHost: x\r\nA2A-Version: 1.0\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    await asyncio.sleep(0.3)
    writer.transport.abort()


async def test_requests_of_clients_that_hung_up_stop_waiting() -> None:
    async with serve(holding_agent(), blocking_timeout=120.0) as live:
        async with aiohttp.ClientSession() as cs:
            r = await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("go", "m1"),
                                                            "configuration": {"returnImmediately": True}})
            tid = r["result"]["task"]["id"]
        await asyncio.wait_for(GATE["started"].wait(), 10)
        tail = live.app[TAIL_KEY]
        before = len(asyncio.all_tasks())
        blocking = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
                                 "params": {"message": user_message("go", "m1")}})  # a retry: waits for the stop
        subscribe = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "SubscribeToTask", "params": {"id": tid}})
        await asyncio.gather(*[_hang_up(live.port, blocking) for _ in range(20)],
                             *[_hang_up(live.port, subscribe) for _ in range(20)])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 6.0  # the heartbeat is 15 s, the blocking timeout 120 s
        while loop.time() < deadline and (tail.streams or len(asyncio.all_tasks()) > before):
            await asyncio.sleep(0.1)
        assert not tail.streams, len(tail.streams)
        assert len(asyncio.all_tasks()) <= before, (len(asyncio.all_tasks()), before)
        GATE["release"].set()
