"""An agent for `fsm-agent serve --agent tests.server.serve_agent:make` in the CLI tests (scripted
provider: a tool call that needs approval, then an answer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsm_agent import ScriptedProvider, tool
from fsm_agent.agent import Agent
from fsm_agent.providers import tool_call_response
from fsm_agent.types import ToolUseBlock
from fsm_agent_middleware.approval import HumanApproval


@tool(effect="side_effect")
async def send_mail(to: str) -> str:
    """Send a mail (appends a line to $FSM_TEST_SENT when set)."""
    import os

    path = os.environ.get("FSM_TEST_SENT")
    if path:
        with Path(path).open("a") as f:
            f.write(to + "\n")
    return f"sent to {to}"


def make() -> Agent:
    script: list[Any] = [tool_call_response(ToolUseBlock("c0", "send_mail", {"to": "a@x"})), "mail sent"]
    return Agent(ScriptedProvider(script * 50), tools=[send_mail], middleware=[HumanApproval(["send_mail"])])
