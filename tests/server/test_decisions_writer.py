"""The approval route and A2A write decisions through the one writer (``fsm_agent.store.decisions``),
over real loopback TCP:

* the same decision posted at once by two clients: one 202, one 200 with the first outcome, the
  tool runs once; different decisions posted at once: one 202, one 409;
* a decision posted while the run waits in process (Hang-Wait) reaches that run;
* a decision taken by the approval route is the one A2A sees: the same answer over A2A applies
  nothing twice, a different one is refused.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from a2a_peers import Live, rpc, user_message
from fsm_agent import RunConfig
from fsm_agent.server import create_app
from fsm_agent.server.a2a import A2AConfig, add_a2a_routes
from fsm_agent.server.app import STORE_KEY
from fsm_agent.server.auth import Tenants
from fsm_agent.store import MemoryStore, SQLiteStore
from fsm_agent.store.decisions import read_question

from .common import RAN, approval_agent


def serve(agent: Any) -> Live:
    app = create_app(agent, tenants=Tenants(), live_deltas=False)
    add_a2a_routes(app, A2AConfig(name="tester", description="a test agent", blocking_timeout=20.0))
    return Live(app)


async def state(cs: aiohttp.ClientSession, base: str, sid: str, want: str) -> dict[str, Any]:
    snap: dict[str, Any] = {}
    for _ in range(2000):
        async with cs.get(f"{base}/sessions/{sid}") as r:
            snap = await r.json()
        if snap["state"] == want and not snap["running"]:
            return snap
        await asyncio.sleep(0.01)
    raise AssertionError(f"{sid} did not reach {want}: {snap}")


async def post(cs: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with cs.post(url, json=body) as r:
        return r.status, await r.json()


async def test_one_decision_posted_by_two_clients_at_once_has_one_outcome(tmp_path: Any) -> None:
    async with serve(approval_agent(SQLiteStore(tmp_path / "s.db"))) as live, \
            aiohttp.ClientSession() as one, aiohttp.ClientSession() as two:
        await post(one, f"{live.base}/sessions", {"task": "mail", "session_id": "s"})
        await state(one, live.base, "s", "WAITING_HUMAN")
        url = f"{live.base}/sessions/s/approvals/c0"
        answers = await asyncio.gather(post(one, url, {"decision": "approve"}), post(two, url, {"decision": "approve"}))
        assert sorted(s for s, _ in answers) == [200, 202], answers
        first = next(b for s, b in answers if s == 202)
        assert next(b for s, b in answers if s == 200) == {**first, "replayed": True}
        await state(one, live.base, "s", "COMPLETED")
        assert RAN == ["a0@x"]


async def test_different_decisions_posted_by_two_clients_at_once_one_wins(tmp_path: Any) -> None:
    async with serve(approval_agent(SQLiteStore(tmp_path / "s.db"))) as live, \
            aiohttp.ClientSession() as one, aiohttp.ClientSession() as two:
        await post(one, f"{live.base}/sessions", {"task": "mail", "session_id": "s"})
        await state(one, live.base, "s", "WAITING_HUMAN")
        url = f"{live.base}/sessions/s/approvals/c0"
        answers = await asyncio.gather(post(one, url, {"decision": "approve"}),
                                       post(two, url, {"decision": "reject", "message": "no"}))
        assert sorted(s for s, _ in answers) == [202, 409], answers
        won = next(b for s, b in answers if s == 202)["decision"]
        assert "already answered" in next(b for s, b in answers if s == 409)["detail"]
        await state(one, live.base, "s", "COMPLETED")
        assert RAN == (["a0@x"] if won == "approve" else [])


async def test_a_decision_posted_while_the_run_waits_in_process_reaches_it() -> None:
    agent = approval_agent(MemoryStore())
    agent.config = RunConfig(approval_timeout=60)
    agent.control_poll = 0.02
    async with serve(agent) as live, aiohttp.ClientSession() as cs:
        await post(cs, f"{live.base}/sessions", {"task": "mail", "session_id": "s"})
        store = live.app[STORE_KEY]
        for _ in range(2000):  # until the run waits (its question is in the log), in the MidTurn phase
            rec = await store.get_session("s")
            if rec is not None and (await read_question(store, rec)).live:
                break
            await asyncio.sleep(0.005)
        async with cs.get(f"{live.base}/sessions/s") as r:
            snap = await r.json()
        assert snap["running"] and snap["state"] != "WAITING_HUMAN"
        status, body = await post(cs, f"{live.base}/sessions/s/approvals/c0",
                                  {"decision": "edit", "arguments": {"to": "z@x"}})
        assert status == 202 and body["decision"] == "edit", body
        await state(cs, live.base, "s", "COMPLETED")
        assert RAN == ["z@x"]
        assert [e.type for e in await store.read_events("s", types=("resume", "run_stopped"))] == ["run_stopped"]


async def test_a2a_sees_the_decision_the_approval_route_took() -> None:
    async with serve(approval_agent(MemoryStore(), calls=2)) as live, aiohttp.ClientSession() as cs:
        out = await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("mail", "m1")})
        tid = out["result"]["task"]["id"]
        status, _ = await post(cs, f"{live.base}/sessions/{tid}/approvals/c0", {"decision": "reject", "message": "no"})
        assert status == 202
        snap = await state(cs, live.base, tid, "WAITING_HUMAN")  # c0 answered; c1 still waits
        assert [p["call"]["id"] for p in snap["pending_approvals"]] == ["c1"]

        def answer(mid: str, c0: dict[str, Any]) -> dict[str, Any]:
            return {"messageId": mid, "taskId": tid, "role": "ROLE_USER",
                    "parts": [{"data": {"decisions": {"c0": c0, "c1": {"decision": "approve"}}}}]}

        refused = await rpc(cs, live.rpc_url, "SendMessage", {"message": answer("m2", {"decision": "approve"})})
        assert refused["error"]["code"] == -32602
        assert "already decided differently (reject)" in refused["error"]["message"]
        assert await live.app[STORE_KEY].idempotency_records(tid, "decision:c1") == {}  # nothing of it stored
        same = {"decision": "reject", "message": "no"}  # the route's decision again: no conflict, nothing twice
        done = await rpc(cs, live.rpc_url, "SendMessage", {"message": answer("m3", same)})
        assert done["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED", done
        assert RAN == ["a1@x"]
