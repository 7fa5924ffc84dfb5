"""An agent for `fsm-agent serve --agent tests.server.serve_agent:make` in the CLI tests (scripted
provider: a tool call that needs approval, then an answer; it answers from the transcript, so a
restarted server process goes on the same way)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsm_agent import ScriptedProvider, tool
from fsm_agent.agent import Agent
from fsm_agent.providers import text_response, tool_call_response
from fsm_agent.types import ToolUseBlock
from fsm_agent_middleware.approval import HumanApproval


@tool(effect="side_effect")
async def send_mail(to: str) -> str:
    """Send a mail (appends a line to $FSM_TEST_SENT when set, then sleeps $FSM_TEST_TOOL_SLEEP seconds)."""
    import asyncio
    import os

    path = os.environ.get("FSM_TEST_SENT")
    if path:
        with Path(path).open("a") as f:
            f.write(to + "\n")
    await asyncio.sleep(float(os.environ.get("FSM_TEST_TOOL_SLEEP", "0")))  # room to kill the server mid-tool
    return f"sent to {to}"


def answer(request: Any) -> Any:
    """Each new task asks for ``send_mail`` (call ``c<n>``); once the tool's result is in, the
    answer is text. It reads the transcript, so a restarted process answers the same way."""
    from fsm_agent.types import ToolResultMessage, UserMessage

    last = request.messages[-1]
    if isinstance(last, ToolResultMessage):
        return text_response("mail sent")
    n = sum(isinstance(m, UserMessage) for m in request.messages) - 1
    return tool_call_response(ToolUseBlock(f"c{n}", "send_mail", {"to": "a@x"}))


def make() -> Agent:
    import os

    return Agent(ScriptedProvider([answer], repeat_last=True), tools=[send_mail],
                 middleware=[HumanApproval(["send_mail"])],
                 lease_ttl=float(os.environ.get("FSM_TEST_LEASE_TTL", "30")))
