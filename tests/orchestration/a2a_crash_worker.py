"""A parent agent process for the A2A nothing-twice tests: it calls a remote A2A agent as a tool
(``remote_agent_tool``), and the test kills it with SIGKILL while the remote task runs.

    python tests/orchestration/a2a_crash_worker.py DB CARD_JSON SESSION TEXT

The card (JSON) is passed as given, so the worker reaches the remote at the card's URL. The first
model call asks the tool with ``TEXT``; the second answers ``parent done``. Prints the run's stop
as JSON when it ends (it is normally killed first).
"""

from __future__ import annotations

import asyncio
import sys

import orjson

from fsm_agent import Agent, ScriptedProvider
from fsm_agent.orchestration.a2a import remote_agent_tool
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.types import ToolUseBlock

DB, CARD, SESSION, TEXT = sys.argv[1:5]


def agent(store: SQLiteStore) -> Agent:
    tool = remote_agent_tool(orjson.loads(CARD), name="ask_remote", timeout=60)
    provider = ScriptedProvider([tool_call_response(ToolUseBlock("call_remote", "ask_remote", {"message": TEXT})),
                                 "parent done"])
    return Agent(provider, tools=[tool], store=store, lease_ttl=1.0, control_poll=0.1)


async def main() -> None:
    store = SQLiteStore(DB)
    result = await agent(store).run("ask the remote agent", session_id=SESSION)
    print(orjson.dumps({"reason": result.stop.reason.value, "output": result.output}).decode(), flush=True)
    await store.close()


if __name__ == "__main__":
    asyncio.run(main())
