"""The A2A 1.0 JSON-RPC binding of the server (fsm_agent.server.a2a), over real loopback TCP.

* Every StopReason, produced by a real run (ScriptedProvider, approval and policy middleware,
  injected provider errors, an interrupt, a CancelTask), maps to the task state of the design
  note's table, in GetTask and in the stream's last frame.
* SSE frame ids are log seqs; a subscriber that drops mid-stream and reconnects with
  Last-Event-ID gets exactly the frames it missed (counted against an uninterrupted replay).
* The A2A-Version header; a table of hostile inputs, each with its JSON-RPC error, none of which
  creates a session or breaks the server; tenants (another tenant's task is -32001).
* Follow-up messages: approvals as decisions, a paused budget raised, a retried message applied
  once; a retried new message is one task; CancelTask; ListTasks filters and pages.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import aiohttp
import orjson
import pytest

from a2a_peers import A2A, GATE, Live, holding_tool, reset_gate, rpc, sse_frames, step, user_message
from fsm_agent import Agent, Middleware, RunConfig, ScriptedProvider, StopRun
from fsm_agent.errors import InvalidRequestError, ServerError
from fsm_agent.providers import tool_call_response
from fsm_agent.server import create_app
from fsm_agent.server.a2a import (COMPLETED, FAILED, INPUT_REQUIRED, REJECTED, WORKING, A2AConfig, A2ASkill,
                                  add_a2a_routes, event_result, stop_task_state)
from fsm_agent.server.app import STORE_KEY
from fsm_agent.server.auth import Tenants
from fsm_agent.server.runs import SERVER_STOPPING
from fsm_agent.store import MemoryStore
from fsm_agent.types import (AssistantMessage, MessageResponse, ModelStopReason, StopReason, TextBlock,
                             ToolResultMessage)

from .common import RAN, approval_agent, send_mail

CANCELED = "TASK_STATE_CANCELED"
wait_here = holding_tool("wait_here")


@pytest.fixture(autouse=True)
def _gate() -> None:
    reset_gate()


def serve(agent: Agent, *, tenants: Tenants | None = None, live_deltas: bool = False, **config: Any) -> Live:
    app = create_app(agent, tenants=tenants or Tenants(), live_deltas=live_deltas)
    add_a2a_routes(app, A2AConfig(name="tester", description="a test agent", blocking_timeout=20.0,
                                  cancel_wait=5.0, **config))
    return Live(app)


def waiting_agent(**kw: Any) -> Agent:
    """Each new task calls ``wait_here`` first, then answers ``after the wait``."""

    def answer(request: Any) -> Any:
        waited = isinstance(request.messages[-1], ToolResultMessage)
        return "after the wait" if waited else tool_call_response(("wait_here", {}))

    return Agent(ScriptedProvider([answer], repeat_last=True), tools=[wait_here], store=MemoryStore(),
                 control_poll=0.05, **kw)


async def send(cs: aiohttp.ClientSession, url: str, text: str, mid: str, *, immediately: bool = False,
               **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"message": user_message(text, mid, **extra)}
    if immediately:
        params["configuration"] = {"returnImmediately": True}
    out = await rpc(cs, url, "SendMessage", params)
    assert "result" in out, out
    task: dict[str, Any] = out["result"]["task"]
    return task


async def wait_state(cs: aiohttp.ClientSession, url: str, task_id: str, states: set[str],
                     timeout: float = 20.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        task: dict[str, Any] = (await rpc(cs, url, "GetTask", {"id": task_id}))["result"]
        if task["status"]["state"] in states:
            return task
        assert asyncio.get_running_loop().time() < deadline, task["status"]
        await asyncio.sleep(0.05)


# -- the card ---------------------------------------------------------------------------------------
async def test_agent_card_has_the_required_fields_and_is_public_while_the_endpoint_is_not() -> None:
    tenants = Tenants({"token-of-tenant-a-0001": "a"})
    async with serve(Agent(ScriptedProvider(["hi"]), store=MemoryStore()), tenants=tenants,
                     skills=(A2ASkill("math", "math", "does sums", ("math",), ("2+2?",)),)) as live, \
            aiohttp.ClientSession() as cs:
        async with cs.get(live.base + "/.well-known/agent-card.json") as r:
            assert r.status == 200
            card = await r.json()
        assert {"name", "description", "supportedInterfaces", "version", "capabilities", "defaultInputModes",
                "defaultOutputModes", "skills"} <= set(card)
        assert card["supportedInterfaces"] == [{"url": live.rpc_url, "protocolBinding": "JSONRPC",
                                                "protocolVersion": "1.0"}]
        assert card["capabilities"] == {"streaming": True, "pushNotifications": False, "extendedAgentCard": False}
        assert card["skills"] == [{"id": "math", "name": "math", "description": "does sums", "tags": ["math"],
                                   "examples": ["2+2?"]}]
        assert card["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["scheme"] == "Bearer"
        async with cs.post(live.rpc_url, json={"jsonrpc": "2.0", "id": 1, "method": "ListTasks", "params": {}},
                           headers=A2A) as r:
            assert r.status == 401 and "Bearer" in r.headers["WWW-Authenticate"]
        assert await live.app[STORE_KEY].list_sessions() == []


# -- the stop-reason mapping ------------------------------------------------------------------------
class PolicyRefusal(Middleware):
    """Refuses every task (a policy refusal)."""

    def pre_turn(self, ctx: Any) -> None:
        raise StopRun(StopReason.FAILED_TERMINAL, "refused by policy: payments are not handled here",
                      error={"kind": "policy"})


def refusal() -> MessageResponse:
    return MessageResponse("r1", "scripted", AssistantMessage((TextBlock(""),)), ModelStopReason.REFUSAL,
                           "refusal", None, "scripted", refusal="I will not help with that")


CASES: dict[str, tuple[Any, str, str]] = {
    # name: (agent factory, expected state, a fragment of the status message)
    "completed": (lambda: Agent(ScriptedProvider(["all done"]), store=MemoryStore()), COMPLETED, ""),
    "waiting_human": (lambda: approval_agent(MemoryStore()), INPUT_REQUIRED, "send_mail(c0)"),
    "paused_budget": (lambda: Agent(ScriptedProvider([tool_call_response(("step", {"n": 1}))], repeat_last=True),
                                    tools=[step], store=MemoryStore(), config=RunConfig(max_iterations=1)),
                      INPUT_REQUIRED, "iterations budget exhausted"),
    "failed_retryable": (lambda: Agent(ScriptedProvider([ServerError("upstream 503", status=503)]),
                                       store=MemoryStore()),
                         FAILED, "upstream 503"),
    "failed_terminal": (lambda: Agent(ScriptedProvider([InvalidRequestError("bad request: tools[0]", status=400)]),
                                      store=MemoryStore()), FAILED, "bad request"),
    "model_refusal": (lambda: Agent(ScriptedProvider([refusal()]), store=MemoryStore()), REJECTED,
                      "I will not help with that"),
    "policy_refusal": (lambda: Agent(ScriptedProvider(["never"]), store=MemoryStore(), middleware=[PolicyRefusal()]),
                       REJECTED, "refused by policy"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_each_stop_maps_to_its_task_state(case: str) -> None:
    make, state, fragment = CASES[case]
    agent = make()
    async with serve(agent) as live, aiohttp.ClientSession() as cs:
        task = await send(cs, live.rpc_url, "do it", f"m-{case}")
        assert task["status"]["state"] == state, task["status"]
        rec = await live.app[STORE_KEY].get_session(task["id"])
        assert (task["metadata"]["fsm_agent"]["session_state"], rec.state) == (rec.state, rec.state)
        text = "".join(p.get("text", "") for p in task["status"].get("message", {}).get("parts", ()))
        assert fragment in text, text
        if state == COMPLETED:
            assert task["artifacts"] == [{"artifactId": "answer", "name": "answer", "parts": [{"text": "all done"}]}]
            assert "message" not in task["status"]
        # the stream says the same: its last frame (replayed from the log) is the stop
        frames = await sse_frames(cs, live.rpc_url, "SubscribeToTask", {"id": task["id"]},
                                  headers={"Last-Event-ID": "0"})
        last = frames[-1]["data"]["result"]["statusUpdate"]
        assert last["status"]["state"] == state
        assert last["metadata"]["fsm_agent"]["stop_reason"] == rec.state
        if case == "waiting_human":
            data = task["status"]["message"]["parts"][1]["data"]
            assert data["pending_approvals"][0]["call_id"] == "c0"
        if case == "paused_budget":
            assert '"limits"' in text and task["status"]["message"]["parts"][1]["data"] == {"budget": "iterations"}


async def test_interrupted_and_cancelled_map_to_input_required_and_canceled() -> None:
    agent = waiting_agent()
    async with serve(agent) as live, aiohttp.ClientSession() as cs:
        task = await send(cs, live.rpc_url, "wait", "m-int", immediately=True)
        assert task["status"]["state"] in ("TASK_STATE_SUBMITTED", WORKING)
        await asyncio.wait_for(GATE["started"].wait(), 10)
        async with cs.post(f"{live.base}/sessions/{task['id']}/control", json={"kind": "interrupt"}) as r:
            assert r.status == 202
        stopped = await wait_state(cs, live.rpc_url, task["id"], {INPUT_REQUIRED})
        assert "interrupted" in stopped["status"]["message"]["parts"][0]["text"]
        assert (await live.app[STORE_KEY].get_session(task["id"])).state == "INTERRUPTED"
        # a message continues it: its text goes in as a steer and the session resumes (the model
        # calls the tool again, which now lets go)
        GATE["release"].set()
        resumed = (await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message(
            "go on", "m-int2", taskId=task["id"])}))["result"]["task"]
        assert resumed["status"]["state"] == COMPLETED and resumed["artifacts"][0]["parts"][0]["text"] == "after the wait"
        assert any("New direction from the user: go on" in h["parts"][0]["text"] for h in resumed["history"])

        GATE.update(started=asyncio.Event(), release=asyncio.Event())
        task2 = await send(cs, live.rpc_url, "wait", "m-cancel", immediately=True)
        await asyncio.wait_for(GATE["started"].wait(), 10)
        cancelled = (await rpc(cs, live.rpc_url, "CancelTask", {"id": task2["id"]}))["result"]
        assert cancelled["status"]["state"] == CANCELED, cancelled["status"]
        assert (await live.app[STORE_KEY].get_session(task2["id"])).state == "CANCELLED"
        assert GATE["cancelled"] == 2  # both tool calls were cut in flight
        again = await rpc(cs, live.rpc_url, "CancelTask", {"id": task2["id"]})
        assert again["error"]["code"] == -32002 and "CANCELED" in again["error"]["message"]


async def test_cancel_task_ends_a_task_that_waits_for_input() -> None:
    async with serve(approval_agent(MemoryStore())) as live, aiohttp.ClientSession() as cs:
        tid = (await send(cs, live.rpc_url, "mail a0", "m-cw"))["id"]
        out = (await rpc(cs, live.rpc_url, "CancelTask", {"id": tid}))["result"]
        assert out["status"]["state"] == CANCELED, out["status"]
        assert RAN == []  # the pending call never ran
        assert (await live.app[STORE_KEY].get_session(tid)).state == "CANCELLED"


async def test_a_cancel_waiting_on_side_effects_is_confirmed_by_cancel_task() -> None:
    """A cancel (from the REST route) after a side effect without compensation stops WAITING_HUMAN
    to be confirmed: the task says to send CancelTask, a message is refused, CancelTask confirms."""
    agent = Agent(ScriptedProvider([tool_call_response(("send_mail", {"to": "x@y"})),
                                    tool_call_response(("wait_here", {}))]),
                  tools=[send_mail, wait_here], store=MemoryStore(), control_poll=0.05)
    async with serve(agent) as live, aiohttp.ClientSession() as cs:
        tid = (await send(cs, live.rpc_url, "mail then wait", "m-cc", immediately=True))["id"]
        await asyncio.wait_for(GATE["started"].wait(), 10)
        async with cs.post(f"{live.base}/sessions/{tid}/control", json={"kind": "cancel"}) as r:
            assert r.status == 202
        waiting = await wait_state(cs, live.rpc_url, tid, {INPUT_REQUIRED})
        assert "Send CancelTask to confirm the cancel" in waiting["status"]["message"]["parts"][0]["text"]
        refused = await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("go on", "m-cc2", taskId=tid)})
        assert refused["error"]["code"] == -32602 and "CancelTask" in refused["error"]["message"]
        done = (await rpc(cs, live.rpc_url, "CancelTask", {"id": tid}))["result"]
        assert done["status"]["state"] == CANCELED, done["status"]
        assert RAN == ["x@y"]  # the side effect happened once, and stays


def test_the_mapping_covers_every_stop_reason() -> None:
    want = {StopReason.COMPLETED: COMPLETED, StopReason.FAILED_TERMINAL: FAILED, StopReason.FAILED_RETRYABLE: FAILED,
            StopReason.CANCELLED: CANCELED, StopReason.WAITING_HUMAN: INPUT_REQUIRED,
            StopReason.PAUSED_BUDGET: INPUT_REQUIRED, StopReason.INTERRUPTED: INPUT_REQUIRED}
    assert set(want) == set(StopReason)
    for reason, state in want.items():
        assert stop_task_state({"reason": reason.value, "detail": "x"}) == state
    assert stop_task_state({"reason": "FAILED_TERMINAL", "error": {"kind": "refusal"}}) == REJECTED
    assert stop_task_state({"reason": "FAILED_TERMINAL", "error": {"kind": "policy"}}) == REJECTED
    assert stop_task_state({"reason": "FAILED_RETRYABLE", "error": {"kind": "policy"}}) == FAILED
    assert stop_task_state({"reason": "FAILED_TERMINAL", "error": {"kind": "server_error"}}) == FAILED
    # a run the server interrupted on its way down is resumed by the next start: still working
    assert stop_task_state({"reason": "INTERRUPTED", "detail": SERVER_STOPPING}) == WORKING


# -- frames, ids, reconnects ------------------------------------------------------------------------
def multi_step_agent(steps: int) -> Agent:
    script: list[Any] = [tool_call_response(("step", {"n": i}), text=f"doing step {i}") for i in range(steps)]
    return Agent(ScriptedProvider([*script, "finished"]), tools=[step], store=MemoryStore())


async def test_every_frame_id_is_the_seq_of_the_log_event_it_comes_from() -> None:
    agent = multi_step_agent(3)
    async with serve(agent) as live, aiohttp.ClientSession() as cs:
        frames = await sse_frames(cs, live.rpc_url, "SendStreamingMessage",
                                  {"message": user_message("go", "m-ids")}, rid="req-1")
        first = frames[0]
        assert first["id"] == 0 and first["data"]["result"]["task"]["status"]["state"] == "TASK_STATE_SUBMITTED"
        tid = first["data"]["result"]["task"]["id"]
        log = {ev.seq: ev for ev in await live.app[STORE_KEY].read_events(tid)}
        ids = [f["id"] for f in frames[1:]]
        assert ids == sorted(set(ids)) and all(i in log for i in ids)
        for f in frames[1:]:
            assert f["data"]["jsonrpc"] == "2.0" and f["data"]["id"] == "req-1"
            ev = log[f["id"]]
            result = f["data"]["result"]
            if ev.type == "run_stopped":
                assert result["statusUpdate"]["status"]["state"] == COMPLETED
            else:
                assert result == event_result(ev, tid, first["data"]["result"]["task"]["contextId"])
        kinds = Counter(next(iter(f["data"]["result"])) for f in frames)
        assert kinds == {"task": 1, "statusUpdate": 1 + 3 + 1, "artifactUpdate": 3 + 1}
        answers = [f["data"]["result"]["artifactUpdate"] for f in frames if "artifactUpdate" in f["data"]["result"]]
        assert [a["artifact"]["parts"][0]["text"] for a in answers] == ["doing step 0", "doing step 1",
                                                                          "doing step 2", "finished"]
        assert [a["lastChunk"] for a in answers] == [False, False, False, True]
        assert {a["artifact"]["artifactId"] for a in answers} == {"answer"} and not any(a["append"] for a in answers)


@pytest.mark.parametrize("cut", [1, 2, 4, 7])
async def test_a_subscriber_that_drops_gets_exactly_the_missed_frames_with_last_event_id(cut: int) -> None:
    """The run is held at a tool so that frames keep coming after the drop; the reconnect with
    Last-Event-ID = the last id received gives the rest: together exactly an uninterrupted replay."""
    agent = Agent(ScriptedProvider([tool_call_response(("step", {"n": i}), text=f"doing {i}") for i in range(4)]
                                   + [tool_call_response(("wait_here", {}), text="waiting"), "the end"]),
                  tools=[step, wait_here], store=MemoryStore())
    async with serve(agent) as live, aiohttp.ClientSession() as cs:
        before = await sse_frames(cs, live.rpc_url, "SendStreamingMessage", {"message": user_message("go", f"m-{cut}")},
                                  max_frames=cut)
        tid = before[0]["data"]["result"]["task"]["id"]
        await asyncio.wait_for(GATE["started"].wait(), 10)   # more frames were produced after the drop
        GATE["release"].set()
        after = await sse_frames(cs, live.rpc_url, "SubscribeToTask", {"id": tid},
                                 headers={"Last-Event-ID": str(before[-1]["id"])})
        whole = await sse_frames(cs, live.rpc_url, "SubscribeToTask", {"id": tid}, headers={"Last-Event-ID": "0"})
        got = [(f["id"], f["data"]["result"]) for f in before[1:] + after]
        want = [(f["id"], f["data"]["result"]) for f in whole]
        assert got == want, (len(got), len(want))
        assert len(after) == len(whole) - (cut - 1) and len(after) > 0
        assert not [i for i, n in Counter(i for i, _ in got).items() if n > 1]
        assert after[-1]["data"]["result"]["statusUpdate"]["status"]["state"] == COMPLETED


async def test_subscribe_without_last_event_id_is_a_snapshot_then_live_and_refused_when_terminal() -> None:
    agent = waiting_agent()
    async with serve(agent) as live, aiohttp.ClientSession() as cs:
        task = await send(cs, live.rpc_url, "wait", "m-sub", immediately=True)
        await asyncio.wait_for(GATE["started"].wait(), 10)
        reader = asyncio.ensure_future(sse_frames(cs, live.rpc_url, "SubscribeToTask", {"id": task["id"]}))
        await asyncio.sleep(0.2)
        GATE["release"].set()
        frames = await asyncio.wait_for(reader, 10)
        snap = frames[0]["data"]["result"]["task"]
        assert snap["status"]["state"] == WORKING and frames[0]["id"] > 0
        assert frames[-1]["data"]["result"]["statusUpdate"]["status"]["state"] == COMPLETED
        assert all(f["id"] > frames[0]["id"] for f in frames[1:])
        done = await rpc(cs, live.rpc_url, "SubscribeToTask", {"id": task["id"]})
        assert done["error"]["code"] == -32004 and "Last-Event-ID" in done["error"]["message"]
        for bad, fragment in (("abc", "must be an event seq"), ("99999", "past the end")):
            async with cs.post(live.rpc_url, json={"jsonrpc": "2.0", "id": 3, "method": "SubscribeToTask",
                                                   "params": {"id": task["id"]}},
                               headers={**A2A, "Last-Event-ID": bad}) as r:
                err = (await r.json())["error"]
                assert err["code"] == -32602 and fragment in err["message"]


async def test_live_deltas_stream_as_answer_chunks_that_the_logged_message_replaces() -> None:
    agent = Agent(ScriptedProvider(["a long answer streamed in pieces"], chunk_chars=4, stream_delay=0.01),
                  store=MemoryStore())
    async with serve(agent, live_deltas=True) as live, aiohttp.ClientSession() as cs:
        frames = await sse_frames(cs, live.rpc_url, "SendStreamingMessage", {"message": user_message("go", "m-d")})
        arts = [f for f in frames if "artifactUpdate" in f["data"]["result"]]
        chunks = [f["data"]["result"]["artifactUpdate"] for f in arts[:-1]]
        assert len(chunks) >= 3, [f["data"] for f in frames]
        assert chunks[0]["append"] is False and all(c["append"] for c in chunks[1:])
        assert "".join(c["artifact"]["parts"][0]["text"] for c in chunks) == "a long answer streamed in pieces"
        final = arts[-1]["data"]["result"]["artifactUpdate"]
        assert final == {**final, "append": False, "lastChunk": True}
        assert final["artifact"]["parts"] == [{"text": "a long answer streamed in pieces"}]
        ids = [f["id"] for f in frames]
        assert ids == sorted(ids) and all(isinstance(i, int) for i in ids)


# -- version, hostile input ---------------------------------------------------------------------------
async def test_the_version_header() -> None:
    async with serve(Agent(ScriptedProvider(["x"]), store=MemoryStore())) as live, aiohttp.ClientSession() as cs:
        for version in (None, "0.3", "0.3.0", "2.0", "abc", "1.0; drop"):
            out = await rpc(cs, live.rpc_url, "GetTask", {"id": "nope"}, version=version)
            assert out["error"]["code"] == -32009, (version, out)
            assert "A2A-Version: 1.0" in out["error"]["message"]
            assert out["error"]["data"][0]["reason"] == "VERSION_NOT_SUPPORTED"
        missing = await rpc(cs, live.rpc_url, "GetTask", {"id": "nope"}, version=None)
        assert "no A2A-Version header means 0.3" in missing["error"]["message"]
        for version in ("1.0", "1", "1.0.0", "1.1"):
            out = await rpc(cs, live.rpc_url, "GetTask", {"id": "nope"}, version=version)
            assert out["error"]["code"] == -32001, (version, out)  # past the version check


HOSTILE: list[tuple[str, bytes, int, Any, str]] = [
    # (name, raw body, code, id echoed, fragment of the message)
    ("bad json", b'{"jsonrpc": "2.0", "id": 1, "method": ', -32700, None, "not valid JSON"),
    ("not utf-8", b'\xff\xfe{"a"}', -32700, None, "not valid JSON"),
    ("empty body", b"", -32700, None, "empty"),
    ("batch", b'[{"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}}]', -32600, None,
     "batch requests are not supported"),
    ("empty batch", b"[]", -32600, None, "batch"),
    ("a string", b'"hello"', -32600, None, "request object"),
    ("no jsonrpc", b'{"id": 5, "method": "GetTask", "params": {"id": "x"}}', -32600, 5, "'jsonrpc' must be"),
    ("jsonrpc 1.0", b'{"jsonrpc": "1.0", "id": 5, "method": "GetTask"}', -32600, 5, "'jsonrpc' must be"),
    ("id bool", b'{"jsonrpc": "2.0", "id": true, "method": "GetTask"}', -32600, None, "'id' must be"),
    ("id float", b'{"jsonrpc": "2.0", "id": 1.5, "method": "GetTask"}', -32600, None, "'id' must be"),
    ("id huge", b'{"jsonrpc": "2.0", "id": 123456789012345678901234567890, "method": "GetTask"}', -32600, None,
     "'id' must be"),
    ("id object", b'{"jsonrpc": "2.0", "id": {"a": 1}, "method": "GetTask"}', -32600, None, "'id' must be"),
    ("id too long", b'{"jsonrpc": "2.0", "id": "' + b"x" * 300 + b'", "method": "GetTask"}', -32600, None,
     "at most 256"),
    ("notification", b'{"jsonrpc": "2.0", "method": "GetTask", "params": {"id": "x"}}', -32600, None,
     "notifications"),
    ("method number", b'{"jsonrpc": "2.0", "id": 2, "method": 7}', -32600, 2, "'method' must be"),
    ("unknown method", b'{"jsonrpc": "2.0", "id": 2, "method": "DoStuff"}', -32601, 2, "SendMessage"),
    ("0.3 method", b'{"jsonrpc": "2.0", "id": 2, "method": "message/send", "params": {}}', -32601, 2, "PascalCase"),
    ("params array", b'{"jsonrpc": "2.0", "id": 2, "method": "GetTask", "params": ["x"]}', -32602, 2,
     "'params' must be an object"),
    ("missing params", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage"}', -32602, 2,
     "params.message is required"),
    ("get without id", b'{"jsonrpc": "2.0", "id": 2, "method": "GetTask", "params": {}}', -32602, 2,
     "params.id is required"),
    ("task id number", b'{"jsonrpc": "2.0", "id": 2, "method": "GetTask", "params": {"id": 17}}', -32602, 2,
     "params.id is required"),
    ("unknown task", b'{"jsonrpc": "2.0", "id": 2, "method": "GetTask", "params": {"id": "t-none"}}', -32001, 2,
     "no task"),
    ("message not object", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {"message": "hi"}}',
     -32602, 2, "params.message must be a JSON object"),
    ("no messageId", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {"message": '
     b'{"role": "ROLE_USER", "parts": [{"text": "a"}]}}}', -32602, 2, "messageId is required"),
    ("messageId number", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {"message": '
     b'{"messageId": 5, "role": "ROLE_USER", "parts": [{"text": "a"}]}}}', -32602, 2, "messageId must be a string"),
    ("agent role", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {"message": '
     b'{"messageId": "m", "role": "ROLE_AGENT", "parts": [{"text": "a"}]}}}', -32602, 2, "ROLE_USER"),
    ("no parts", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {"message": '
     b'{"messageId": "m", "role": "ROLE_USER", "parts": []}}}', -32602, 2, "non-empty list"),
    ("two kinds in a part", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {"message": '
     b'{"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "a", "url": "http://x"}]}}}', -32602, 2,
     "exactly one of"),
    ("text not string", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {"message": '
     b'{"messageId": "m", "role": "ROLE_USER", "parts": [{"text": ["a"]}]}}}', -32602, 2, "text must be a string"),
    ("image part", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {"message": '
     b'{"messageId": "m", "role": "ROLE_USER", "parts": [{"raw": "iVBORw0K", "mediaType": "image/png"}]}}}',
     -32005, 2, "image/png"),
    ("empty text", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {"message": '
     b'{"messageId": "m", "role": "ROLE_USER", "parts": [{"text": ""}]}}}', -32602, 2, "no text"),
    ("unknown taskId", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {"message": '
     b'{"messageId": "m", "taskId": "t-none", "role": "ROLE_USER", "parts": [{"text": "a"}]}}}', -32001, 2, "no task"),
    ("decisions without task", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {"message": '
     b'{"messageId": "m", "role": "ROLE_USER", "parts": [{"data": {"decisions": {"c": {"decision": "approve"}}}}]}}}',
     -32602, 2, "taskId"),
    ("push config", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {"message": '
     b'{"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "a"}]}, "configuration": '
     b'{"taskPushNotificationConfig": {"url": "http://x"}}}}', -32003, 2, "push notifications"),
    ("output mode", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {"message": '
     b'{"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "a"}]}, "configuration": '
     b'{"acceptedOutputModes": ["image/png"]}}}', -32005, 2, "text/plain"),
    ("negative history", b'{"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {"message": '
     b'{"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "a"}]}, "configuration": {"historyLength": -1}}}',
     -32602, 2, "historyLength"),
    ("page size 0", b'{"jsonrpc": "2.0", "id": 2, "method": "ListTasks", "params": {"pageSize": 0}}', -32602, 2,
     "pageSize"),
    ("bad status", b'{"jsonrpc": "2.0", "id": 2, "method": "ListTasks", "params": {"status": "DONE"}}', -32602, 2,
     "params.status"),
    ("bad page token", b'{"jsonrpc": "2.0", "id": 2, "method": "ListTasks", "params": {"pageToken": "%%%"}}', -32602, 2,
     "pageToken"),
    ("push method", b'{"jsonrpc": "2.0", "id": 2, "method": "CreateTaskPushNotificationConfig", "params": {}}', -32003,
     2, "push notifications"),
    ("extended card", b'{"jsonrpc": "2.0", "id": 2, "method": "GetExtendedAgentCard", "params": {}}', -32004, 2,
     "extended card"),
]


async def test_hostile_inputs_each_get_their_json_rpc_error_and_change_nothing() -> None:
    agent = Agent(ScriptedProvider(["ok"], repeat_last=True), store=MemoryStore())
    async with serve(agent) as live, aiohttp.ClientSession() as cs:
        for name, body, code, rid, fragment in HOSTILE:
            async with cs.post(live.rpc_url, data=body, headers={**A2A, "Content-Type": "application/json"}) as r:
                assert r.status == 200, name
                out = orjson.loads(await r.read())
            assert out["jsonrpc"] == "2.0" and "result" not in out, name
            assert (out["error"]["code"], out["id"]) == (code, rid), (name, out)
            assert fragment in out["error"]["message"], (name, out["error"]["message"])
        async with cs.post(live.rpc_url, data=b"x" * (300 * 1024), headers=A2A) as r:  # over max_body
            out = orjson.loads(await r.read())
            assert out["error"]["code"] == -32600 and "limit" in out["error"]["message"]
        assert await live.app[STORE_KEY].list_sessions() == []  # nothing was created
        task = await send(cs, live.rpc_url, "still serving?", "m-after")
        assert task["status"]["state"] == COMPLETED


# -- tenants ----------------------------------------------------------------------------------------
async def test_another_tenants_task_is_not_found_on_every_method() -> None:
    tenants = Tenants({"token-of-tenant-a-0001": "a", "token-of-tenant-b-0002": "b"})
    a = {"Authorization": "Bearer token-of-tenant-a-0001"}
    b = {"Authorization": "Bearer token-of-tenant-b-0002"}
    async with serve(approval_agent(MemoryStore()), tenants=tenants) as live, aiohttp.ClientSession() as cs:
        out = await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("mail", "m1")}, headers=a)
        tid = out["result"]["task"]["id"]
        assert out["result"]["task"]["status"]["state"] == INPUT_REQUIRED
        for method, params in (("GetTask", {"id": tid}), ("CancelTask", {"id": tid}),
                               ("SubscribeToTask", {"id": tid}),
                               ("SendMessage", {"message": user_message("x", "m2", taskId=tid, parts=[
                                   {"data": {"decisions": {"c0": {"decision": "approve"}}}}])})):
            got = await rpc(cs, live.rpc_url, method, params, headers=b)
            assert got["error"]["code"] == -32001, (method, got)
        listed = (await rpc(cs, live.rpc_url, "ListTasks", {}, headers=b))["result"]
        assert listed["tasks"] == [] and listed["totalSize"] == 0
        # the same messageId from tenant b is its own task, not a's
        other = (await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("mail", "m1")}, headers=b))
        assert other["result"]["task"]["id"] != tid
        assert RAN == []  # b's approval attempt ran nothing
        assert (await rpc(cs, live.rpc_url, "GetTask", {"id": tid}, headers=a))["result"]["status"]["state"] == \
            INPUT_REQUIRED


# -- follow-ups -------------------------------------------------------------------------------------
async def test_approvals_answered_by_a_message_resume_the_session_once() -> None:
    async with serve(approval_agent(MemoryStore())) as live, aiohttp.ClientSession() as cs:
        task = await send(cs, live.rpc_url, "mail a0", "m-ap")
        assert task["status"]["state"] == INPUT_REQUIRED
        tid = task["id"]
        text_only = await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("yes do it", "m-ap2",
                                                                                        taskId=tid)})
        assert text_only["error"]["code"] == -32602 and '"decisions"' in text_only["error"]["message"]
        wrong_call = await rpc(cs, live.rpc_url, "SendMessage", {"message": {
            "messageId": "m-ap3", "taskId": tid, "role": "ROLE_USER",
            "parts": [{"data": {"decisions": {"c9": {"decision": "approve"}}}}]}})
        assert wrong_call["error"]["code"] == -32602 and "pending: c0" in wrong_call["error"]["message"]
        answer = {"messageId": "m-ap4", "taskId": tid, "role": "ROLE_USER",
                  "parts": [{"data": {"decisions": {"c0": {"decision": "approve"}}}}]}
        done = (await rpc(cs, live.rpc_url, "SendMessage", {"message": answer}))["result"]["task"]
        assert done["status"]["state"] == COMPLETED and done["artifacts"][0]["parts"] == [{"text": "done"}]
        assert RAN == ["a0@x"]
        # the same message again (a client's retry, after the task ended): the task as the first
        # one left it, nothing runs again
        again = (await rpc(cs, live.rpc_url, "SendMessage", {"message": answer}))
        assert again["result"]["task"]["status"]["state"] == COMPLETED, again
        assert RAN == ["a0@x"]
        # a new message to the completed task is refused: terminal
        late = {**answer, "messageId": "m-ap5"}
        assert (await rpc(cs, live.rpc_url, "SendMessage", {"message": late}))["error"]["code"] == -32004
        resumes = await live.app[STORE_KEY].read_events(tid, types=("resume",))
        assert len(resumes) == 1


async def test_the_approval_flow_and_a_replay_on_a_sqlite_store(tmp_path: Any) -> None:
    """The same flow with the log and the decisions in SQLite (payloads read back from JSON)."""
    from fsm_agent.store import SQLiteStore

    store = SQLiteStore(tmp_path / "a2a.db")
    async with serve(approval_agent(store)) as live, aiohttp.ClientSession() as cs:
        task = await send(cs, live.rpc_url, "mail a0", "m-sq")
        assert task["status"]["state"] == INPUT_REQUIRED
        assert task["status"]["message"]["parts"][1]["data"]["pending_approvals"][0]["tool"] == "send_mail"
        answer = {"messageId": "m-sq2", "taskId": task["id"], "role": "ROLE_USER",
                  "parts": [{"data": {"decisions": {"c0": {"decision": "approve"}}}}]}
        done = (await rpc(cs, live.rpc_url, "SendMessage", {"message": answer}))["result"]["task"]
        assert done["status"]["state"] == COMPLETED and RAN == ["a0@x"]
        frames = await sse_frames(cs, live.rpc_url, "SubscribeToTask", {"id": task["id"]},
                                  headers={"Last-Event-ID": "0"})
        states = [f["data"]["result"]["statusUpdate"]["status"]["state"] for f in frames
                  if "statusUpdate" in f["data"]["result"]
                  and "metadata" in f["data"]["result"]["statusUpdate"]]
        assert states == [INPUT_REQUIRED, COMPLETED]  # both stops, replayed from the SQLite log
    await store.close()


async def test_an_answer_that_conflicts_with_a_stored_decision_is_refused_every_time() -> None:
    """A decision for the call is stored (as the approvals route stores one) before the A2A answer:
    a different answer is -32602, and so is its retry: a refused message is not marked applied."""
    async with serve(approval_agent(MemoryStore())) as live, aiohttp.ClientSession() as cs:
        tid = (await send(cs, live.rpc_url, "mail a0", "m-x"))["id"]
        reject = {"request": {"call_id": "c0", "decision": {"kind": "reject", "arguments": None,
                                                            "message": "no", "is_error": False}}}
        await live.app[STORE_KEY].claim_idempotency_key(tid, "decision:c0#0", reject)
        answer = {"messageId": "m-x2", "taskId": tid, "role": "ROLE_USER",
                  "parts": [{"data": {"decisions": {"c0": {"decision": "approve"}}}}]}
        for _ in range(2):
            out = await rpc(cs, live.rpc_url, "SendMessage", {"message": answer})
            assert out["error"]["code"] == -32602 and "already decided differently (reject)" in out["error"]["message"]
        assert RAN == [] and await live.app[STORE_KEY].read_events(tid, types=("resume",)) == []


async def test_a_retried_answer_while_waiting_is_applied_once() -> None:
    """Two identical answers sent at once: one resume, the tool runs once."""
    async with serve(approval_agent(MemoryStore())) as live, aiohttp.ClientSession() as cs:
        tid = (await send(cs, live.rpc_url, "mail a0", "m-r"))["id"]
        answer = {"messageId": "m-r2", "taskId": tid, "role": "ROLE_USER",
                  "parts": [{"data": {"decisions": {"c0": {"decision": "approve"}}}}]}
        outs = await asyncio.gather(*(rpc(cs, live.rpc_url, "SendMessage", {"message": answer}, rid=i)
                                      for i in range(3)))
        assert all(o["result"]["task"]["id"] == tid for o in outs), outs
        await wait_state(cs, live.rpc_url, tid, {COMPLETED})
        assert RAN == ["a0@x"]
        assert len(await live.app[STORE_KEY].read_events(tid, types=("resume",))) == 1


async def test_a_paused_budget_is_raised_by_a_limits_data_part() -> None:
    agent = Agent(ScriptedProvider([tool_call_response(("step", {"n": 1})), "finished"]), tools=[step],
                  store=MemoryStore(), config=RunConfig(max_iterations=1))
    async with serve(agent) as live, aiohttp.ClientSession() as cs:
        task = await send(cs, live.rpc_url, "go", "m-b")
        assert task["status"]["state"] == INPUT_REQUIRED
        msg = {"messageId": "m-b2", "taskId": task["id"], "role": "ROLE_USER", "parts": [{"text": "go on"}]}
        refused = await rpc(cs, live.rpc_url, "SendMessage", {"message": msg})
        assert refused["error"]["code"] == -32602 and "limits" in refused["error"]["message"]
        bad = {**msg, "messageId": "m-b3", "parts": [{"data": {"limits": {"max_iterations": -4}}}]}
        assert (await rpc(cs, live.rpc_url, "SendMessage", {"message": bad}))["error"]["code"] == -32602
        ok = {**msg, "messageId": "m-b4", "parts": [{"data": {"limits": {"max_iterations": 5}}}]}
        done = (await rpc(cs, live.rpc_url, "SendMessage", {"message": ok}))["result"]["task"]
        assert done["status"]["state"] == COMPLETED and done["artifacts"][0]["parts"][0]["text"] == "finished"


async def test_a_message_to_a_working_task_is_a_followup() -> None:
    agent = Agent(ScriptedProvider([tool_call_response(("wait_here", {})), "first answer", "second answer"]),
                  tools=[wait_here], store=MemoryStore(), control_poll=0.05)
    async with serve(agent) as live, aiohttp.ClientSession() as cs:
        tid = (await send(cs, live.rpc_url, "wait", "m-f", immediately=True))["id"]
        await asyncio.wait_for(GATE["started"].wait(), 10)
        queued = await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("and also this", "m-f2", taskId=tid),
                                                             "configuration": {"returnImmediately": True}})
        assert queued["result"]["task"]["status"]["state"] == WORKING, queued
        GATE["release"].set()
        done = await wait_state(cs, live.rpc_url, tid, {COMPLETED})
        texts = [h["parts"][0]["text"] for h in done["history"]]
        assert texts == ["wait", "first answer", "and also this", "second answer"]


async def test_the_same_new_message_twice_is_one_task_and_a_changed_one_is_refused() -> None:
    async with serve(Agent(ScriptedProvider(["hello"], repeat_last=True), store=MemoryStore())) as live, \
            aiohttp.ClientSession() as cs:
        one = await send(cs, live.rpc_url, "hi", "same-id")
        two = await send(cs, live.rpc_url, "hi", "same-id")
        assert one["id"] == two["id"] and two["status"]["state"] == COMPLETED
        assert len(await live.app[STORE_KEY].list_sessions()) == 1
        changed = await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("other", "same-id")})
        assert changed["error"]["code"] == -32602 and "already used" in changed["error"]["message"]
        replay = await sse_frames(cs, live.rpc_url, "SendStreamingMessage", {"message": user_message("hi", "same-id")})
        assert replay[0]["data"]["result"]["task"]["id"] == one["id"]
        assert replay[-1]["data"]["result"]["statusUpdate"]["status"]["state"] == COMPLETED
        assert len(await live.app[STORE_KEY].list_sessions()) == 1


async def test_list_tasks_filters_by_context_and_state_and_pages() -> None:
    async with serve(approval_agent(MemoryStore(), repeat_last=True)) as live, aiohttp.ClientSession() as cs:
        ids = []
        for i, ctx in enumerate(["ctx-a", "ctx-a", "ctx-b"]):
            ids.append((await send(cs, live.rpc_url, f"mail {i}", f"m-l{i}", contextId=ctx))["id"])
        in_a = (await rpc(cs, live.rpc_url, "ListTasks", {"contextId": "ctx-a"}))["result"]
        assert {t["id"] for t in in_a["tasks"]} == set(ids[:2]) and in_a["totalSize"] == 2
        assert all("artifacts" not in t for t in in_a["tasks"])
        # the script asks for approval once, then answers "done": one task waits, two completed
        waiting = (await rpc(cs, live.rpc_url, "ListTasks", {"status": INPUT_REQUIRED}))["result"]
        assert [t["id"] for t in waiting["tasks"]] == ids[:1]
        done = (await rpc(cs, live.rpc_url, "ListTasks", {"status": COMPLETED, "includeArtifacts": True}))["result"]
        assert {t["id"] for t in done["tasks"]} == set(ids[1:]) and all(t["artifacts"] for t in done["tasks"])
        seen, token = [], ""
        while True:
            page = (await rpc(cs, live.rpc_url, "ListTasks", {"pageSize": 1, "pageToken": token,
                                                              "historyLength": 0}))["result"]
            assert len(page["tasks"]) == 1 and "history" not in page["tasks"][0]
            seen.append(page["tasks"][0]["id"])
            token = page["nextPageToken"]
            if not token:
                break
        assert sorted(seen) == sorted(ids) and len(seen) == 3
        got = (await rpc(cs, live.rpc_url, "GetTask", {"id": ids[0], "historyLength": 1}))["result"]
        assert len(got["history"]) == 1
