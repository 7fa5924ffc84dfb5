"""The server app: background runs, snapshots, the SSE join (replay after N, then live, no gap, no
duplicate, closed after the terminal event), reconnects with Last-Event-ID, problem documents, and a
client that never reads does not slow the run."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from fsm_agent import ScriptedProvider, StopReason, tool
from fsm_agent.agent import Agent
from fsm_agent.providers import tool_call_response
from fsm_agent.server import create_app
from fsm_agent.server.sse import event_json
from fsm_agent.store import SQLiteStore
from fsm_agent.types import ToolUseBlock

DELAY = {"s": 0.0}


@tool
async def slow(n: int) -> str:
    """Wait a little, then answer."""
    await asyncio.sleep(DELAY["s"])
    return f"ok {n}"


def agent_factory(turns: int, runs: int = 1) -> Any:
    def make(store: Any) -> Agent:
        script: list[Any] = [tool_call_response(ToolUseBlock(f"c{i}", "slow", {"n": i})) for i in range(turns)]
        return Agent(ScriptedProvider((script + ["done"]) * runs), tools=[slow], store=store)
    return make


@pytest.fixture(autouse=True)
def _delay():
    DELAY["s"] = 0.0
    yield
    DELAY["s"] = 0.0


async def serve(tmp_path: Any, turns: int = 3, runs: int = 1, **kw: Any) -> tuple[TestClient, Any]:
    store = SQLiteStore(tmp_path / "s.db")
    app = create_app(agent_factory(turns, runs), store, **kw)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    return client, store


def parse(body: bytes) -> list[dict[str, Any]]:
    frames = []
    for raw in body.split(b"\n\n"):
        if not raw:
            continue
        f: dict[str, Any] = {"raw": raw + b"\n\n", "data": []}
        for line in raw.split(b"\n"):
            if line.startswith(b":"):
                f["comment"] = line
            else:
                k, _, v = line.partition(b": ")
                if k == b"data":
                    f["data"].append(v)
                else:
                    f[k.decode()] = v
        frames.append(f)
    return frames


def events_of(frames: list[dict[str, Any]]) -> list[tuple[int, bytes]]:
    return [(int(f["id"]), b"\n".join(f["data"])) for f in frames if "id" in f]


async def wait_state(client: TestClient, sid: str, state: str, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = await client.get(f"/sessions/{sid}")
        snap = await r.json()
        if snap["state"] == state:
            return snap
        await asyncio.sleep(0.02)
    raise AssertionError(f"{sid} did not reach {state}: {snap}")


async def log_bytes(store: Any, sid: str, after: int = 0) -> list[tuple[int, bytes]]:
    return [(e.seq, event_json(e)) for e in await store.read_events(sid, after_seq=after)]


async def test_healthz_create_snapshot_and_list(tmp_path) -> None:
    client, store = await serve(tmp_path, runs=2)
    try:
        assert (await (await client.get("/healthz")).json()) == {"status": "ok"}
        r = await client.post("/sessions", json={"task": "go", "session_id": "s1"})
        assert r.status == 201 and r.headers["Location"] == "/sessions/s1"
        snap = await wait_state(client, "s1", StopReason.COMPLETED.value)
        log = await store.read_events("s1")
        assert snap["last_seq"] == log[-1].seq and snap["pending_approvals"] == [] and snap["stop"]["reason"] == "COMPLETED"
        r = await client.post("/sessions/s2/runs", json={"task": "again"})
        assert r.status == 202 and r.headers["Location"] == "/sessions/s2"
        await wait_state(client, "s2", "COMPLETED")
        listed = await (await client.get("/sessions", params={"state": "COMPLETED"})).json()
        assert {s["session_id"] for s in listed["sessions"]} == {"s1", "s2"}
        none = await (await client.get("/sessions", params={"state": "WAITING_HUMAN"})).json()
        assert none["sessions"] == []
        r = await client.post("/sessions", json={"task": "dup", "session_id": "s1"})
        assert r.status == 409 and r.content_type == "application/problem+json"
    finally:
        await client.close()


@pytest.mark.parametrize("after_kind", ["query", "header"])
async def test_join_after_n_replays_exactly_the_later_events_then_closes(tmp_path, after_kind: str) -> None:
    client, store = await serve(tmp_path)
    try:
        await client.post("/sessions", json={"task": "go", "session_id": "s1"})
        await wait_state(client, "s1", "COMPLETED")
        log = await store.read_events("s1")
        n = len(log) // 2
        if after_kind == "query":
            r = await client.get("/sessions/s1/events", params={"after": str(n)})
        else:
            r = await client.get("/sessions/s1/events", headers={"Last-Event-ID": str(n)})
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        body = await asyncio.wait_for(r.read(), 5)  # the stream closes after the terminal event
        frames = parse(body)
        assert frames[0]["raw"].startswith(b"retry: ")
        got = events_of(frames)
        assert got == await log_bytes(store, "s1", n)
        assert [f["event"] for f in frames if "id" in f] == [e.type.encode() for e in log[n:]]
        assert frames[-1]["event"] == b"run_stopped"
        # joined at the terminal event: nothing to send, closes at once
        r = await client.get("/sessions/s1/events", headers={"Last-Event-ID": str(log[-1].seq)})
        assert events_of(parse(await asyncio.wait_for(r.read(), 5))) == []
    finally:
        await client.close()


async def test_live_join_gets_every_event_once_in_order_then_closes(tmp_path) -> None:
    DELAY["s"] = 0.05
    client, store = await serve(tmp_path, turns=6)
    try:
        await client.post("/sessions", json={"task": "go", "session_id": "s1"})
        r = await client.get("/sessions/s1/events", params={"after": "0"})
        body = await asyncio.wait_for(r.read(), 20)
        got = events_of(parse(body))
        assert got == await log_bytes(store, "s1")
        assert [s for s, _ in got] == list(range(1, len(got) + 1))
        assert parse(body)[-1]["event"] == b"run_stopped"
    finally:
        await client.close()


async def test_reconnect_with_last_event_id_mid_run_loses_and_duplicates_nothing(tmp_path) -> None:
    DELAY["s"] = 0.1
    client, store = await serve(tmp_path, turns=8)
    try:
        await client.post("/sessions", json={"task": "go", "session_id": "s1"})
        received: list[tuple[int, bytes]] = []
        last = 0
        for i, k in enumerate((3, 5, 4)):  # cut the connection after k events, three times
            r = await client.get("/sessions/s1/events", headers={"Last-Event-ID": str(last)})
            buf = b""
            while not (buf.endswith(b"\n\n") and len(events_of(parse(buf))) >= k):  # k whole frames
                line = await asyncio.wait_for(r.content.readline(), 10)
                assert line, "the stream ended before the cut"
                buf += line
            got = events_of(parse(buf))
            assert len(got) == k
            received += got
            last = got[-1][0]
            r.close()  # the client goes away mid-run
            if i == 0:
                snap = await (await client.get("/sessions/s1")).json()
                assert snap["state"] != "COMPLETED"  # really mid-run
        r = await client.get("/sessions/s1/events", headers={"Last-Event-ID": str(last)})
        received += events_of(parse(await asyncio.wait_for(r.read(), 20)))
        assert received == await log_bytes(store, "s1")  # byte for byte, in seq order, each once
    finally:
        await client.close()


async def test_heartbeat_on_idle(tmp_path) -> None:
    DELAY["s"] = 0.6
    client, _ = await serve(tmp_path, turns=1, heartbeat=0.1)
    try:
        await client.post("/sessions", json={"task": "go", "session_id": "s1"})
        r = await client.get("/sessions/s1/events")
        body = await asyncio.wait_for(r.read(), 10)
        assert b"\n: hb\n\n" in body or body.count(b": hb\n\n") >= 1
        assert all("id" not in f for f in parse(body) if "comment" in f)  # a heartbeat carries no id
    finally:
        await client.close()


async def test_problem_documents(tmp_path) -> None:
    client, store = await serve(tmp_path, max_body=1024)
    try:
        cases = [
            (client.post("/sessions", data=b"{not json", headers={"Content-Type": "application/json"}), 400),
            (client.post("/sessions", json={"task": 5}), 400),
            (client.post("/sessions", json=["task"]), 400),
            (client.post("/sessions", json={}), 400),
            (client.post("/sessions", json={"task": "x", "session_id": 3}), 400),
            (client.get("/sessions/nope"), 404),
            (client.get("/sessions/nope/events"), 404),
            (client.post("/sessions/nope/runs", json={}), 404),
            (client.get("/sessions", params={"limit": "x"}), 400),
            (client.post("/sessions", data=b'{"task": "' + b"a" * 4096 + b'"}',
                         headers={"Content-Type": "application/json"}), 413),
        ]
        for req, status in cases:
            r = await req
            assert r.status == status, (status, await r.text())
            assert r.content_type == "application/problem+json"
            doc = orjson.loads(await r.read())
            assert doc["status"] == status and doc["title"] and "type" in doc
        assert await store.list_sessions() == []  # nothing changed
        r = await client.post("/sessions", json={"task": "x", "session_id": "s1"})
        await wait_state(client, "s1", "COMPLETED")
        r = await client.get("/sessions/s1/events", headers={"Last-Event-ID": "abc"})
        assert r.status == 400 and r.content_type == "application/problem+json"
    finally:
        await client.close()


async def test_a_client_that_never_reads_does_not_block_the_run(tmp_path) -> None:
    client, store = await serve(tmp_path, turns=40, send_timeout=0.5)
    try:
        await client.post("/sessions", json={"task": "go", "session_id": "s1"})
        host, port = client.server.host, client.server.port
        sock = socket.create_connection((host, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.sendall(f"GET /sessions/s1/events HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        try:
            t0 = time.monotonic()
            await wait_state(client, "s1", "COMPLETED", timeout=20)
            assert time.monotonic() - t0 < 20
            assert (await store.read_events("s1"))[-1].type == "run_stopped"
        finally:
            sock.close()
    finally:
        await client.close()
