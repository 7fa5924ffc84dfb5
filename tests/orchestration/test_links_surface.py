"""Where links show and matter outside the patterns: ``fsm-agent sessions show`` lists a session's
parent and its tree of children; the server's store wrapper passes links through; a server that
restarts leaves a child session to its parent instead of running it with its own agent."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import orjson

from fsm_agent import Agent, ScriptedProvider
from fsm_agent.cli import main
from fsm_agent.orchestration.subagent import agent_tool
from fsm_agent.providers import tool_call_response
from fsm_agent.server.notify import NotifyingStore
from fsm_agent.server.runs import LocalRunner, RunRequest
from fsm_agent.store import MemoryStore, SessionLink, SessionRecord, SQLiteStore


async def _nested_run(path: Path) -> tuple[str, str]:
    store = SQLiteStore(path)
    try:
        inner = Agent(ScriptedProvider(["inner answer"]), store=store)
        middle = Agent(ScriptedProvider([tool_call_response(("inner", {"task": "dig deeper"})), "middle answer"]),
                       tools=[agent_tool(inner, name="inner", description="Inner.")], store=store)
        top = Agent(ScriptedProvider([tool_call_response(("middle", {"task": "look into it"})), "top answer"]),
                    tools=[agent_tool(middle, name="middle", description="Middle.")], store=store)
        result = await top.run("the whole job", session_id="top")
        assert result.output == "top answer"
        (mid,) = await store.children("top")
        (low,) = await store.children(mid.child_id)
        return mid.child_id, low.child_id
    finally:
        await store.close()


def _cli(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), out=out, err=err)
    return code, out.getvalue() + err.getvalue()


def test_sessions_show_lists_the_parent_and_the_tree_of_children(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    mid, low = asyncio.run(_nested_run(db))
    code, out = _cli("sessions", "show", "top", "--store", str(db))
    assert code == 0, out
    assert "children:\n" in out
    assert f"  {mid}  agent_tool [" in out and "]  COMPLETED  look into it" in out
    assert f"    {low}  agent_tool [" in out and "]  COMPLETED  dig deeper" in out
    code, out = _cli("sessions", "show", mid, "--store", str(db))
    assert "parent: top (agent_tool by call " in out and f"  {low}  agent_tool" in out
    code, out = _cli("sessions", "show", mid, "--store", str(db), "--json")
    doc = orjson.loads(out)
    assert doc["parent"]["parent_id"] == "top" and [c["child_id"] for c in doc["children"]] == [low]
    code, out = _cli("sessions", "show", low, "--store", str(db))
    assert f"parent: {mid} (agent_tool by call " in out and "children:" not in out
    # --json has the whole tree the text shows, not one level (review nit)
    code, out = _cli("sessions", "show", "top", "--store", str(db), "--json")
    tree = orjson.loads(out)["tree"]
    assert tree["session_id"] == "top" and tree["link"] is None
    (m,) = tree["children"]
    (lo,) = m["children"]
    assert (m["session_id"], m["state"], m["goal"], m["link"]["kind"]) == (mid, "COMPLETED", "look into it",
                                                                           "agent_tool")
    assert (lo["session_id"], lo["goal"], lo["children"], lo["truncated"]) == (low, "dig deeper", [], False)


async def test_the_servers_store_wrapper_passes_links_through() -> None:
    store = NotifyingStore(MemoryStore())
    await store.create_session(SessionRecord("p", "Idle"))
    link, created = await store.link_session(SessionLink("c", "p", "worker"))
    assert created and await store.children("p") == [link] and await store.parent("c") == link


class _Recording(LocalRunner):
    def __init__(self, agent: Agent) -> None:
        super().__init__(agent)
        self.requests: list[RunRequest] = []

    async def submit(self, request: RunRequest) -> None:
        self.requests.append(request)


async def test_a_restarting_server_leaves_child_sessions_to_their_parents() -> None:
    store = MemoryStore()
    for sid, state in (("parent", "MidTurn"), ("child", "MidTurn"), ("queued", "QUEUED"), ("done", "COMPLETED")):
        await store.create_session(SessionRecord(sid, state))
    await store.link_session(SessionLink("child", "parent", "agent_tool", "call_1"))
    runner = _Recording(Agent(ScriptedProvider([]), store=store))
    await runner.start()
    got: list[Any] = sorted((r.session_id, r.kind) for r in runner.requests)
    assert got == [("parent", "recover"), ("queued", "start")]
