"""Child sessions belong to their parent's tenant.

A sub-agent's session (agent as tool, handoff, a leader's workers: all made by ``drive_child``)
used to carry no ``tenant`` metadata, and the server counts an untagged session as the tenant
``default``'s: a tenant named ``default`` could read every other tenant's sub-agent sessions (the
task it was given and its answer) over REST and A2A. A child now copies its parent's tenant, at
every depth, and no tenant may be named ``default`` when the server has tokens.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from a2a_peers import Live, rpc, user_message
from fsm_agent import Agent, ScriptedProvider, StopReason
from fsm_agent.errors import ConfigurationError
from fsm_agent.orchestration.subagent import agent_tool
from fsm_agent.providers import tool_call_response
from fsm_agent.server import create_app
from fsm_agent.server.a2a import A2AConfig, add_a2a_routes
from fsm_agent.server.app import STORE_KEY
from fsm_agent.server.auth import Tenants
from fsm_agent.store import MemoryStore, Store
from fsm_agent.types import ToolResultMessage

TOK_A, TOK_B = "token-of-tenant-a-0001", "token-of-tenant-b-0002"


def _asker(tool_name: str, answer: str) -> Any:
    """A model step: call ``tool_name`` first, then answer ``answer``."""
    def step(req: Any) -> Any:
        if isinstance(req.messages[-1], ToolResultMessage):
            return answer
        return tool_call_response((tool_name, {"task": f"confidential question for {tool_name}"}))
    return step


def three_levels(store: Store) -> Agent:
    """lead → researcher (agent tool) → fact_checker (agent tool of the researcher)."""
    checker = Agent(ScriptedProvider(["checked: secret fact"], repeat_last=True), store=store)
    researcher = Agent(ScriptedProvider([_asker("fact_checker", "secret research result")], repeat_last=True),
                       tools=[agent_tool(checker, name="fact_checker", description="Checks facts.")], store=store)
    return Agent(ScriptedProvider([_asker("researcher", "lead's answer")], repeat_last=True),
                 tools=[agent_tool(researcher, name="researcher", description="Research.")], store=store)


async def test_children_copy_the_parents_tenant_at_every_depth() -> None:
    store = MemoryStore()
    res = await three_levels(store).run("go", session_id="lead", metadata={"tenant": "acme", "other": 1})
    assert res.stop.reason is StopReason.COMPLETED, res.stop
    sessions = {r.session_id: r for r in await store.list_sessions()}
    assert len(sessions) == 3
    for sid, rec in sessions.items():
        assert rec.metadata.get("tenant") == "acme", (sid, rec.metadata)
        if sid != "lead":
            assert "other" not in rec.metadata  # only the tenant is inherited


async def test_a_parent_without_a_tenant_makes_children_without_one() -> None:
    store = MemoryStore()
    await three_levels(store).run("go", session_id="lead")
    assert all("tenant" not in r.metadata for r in await store.list_sessions())


def test_no_tenant_may_be_named_default_when_there_are_tokens() -> None:
    with pytest.raises(ConfigurationError, match="'default' is reserved"):
        Tenants({TOK_A: "default"})
    with pytest.raises(ConfigurationError, match="'default' is reserved"):
        Tenants.parse([f"default:{TOK_A}"], "tokens file")
    assert not Tenants().enabled  # without tokens, everything is the one tenant 'default'


async def test_another_tenant_cannot_see_a_tenants_sub_agent_sessions() -> None:
    store = MemoryStore()
    app = create_app(three_levels(store), tenants=Tenants({TOK_A: "a", TOK_B: "b"}), live_deltas=False)
    add_a2a_routes(app, A2AConfig(name="lead", description="Leads."))
    ha, hb = {"Authorization": f"Bearer {TOK_A}"}, {"Authorization": f"Bearer {TOK_B}"}
    async with Live(app) as live, aiohttp.ClientSession() as cs:
        r = await rpc(cs, live.rpc_url, "SendMessage", {"message": user_message("go", "m1")}, headers=ha)
        assert r["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED", r
        recs = await live.app[STORE_KEY].list_sessions()
        assert len(recs) == 3 and {x.metadata.get("tenant") for x in recs} == {"a"}
        children = [x.session_id for x in recs if x.session_id != r["result"]["task"]["id"]]
        seen_b = await rpc(cs, live.rpc_url, "ListTasks", {"includeArtifacts": True}, headers=hb)
        assert seen_b["result"]["tasks"] == []
        seen_a = await rpc(cs, live.rpc_url, "ListTasks", {}, headers=ha)
        assert {t["id"] for t in seen_a["result"]["tasks"]} == {x.session_id for x in recs}
        for child in children:
            got = await rpc(cs, live.rpc_url, "GetTask", {"id": child}, headers=hb)
            assert got["error"]["code"] == -32001, got
            async with cs.get(f"{live.base}/sessions/{child}", headers=hb) as resp:
                assert resp.status == 404
            async with cs.get(f"{live.base}/sessions/{child}", headers=ha) as resp:
                assert resp.status == 200 and (await resp.json())["tenant"] == "a"
        async with cs.get(f"{live.base}/sessions", headers=hb) as resp:
            assert (await resp.json())["sessions"] == []
