"""The server's control and approval routes, the diagram, runs/stream and live deltas, on a
scripted provider: a decision runs the tool once, a repeat returns the first outcome, a
different decision is 409, a decision for a call that is not pending is 404/409 with the reason."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from fsm_agent import ScriptedProvider
from fsm_agent.agent import Agent
from fsm_agent.server import create_app
from fsm_agent.store import SQLiteStore

from . import common
from .common import RAN

def approval_agent(store: Any, calls: int = 1) -> Agent:
    return common.approval_agent(store, calls)


async def serve(tmp_path: Any, factory: Any = approval_agent, **kw: Any) -> tuple[TestClient, Any]:
    store = SQLiteStore(tmp_path / "s.db")
    client = TestClient(TestServer(create_app(factory, store, **kw), host="127.0.0.1"))
    await client.start_server()
    return client, store


async def wait_state(client: TestClient, sid: str, state: str, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    snap: dict[str, Any] = {}
    while time.monotonic() < deadline:
        snap = await (await client.get(f"/sessions/{sid}")).json()
        if snap["state"] == state and not snap["running"]:
            return snap
        await asyncio.sleep(0.02)
    raise AssertionError(f"{sid} did not reach {state}: {snap}")


async def test_approve_runs_the_tool_once_and_a_repeat_returns_the_first_outcome(tmp_path) -> None:
    client, store = await serve(tmp_path)
    try:
        assert (await client.post("/sessions", json={"task": "mail a0", "session_id": "s"})).status == 201
        snap = await wait_state(client, "s", "WAITING_HUMAN")
        assert [p["call"]["id"] for p in snap["pending_approvals"]] == ["c0"] and RAN == []
        r1 = await client.post("/sessions/s/approvals/c0", json={"decision": "approve"})
        assert r1.status == 202, await r1.text()
        first = await r1.json()
        assert first == {"session_id": "s", "call_id": "c0", "decision": "approve", "status": "accepted",
                         "reason": "tool 'send_mail' needs human approval", "round": 0}
        done = await wait_state(client, "s", "COMPLETED")
        assert RAN == ["a0@x"] and done["pending_approvals"] == []
        r2 = await client.post("/sessions/s/approvals/c0", json={"decision": "approve"})
        assert r2.status == 200 and r2.headers["Idempotent-Replayed"] == "true"
        assert await r2.json() == {**first, "replayed": True}
        r3 = await client.post("/sessions/s/approvals/c0", json={"decision": "reject", "message": "no"})
        assert r3.status == 409 and r3.content_type == "application/problem+json"
        assert "already answered" in (await r3.json())["detail"]
        await asyncio.sleep(0.2)
        assert RAN == ["a0@x"]  # nothing ran again
        resumes = await store.read_events("s", types=("resume",))
        assert len(resumes) == 1 and list(resumes[0].payload["decisions"]) == ["c0"]
    finally:
        await client.close()


async def test_concurrent_identical_decisions_run_the_tool_once(tmp_path) -> None:
    client, store = await serve(tmp_path)
    try:
        await client.post("/sessions", json={"task": "mail", "session_id": "s"})
        await wait_state(client, "s", "WAITING_HUMAN")
        rs = await asyncio.gather(*[client.post("/sessions/s/approvals/c0", json={"decision": "approve"})
                                    for _ in range(8)])
        codes = sorted(r.status for r in rs)
        assert codes.count(202) == 1 and codes.count(200) == 7, codes
        await wait_state(client, "s", "COMPLETED")
        assert RAN == ["a0@x"]
    finally:
        await client.close()


async def test_decisions_on_calls_that_are_not_pending(tmp_path) -> None:
    client, store = await serve(tmp_path)
    try:
        await client.post("/sessions", json={"task": "mail", "session_id": "s"})
        await wait_state(client, "s", "WAITING_HUMAN")
        r = await client.post("/sessions/s/approvals/nope", json={"decision": "approve"})
        assert r.status == 404 and "pending: c0" in (await r.json())["detail"]
        r = await client.post("/sessions/s/approvals/c0", json={"decision": "edit", "arguments": {"to": 5}})
        assert r.status == 400 and "to" in (await r.json())["detail"]
        r = await client.post("/sessions/s/approvals/c0", json={"decision": "respond"})
        assert r.status == 400
        r = await client.post("/sessions/s/approvals/c0", json={"decision": "approve"})
        assert r.status == 202
        await wait_state(client, "s", "COMPLETED")
        r = await client.post("/sessions/s/approvals/c9", json={"decision": "approve"})
        assert r.status == 409 and "COMPLETED, not WAITING_HUMAN" in (await r.json())["detail"]
        assert RAN == ["a0@x"]
    finally:
        await client.close()


async def test_edit_runs_the_tool_with_the_new_arguments_and_two_calls_are_decided_one_by_one(tmp_path) -> None:
    client, store = await serve(tmp_path, lambda s: approval_agent(s, calls=2))
    try:
        await client.post("/sessions", json={"task": "mail", "session_id": "s"})
        snap = await wait_state(client, "s", "WAITING_HUMAN")
        assert [p["call"]["id"] for p in snap["pending_approvals"]] == ["c0", "c1"]
        r = await client.post("/sessions/s/approvals/c0", json={"decision": "edit", "arguments": {"to": "b@x"}})
        assert r.status == 202
        r = await client.post("/sessions/s/approvals/c1", json={"decision": "reject", "message": "not him"})
        assert r.status in (202, 409), await r.text()
        if r.status == 409:  # the first decision's run had already taken c1 off the pending list: decide again
            snap = await wait_state(client, "s", "WAITING_HUMAN")
            r = await client.post("/sessions/s/approvals/c1", json={"decision": "reject", "message": "not him"})
            assert r.status == 202
        await wait_state(client, "s", "COMPLETED")
        assert RAN == ["b@x"]
    finally:
        await client.close()


async def test_control_interrupt_steer_and_idempotency_key(tmp_path) -> None:
    client, store = await serve(tmp_path)
    try:
        await client.post("/sessions", json={"task": "mail", "session_id": "s"})
        await wait_state(client, "s", "WAITING_HUMAN")
        r = await client.post("/sessions/s/control", json={"kind": "interrupt"})
        assert r.status == 409 and "nothing to interrupt" in (await r.json())["detail"]
        r = await client.post("/sessions/s/control", json={"kind": "shout"})
        assert r.status == 400
        r = await client.post("/sessions/s/control", json={"kind": "steer"})
        assert r.status == 400
        h = {"Idempotency-Key": "k1"}
        r1 = await client.post("/sessions/s/control", json={"kind": "cancel", "text": "stop it"}, headers=h)
        assert r1.status == 202, await r1.text()
        r2 = await client.post("/sessions/s/control", json={"kind": "cancel", "text": "stop it"}, headers=h)
        assert r2.status == 200 and (await r2.json())["replayed"] is True
        r3 = await client.post("/sessions/s/control", json={"kind": "steer", "text": "x"}, headers=h)
        assert r3.status == 409
        done = await wait_state(client, "s", "CANCELLED")
        assert done["stop"]["reason"] == "CANCELLED" and RAN == []
        controls = await store.read_events("s", types=("control",))
        assert [c.payload["kind"] for c in controls] == ["cancel"]
    finally:
        await client.close()


async def test_diagram_has_the_current_state_and_path(tmp_path) -> None:
    client, store = await serve(tmp_path)
    try:
        await client.post("/sessions", json={"task": "mail", "session_id": "s"})
        await wait_state(client, "s", "WAITING_HUMAN")
        text = await (await client.get("/sessions/s/diagram")).text()
        assert text.startswith("---") and "flowchart TB" in text and "class WAITING_HUMAN s_active" in text
        j = await (await client.get("/sessions/s/diagram", params={"format": "json"})).json()
        moves = [(e.payload["from"], e.payload["trigger"], e.payload["to"])
                 for e in await store.read_events("s", types=("transition",))]
        assert [tuple(m) for m in j["path"]] == moves and j["path"][-1][2] == "WAITING_HUMAN"
        await client.post("/sessions/s/approvals/c0", json={"decision": "approve"})
        await wait_state(client, "s", "COMPLETED")
        text = await (await client.get("/sessions/s/diagram")).text()
        assert "class COMPLETED s_active" in text and "class WAITING_HUMAN s_active" not in text
    finally:
        await client.close()


def frames_of(body: bytes) -> list[dict[str, Any]]:
    out = []
    for raw in body.split(b"\n\n"):
        f: dict[str, Any] = {}
        for line in raw.split(b"\n"):
            k, _, v = line.partition(b": ")
            if k in (b"id", b"event", b"data"):
                f[k.decode()] = v
        if "event" in f:
            out.append(f)
    return out


async def test_runs_stream_sends_the_new_run_with_live_deltas_before_their_message(tmp_path) -> None:
    def factory(store: Any) -> Agent:
        return Agent(ScriptedProvider(["The capital of France is Paris."]), store=store)

    client, store = await serve(tmp_path, factory)
    try:
        r = await client.post("/sessions/s/runs/stream", json={"task": "capital?"})
        assert r.status == 200 and r.headers["Location"] == "/sessions/s/events"
        frames = frames_of(await asyncio.wait_for(r.read(), 10))
        log = await store.read_events("s")
        ids = [int(f["id"]) for f in frames if "id" in f]
        assert ids == [e.seq for e in log]  # every logged event once, in order
        deltas = [i for i, f in enumerate(frames) if f["event"] == b"delta"]
        assert all("id" not in frames[i] for i in deltas)
        assert deltas, "the model's text was not streamed live"
        text = "".join(orjson.loads(frames[i]["data"])["text"] for i in deltas)
        answer = next(i for i, f in enumerate(frames) if f["event"] == b"message"
                      and orjson.loads(f["data"])["payload"]["message"].get("role") == "assistant")
        assert text == "The capital of France is Paris." and max(deltas) < answer
        assert frames[-1]["event"] == b"run_stopped"
    finally:
        await client.close()


async def test_a_resume_with_nothing_to_resume_with_is_refused_and_changes_nothing(tmp_path) -> None:
    client, store = await serve(tmp_path)
    try:
        await client.post("/sessions", json={"task": "mail", "session_id": "s"})
        snap = await wait_state(client, "s", "WAITING_HUMAN")
        r = await client.post("/sessions/s/runs", json={})
        doc = await r.json()
        assert r.status == 409 and "c0" in doc["detail"] and "/approvals/" in doc["detail"]
        assert (await store.get_session("s")).last_seq == snap["last_seq"]
        r = await client.get("/sessions", params={"state": "waiting_human"})
        assert r.status == 400 and "WAITING_HUMAN" in (await r.json())["detail"]
        r = await client.get("/sessions/s/events", headers={"Last-Event-ID": str(snap["last_seq"] + 5)})
        assert r.status == 400 and "past the end" in (await r.json())["detail"]
    finally:
        await client.close()


async def test_live_state_frames_show_each_move_before_its_transition_is_committed(tmp_path) -> None:
    def factory(store: Any) -> Agent:
        return Agent(ScriptedProvider(["The capital of France is Paris."], stream_delay=0.01, chunk_chars=4),
                     store=store)

    client, store = await serve(tmp_path, factory)
    try:
        r = await client.post("/sessions/s/runs/stream", json={"task": "capital?"})
        frames = frames_of(await asyncio.wait_for(r.read(), 10))
        kinds = [(f["event"], "id" in f) for f in frames]
        states = [orjson.loads(f["data"])["to"] for f in frames if f["event"] == b"state"]
        assert all(not has_id for ev, has_id in kinds if ev in (b"state", b"delta"))
        assert "Model" in states  # the move into Model is seen while the answer streams
        first_delta = next(i for i, f in enumerate(frames) if f["event"] == b"delta")
        model_state = next(i for i, f in enumerate(frames) if f["event"] == b"state"
                           and orjson.loads(f["data"])["to"] == "Model")
        logged_move = next(i for i, f in enumerate(frames) if f["event"] == b"transition"
                           and orjson.loads(f["data"])["payload"]["to"] == "Model")
        assert model_state < first_delta < logged_move
        assert frames[-1]["event"] == b"run_stopped"
        assert [int(f["id"]) for f in frames if "id" in f] == [e.seq for e in await store.read_events("s")]
    finally:
        await client.close()


async def test_an_agent_does_not_drive_a_session_it_is_driving_already(tmp_path) -> None:
    """A resume of a session this very agent is driving in this process is refused as busy (it
    used to pass, the lease owner being the agent itself, and two drivers fought over the log)."""
    from fsm_agent import SessionBusyError

    store = SQLiteStore(tmp_path / "s.db")
    gate = asyncio.Event()

    class Gated(ScriptedProvider):
        async def chat_stream(self, request: Any) -> Any:  # type: ignore[override]
            await gate.wait()
            async for ev in super().chat_stream(request):
                yield ev

    agent = Agent(Gated(["done"]), store=store)
    run = asyncio.ensure_future(agent.run("go", session_id="s"))
    try:
        for _ in range(200):
            if (await store.get_session("s")) is not None and agent._active:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(SessionBusyError):
            await agent.check_resume("s")
        gate.set()
        result = await asyncio.wait_for(run, 10)
        assert result.stop.reason.value == "COMPLETED"
    finally:
        gate.set()
        await store.close()
