"""The server's task mode and session permissions (issue 23 items 1 and 8): ``POST /sessions`` with a
task definition and permissions, a tenant's default permissions, and the control route's
``restrict`` and ``request_permissions``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp.test_utils import TestClient, TestServer

from fsm_agent import Permissions, ScriptedProvider, tool
from fsm_agent.agent import Agent
from fsm_agent.providers import tool_call_response
from fsm_agent.server import create_app
from fsm_agent.server.auth import Tenants
from fsm_agent.store import SQLiteStore
from fsm_agent.types import ToolUseBlock
from fsm_agent_middleware.approval import HumanApproval

from .common import RAN, send_mail

TOKEN = "acme-token-0123456789"
CITY_TASK = {"goal": "Find the largest city of France and its population.",
             "output_schema": {"name": "city", "schema": {
                 "type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
                 "required": ["name", "population"], "additionalProperties": False}},
             "check": [{"name": "a real population", "value": "output.population", "gt": 1000000}]}


@tool
def lookup(country: str) -> str:
    """Look a country up.

    Args:
        country: its name.
    """
    RAN.append(f"lookup {country}")
    return "Paris, 2102650"


async def serve(tmp_path: Any, script: list[Any], *, tenants: Tenants | None = None,
                approval: bool = False) -> tuple[TestClient, Any]:
    store = SQLiteStore(tmp_path / "s.db")

    def factory(store: Any) -> Agent:
        return Agent(ScriptedProvider(script), tools=[lookup, send_mail], store=store,
                     middleware=[HumanApproval(["send_mail"])] if approval else [])

    client = TestClient(TestServer(create_app(factory, store, tenants=tenants), host="127.0.0.1"))
    await client.start_server()
    return client, store


async def wait_state(client: TestClient, sid: str, state: str, headers: Any = None) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    snap: dict[str, Any] = {}
    while time.monotonic() < deadline:
        snap = await (await client.get(f"/sessions/{sid}", headers=headers)).json()
        if snap["state"] == state and not snap["running"]:
            return snap
        await asyncio.sleep(0.02)
    raise AssertionError(f"{sid} did not reach {state}: {snap}")


async def test_post_sessions_with_a_task_definition_runs_it_as_a_task(tmp_path: Any) -> None:
    answer = orjson.dumps({"name": "Paris", "population": 2102650}).decode()
    client, store = await serve(tmp_path, [orjson.dumps({"name": "Paris", "population": 3}).decode(), answer])
    try:
        r = await client.post("/sessions", json={"task": CITY_TASK, "session_id": "t1"})
        assert r.status == 201, await r.text()
        assert (await r.json())["goal"] == CITY_TASK["goal"]
        snap = await wait_state(client, "t1", "COMPLETED")
        result = snap["task"]["result"]
        assert result["outcome"] == "succeeded" and result["output"] == {"name": "Paris", "population": 2102650}
        assert result["checks"] == [{"name": "a real population", "ok": True, "reason": "'output.population' gt 1000000"}]
        assert snap["task"]["definition"]["goal"] == CITY_TASK["goal"]
        assert snap["permissions"] is None  # no tenant default, none asked for
    finally:
        await client.close()


async def test_a_bad_task_or_permissions_is_a_400_naming_every_problem(tmp_path: Any) -> None:
    client, _ = await serve(tmp_path, ["x"])
    try:
        r = await client.post("/sessions", json={"task": {"goal": "", "check": [{"name": "a", "value": "output",
                                                                                  "gt": "big"}]}})
        assert r.status == 400
        detail = (await r.json())["detail"]
        assert "'goal' must say what to do" in detail and "'gt' needs a number" in detail
        r = await client.post("/sessions", json={"task": {**CITY_TASK, "check": [{"name": "x", "python": "os:system"}]}})
        assert r.status == 400 and "cannot name Python code" in (await r.json())["detail"]
        r = await client.post("/sessions", json={"task": "hi", "permissions": {"tools": 3}})
        assert r.status == 400 and "'tools' must be a tool name" in (await r.json())["detail"]
        assert (await client.get("/sessions")).status == 200
        assert (await (await client.get("/sessions")).json())["sessions"] == []  # nothing was stored
    finally:
        await client.close()


async def test_a_tenants_default_permissions_are_narrowed_by_the_request_never_widened(tmp_path: Any) -> None:
    tenants = Tenants({TOKEN: "acme"}, permissions={"acme": Permissions(tools=["lookup"])})
    script = [tool_call_response(ToolUseBlock("c1", "send_mail", {"to": "x@y"}),
                                 ToolUseBlock("c2", "lookup", {"country": "France"})), "done"]
    client, store = await serve(tmp_path, script, tenants=tenants)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        r = await client.post("/sessions", json={"task": "go", "session_id": "p1",
                                                 "permissions": {"tools": ["lookup", "send_mail"]}}, headers=auth)
        assert r.status == 201
        snap = await wait_state(client, "p1", "COMPLETED", auth)
        assert RAN == ["lookup France"]  # send_mail: the request asked for it, the tenant does not allow it
        denied = [e.payload for e in await store.read_events("p1") if e.type == "permission_denied"]
        assert [(d["call_id"], d["permission"]) for d in denied] == [("c1", "tools")]
        assert snap["permissions"]["tools"] == ["lookup"]
        assert snap["permissions"]["restriction"][0]["tools"] == ["lookup", "send_mail"]
    finally:
        await client.close()


async def test_the_control_route_restricts_and_requests_permissions(tmp_path: Any) -> None:
    script = [tool_call_response(ToolUseBlock("c0", "send_mail", {"to": "a@x"})),
              tool_call_response(ToolUseBlock("c1", "lookup", {"country": "France"})), "done"]
    client, store = await serve(tmp_path, script, approval=True)
    try:
        r = await client.post("/sessions", json={"task": "go", "session_id": "w",
                                                 "permissions": {"tools": ["send_mail", "lookup"]}})
        assert r.status == 201
        await wait_state(client, "w", "WAITING_HUMAN")
        r = await client.post("/sessions/w/control", json={"kind": "restrict", "restriction": {"tools": ["lookup"]},
                                                           "reason": "mail is off"})
        assert r.status == 202 and (await r.json())["status"] == "queued"
        r = await client.post("/sessions/w/control", json={"kind": "request_permissions",
                                                           "permissions": {"tools": ["lookup", "send_mail"]},
                                                           "reason": "mail is needed after all"})
        assert r.status == 202
        assert (await client.get("/sessions/w")).status == 200
        await asyncio.sleep(0.1)
        assert (await (await client.get("/sessions/w")).json())["state"] == "WAITING_HUMAN"  # neither ran it
        r = await client.post("/sessions/w/approvals/c0", json={"decision": "approve"})
        assert r.status == 202
        snap = await wait_state(client, "w", "WAITING_HUMAN")
        assert RAN == []  # the approved mail was outside the narrowed permissions
        (request,) = snap["pending_approvals"]
        assert request["call"]["name"] == "request_permissions"
        assert request["call"]["input"]["reason"] == "mail is needed after all"
        r = await client.post(f"/sessions/w/approvals/{request['call']['id']}", json={"decision": "approve"})
        assert r.status == 202, await r.text()
        snap = await wait_state(client, "w", "COMPLETED")
        assert RAN == ["lookup France"]
        kinds = [e.type for e in await store.read_events("w") if e.type.startswith("permission")]
        assert kinds == ["permissions_narrowed", "permission_denied", "permissions_requested", "permissions_widened"]
        r = await client.post("/sessions/w/control", json={"kind": "restrict"})
        assert r.status == 400
        r = await client.post("/sessions/w/control", json={"kind": "steer", "text": "x", "restriction": {}})
        assert r.status == 400
    finally:
        await client.close()


def test_tenant_permissions_are_read_from_a_file_and_name_known_tenants_only(tmp_path: Any) -> None:
    import pytest

    from fsm_agent import ConfigurationError, PermissionsError

    path = tmp_path / "tenants.toml"
    path.write_text('[acme]\ntools = ["lookup"]\n[[acme.scope]]\ntool = "lookup"\narg = "country"\nin = ["France"]\n')
    perms = Tenants.read_permissions(path)
    tenants = Tenants({TOKEN: "acme"})
    tenants.set_permissions(perms)
    acme = tenants.permissions_for("acme")
    assert acme is not None and acme.allows("lookup", {"country": "France"})
    assert not acme.allows("lookup", {"country": "Spain"}) and tenants.permissions_for("other") is None
    with pytest.raises(ConfigurationError, match="no token names: beta"):
        Tenants({TOKEN: "acme"}, permissions={"beta": Permissions()})
    Tenants(permissions={"default": Permissions(tools=[])})  # without tokens the one tenant is `default`
    path.write_text('[acme]\ntools = 5\n')
    with pytest.raises(PermissionsError, match="tenant 'acme'"):
        Tenants.read_permissions(path)
