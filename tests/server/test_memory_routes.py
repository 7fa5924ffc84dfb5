"""The memory routes over HTTP: each tenant lists, searches, reads and deletes its own episodes only;
a new session of a tenant recalls that tenant's episodes, and the recall is in its event stream."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import DummyCookieJar
from aiohttp.test_utils import TestClient, TestServer

from fsm_agent import ScriptedProvider
from fsm_agent.agent import Agent
from fsm_agent.errors import StoreError
from fsm_agent.server import create_app
from fsm_agent.server.auth import Tenants
from fsm_agent.server.memory import MEMORY_KEY
from fsm_agent.store import SQLiteEpisodeStore, SQLiteStore
from fsm_agent_middleware.memory import RECALL_HEADER, EpisodicMemory

ALICE_TOKEN, BOB_TOKEN = "tok-aaaaaaaaaaaaaaaaaaaa", "tok-bbbbbbbbbbbbbbbbbbbb"
ALICE = {"Authorization": f"Bearer {ALICE_TOKEN}"}
BOB = {"Authorization": f"Bearer {BOB_TOKEN}"}


async def serve(tmp_path: Path, *, memory: bool = True, store_override: Any = None, cors: tuple[str, ...] = ()
                ) -> tuple[TestClient, ScriptedProvider, SQLiteEpisodeStore]:
    db = tmp_path / "s.db"
    episodes = SQLiteEpisodeStore(db)
    provider = ScriptedProvider(["Done."], repeat_last=True)
    agent = Agent(provider, store=SQLiteStore(db), middleware=[EpisodicMemory(episodes)] if memory else [])
    app = create_app(agent, tenants=Tenants({ALICE_TOKEN: "alice", BOB_TOKEN: "bob"}), cors_origins=cors)
    if store_override is not None:
        app[MEMORY_KEY] = store_override
    client = TestClient(TestServer(app, host="127.0.0.1"), cookie_jar=DummyCookieJar())
    await client.start_server()
    return client, provider, episodes


async def finished(client: TestClient, sid: str, headers: dict[str, str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    snap: dict[str, Any] = {}
    while time.monotonic() < deadline:
        snap = await (await client.get(f"/sessions/{sid}", headers=headers)).json()
        if snap.get("state") == "COMPLETED" and not snap.get("running"):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{sid} did not complete: {snap}")


async def start(client: TestClient, sid: str, task: str, headers: dict[str, str]) -> None:
    r = await client.post("/sessions", json={"task": task, "session_id": sid}, headers=headers)
    assert r.status == 201, await r.text()
    await finished(client, sid, headers)


@pytest.fixture
async def server(tmp_path):
    client, provider, episodes = await serve(tmp_path)
    await start(client, "a1", "Pay invoice 17 to ACME Corp", ALICE)
    await start(client, "a2", "Book a flight to Paris", ALICE)
    await start(client, "b1", "Pay invoice 99 to ACME Corp", BOB)
    yield client, provider
    await client.close()
    await episodes.close()


async def test_each_tenant_lists_its_own_episodes(server) -> None:
    client, _ = server
    r = await client.get("/memory/episodes", headers=ALICE)
    body = await r.json()
    assert r.status == 200 and [e["episode_id"] for e in body["episodes"]] == ["a2", "a1"]
    assert {e["tenant"] for e in body["episodes"]} == {"alice"}
    assert body["episodes"][1]["goal"] == "Pay invoice 17 to ACME Corp" and body["episodes"][1]["outcome"] == "COMPLETED"
    r = await client.get("/memory/episodes?limit=1", headers=BOB)
    assert [e["episode_id"] for e in (await r.json())["episodes"]] == ["b1"]


async def test_search_ranks_the_tenants_episodes_only(server) -> None:
    client, _ = server
    r = await client.get("/memory/episodes", params={"q": "invoice for ACME"}, headers=ALICE)
    hits = (await r.json())["episodes"]
    assert r.status == 200 and [h["episode_id"] for h in hits] == ["a1"] and hits[0]["score"] > 0


async def test_one_episode_is_the_tenants_or_404(server) -> None:
    client, _ = server
    r = await client.get("/memory/episodes/a1", headers=ALICE)
    assert r.status == 200 and (await r.json())["session_id"] == "a1"
    for sid in ("a1", "nope"):  # another tenant's episode answers as one that does not exist
        r = await client.get(f"/memory/episodes/{sid}", headers=BOB)
        assert r.status == 404 and r.content_type == "application/problem+json"
        assert (await r.json())["detail"] == f"no episode {sid!r}"


async def test_delete_one_or_all_of_the_tenants(server) -> None:
    client, _ = server
    r = await client.delete("/memory/episodes/a1", headers=BOB)
    assert r.status == 404
    assert (await client.get("/memory/episodes/a1", headers=ALICE)).status == 200  # untouched
    r = await client.delete("/memory/episodes/a1", headers=ALICE)
    assert r.status == 204
    assert (await client.get("/memory/episodes/a1", headers=ALICE)).status == 404
    assert (await client.delete("/memory/episodes/a1", headers=ALICE)).status == 404
    r = await client.delete("/memory/episodes", headers=ALICE)
    assert r.status == 400 and "all=true" in (await r.json())["detail"]
    r = await client.delete("/memory/episodes?all=true", headers=ALICE)
    assert r.status == 200 and await r.json() == {"deleted": 1}
    assert (await (await client.get("/memory/episodes", headers=ALICE)).json())["episodes"] == []
    assert [e["episode_id"] for e in (await (await client.get("/memory/episodes", headers=BOB)).json())["episodes"]] \
        == ["b1"]


async def test_a_new_session_recalls_its_tenants_episodes_and_the_stream_shows_it(server) -> None:
    client, provider = server
    await start(client, "a3", "Pay invoice 18 to ACME Corp", ALICE)
    request = provider.requests[-1]
    block = next(m.text for m in request.messages if m.text.startswith(RECALL_HEADER))
    assert "Pay invoice 17 to ACME Corp" in block and "invoice 99" not in block  # Bob's is never recalled
    r = await client.get("/sessions/a3/events", headers=ALICE)
    text = await r.text()
    recalled = [orjson.loads(line[len("data: "):]) for chunk in text.split("\n\n") if "event: memory_recalled" in chunk
                for line in chunk.splitlines() if line.startswith("data: ")]
    assert len(recalled) == 1
    assert recalled[0]["type"] == "memory_recalled"
    payload = recalled[0]["payload"]
    assert payload["tenant"] == "alice" and payload["episodes"][0] == "a1" and "b1" not in payload["episodes"]


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/memory/episodes?limit=0", 400), ("GET", "/memory/episodes?limit=x", 400),
    ("GET", "/memory/episodes?sort=up", 400), ("GET", "/memory/episodes?q=", 400),
    ("GET", "/memory/episodes/a1?x=1", 200), ("DELETE", "/memory/episodes/a1?x=1", 400),
])
async def test_bad_queries_are_problems(server, method, path, status) -> None:
    client, _ = server
    r = await client.request(method, path, headers=ALICE)
    assert r.status == status


async def test_no_token_no_memory(server) -> None:
    client, _ = server
    for method, path in (("GET", "/memory/episodes"), ("GET", "/memory/episodes/a1"),
                         ("DELETE", "/memory/episodes/a1"), ("DELETE", "/memory/episodes?all=true")):
        r = await client.request(method, path)
        assert r.status == 401, (method, path)
    assert (await client.get("/memory/episodes/a1", headers=ALICE)).status == 200


async def test_a_server_without_memory_says_so(tmp_path) -> None:
    client, _, episodes = await serve(tmp_path, memory=False)
    r = await client.get("/memory/episodes", headers=ALICE)
    assert r.status == 404 and "memory plugin" in (await r.json())["detail"]
    await client.close()
    await episodes.close()


async def test_a_failing_store_is_a_503(tmp_path) -> None:
    class Down(SQLiteEpisodeStore):
        async def list_episodes(self, **kw):
            raise StoreError(self.location, "memory list", "database is locked", transient=True)

    down = Down(tmp_path / "down.db")
    client, _, episodes = await serve(tmp_path, store_override=down)
    r = await client.get("/memory/episodes", headers=ALICE)
    assert r.status == 503 and r.headers["Retry-After"] == "5" and "database is locked" in (await r.json())["detail"]
    await client.close()
    await episodes.close()
    await down.close()


async def test_a_cors_origin_may_delete_with_a_bearer_token(tmp_path) -> None:
    client, _, episodes = await serve(tmp_path, cors=("https://app.example",))
    await start(client, "a1", "Pay invoice 17", ALICE)
    r = await client.options("/memory/episodes/a1", headers={"Origin": "https://app.example",
                                                             "Access-Control-Request-Method": "DELETE"})
    assert r.status == 204 and "DELETE" in r.headers["Access-Control-Allow-Methods"]
    r = await client.delete("/memory/episodes/a1", headers={**ALICE, "Origin": "https://app.example"})
    assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "https://app.example"
    await client.close()
    await episodes.close()
