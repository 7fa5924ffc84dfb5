"""Session ids across tenants: no squatting on an A2A task id, no existence oracle, no crash on a
huge seq.

An A2A task's id is derived from the tenant and the client's ``messageId`` (computable by anyone
who can guess a message id, such as ``order-42``). Tenant b used to create that session first over
REST (``POST /sessions`` with a client-chosen id), so tenant a's ``SendMessage`` failed; and the
409 it got for an id of another tenant told it that the task existed. Now the REST routes refuse
``a2a-`` ids for new sessions before looking anything up, and every "exists" answer is the same
for another tenant's session as for one's own.
"""

from __future__ import annotations

import hashlib
from typing import Any

import aiohttp
import orjson
import pytest

from a2a_peers import Live, rpc, user_message
from fsm_agent import Agent, ScriptedProvider
from fsm_agent.server import create_app
from fsm_agent.server.a2a import A2AConfig, add_a2a_routes
from fsm_agent.server.auth import Tenants
from fsm_agent.store import MemoryStore

TOK_A, TOK_B = "token-of-tenant-a-0001", "token-of-tenant-b-0002"
HA, HB = {"Authorization": f"Bearer {TOK_A}"}, {"Authorization": f"Bearer {TOK_B}"}


def serve() -> Live:
    agent = Agent(ScriptedProvider(["hello"], repeat_last=True), store=MemoryStore())
    app = create_app(agent, tenants=Tenants({TOK_A: "a", TOK_B: "b"}), live_deltas=False)
    add_a2a_routes(app, A2AConfig(name="t", description="d"))
    return Live(app)


def task_id(tenant: str, message_id: str) -> str:
    """How the server names the task of a new message (what an attacker can compute)."""
    return "a2a-" + hashlib.sha256(f"{tenant}\0{message_id}".encode()).hexdigest()[:32]


async def answer(cs: aiohttp.ClientSession, method: str, url: str, body: Any, headers: dict[str, str]
                 ) -> tuple[int, Any]:
    async with cs.request(method, url, json=body, headers=headers) as r:
        data = orjson.loads(await r.read())
        return r.status, {k: v for k, v in data.items() if k != "instance"} if isinstance(data, dict) else data


async def test_another_tenant_cannot_take_a_task_id_first() -> None:
    async with serve() as live, aiohttp.ClientSession() as cs:
        victim = task_id("a", "order-42")
        for url, body in ((f"{live.base}/sessions", {"session_id": victim, "task": "squat"}),
                          (f"{live.base}/sessions/{victim}/runs", {"task": "squat"}),
                          (f"{live.base}/sessions/{victim}/runs/stream", {"task": "squat"})):
            status, problem = await answer(cs, "POST", url, body, HB)
            assert status == 400 and "reserved for A2A tasks" in problem["detail"], (url, problem)
        r = await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("real order", "order-42")}, headers=HA)
        assert r["result"]["task"]["id"] == victim
        assert r["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"


async def test_no_answer_tells_another_tenant_whether_a_task_exists() -> None:
    async with serve() as live, aiohttp.ClientSession() as cs:
        r = await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("hi", "m-77")}, headers=HA)
        exists, absent = r["result"]["task"]["id"], task_id("a", "m-never-sent")
        assert exists == task_id("a", "m-77")
        for method, path, body in (("POST", "/sessions", {"task": "x", "session_id": "{id}"}),
                                   ("POST", "/sessions/{id}/runs", {"task": "x"}),
                                   ("POST", "/sessions/{id}/runs", {}),
                                   ("GET", "/sessions/{id}", None)):
            seen = []
            for sid in (exists, absent):
                url = live.base + path.replace("{id}", sid)
                status, problem = await answer(cs, method, url, body and {k: v.replace("{id}", sid)
                                                                          for k, v in body.items()}, HB)
                seen.append((status, problem["title"], problem["detail"].replace(sid, "ID")))
            assert seen[0] == seen[1], (method, path, seen)


async def test_an_id_another_tenant_holds_answers_exactly_like_ones_own() -> None:
    async with serve() as live, aiohttp.ClientSession() as cs:
        status, _ = await answer(cs, "POST", f"{live.base}/sessions", {"task": "x", "session_id": "shared-id"}, HA)
        assert status == 201
        mine = await answer(cs, "POST", f"{live.base}/sessions/shared-id/runs", {"task": "y"}, HA)
        theirs = await answer(cs, "POST", f"{live.base}/sessions/shared-id/runs", {"task": "y"}, HB)
        assert mine == theirs and mine[0] == 409, (mine, theirs)
        mine = await answer(cs, "POST", f"{live.base}/sessions", {"task": "y", "session_id": "shared-id"}, HA)
        theirs = await answer(cs, "POST", f"{live.base}/sessions", {"task": "y", "session_id": "shared-id"}, HB)
        assert mine == theirs and mine[0] == 409, (mine, theirs)


@pytest.mark.parametrize("raw", ["9" * 5000, "9" * 20, "²", "٣"])
async def test_a_huge_or_non_ascii_seq_is_a_400_not_a_crash(raw: str) -> None:
    async with serve() as live, aiohttp.ClientSession() as cs:
        r = await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("hi", "m1")}, headers=HA)
        sid = r["result"]["task"]["id"]
        async with cs.get(f"{live.base}/sessions/{sid}/events", headers={**HA, "Last-Event-ID": raw}) as resp:
            assert resp.status == 400, await resp.text()
        async with cs.get(f"{live.base}/sessions/{sid}/events", params={"after": raw}, headers=HA) as resp:
            assert resp.status == 400, await resp.text()
