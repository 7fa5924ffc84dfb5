"""A worker process that dies by SIGKILL while an MCP tool call is in flight.

    python tests/orchestration/mcp_crash_worker.py STORE SESSION TOOL JOURNAL

Runs a session (SQLite store ``STORE``) whose model calls ``TOOL`` of the test MCP server (over
stdio; the server appends each call to ``JOURNAL``) and kills itself at the tool's first progress
report: the ledger says ``started``, the server has begun the call, and nothing else is recorded.
Exit 0 means it never got there (a bug in the test).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from mcp import StdioServerParameters

from fsm_agent import Agent, ScriptedProvider, ToolProgress
from fsm_agent.orchestration.mcp import mcp_tools
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore

STORE, SESSION, TOOL, JOURNAL = sys.argv[1:5]
SERVER = str(Path(__file__).with_name("mcp_server.py"))


class DieAtProgress:
    def on_tool_progress(self, event: ToolProgress) -> None:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


async def main() -> None:
    params = StdioServerParameters(command=sys.executable, args=[SERVER], env={"FSM_MCP_TEST_JOURNAL": JOURNAL})
    async with mcp_tools(params) as tools:
        provider = ScriptedProvider([tool_call_response((TOOL, {"n": 3, "delay": 0.2})), "finished"])
        agent = Agent(provider, tools=tools, store=SQLiteStore(STORE), observers=[DieAtProgress()], lease_ttl=0.5)
        await agent.run("go", session_id=SESSION)


if __name__ == "__main__":
    asyncio.run(main())
