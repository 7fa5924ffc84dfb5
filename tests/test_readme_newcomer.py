"""What a newcomer looked for in the README (issue 23 item 13): the install into a virtual
environment before the first pip command, and the shape of ``stop.pending_actions``, shown as a
real run produces it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fsm_agent import Agent, Decision, ScriptedProvider, StopReason, tool
from fsm_agent.providers import tool_call_response
from fsm_agent.types.codec import unstructure
from fsm_agent.types import ToolUseBlock
from fsm_agent_middleware.approval import HumanApproval

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_quick_start_makes_a_virtual_environment_before_the_first_install() -> None:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    venv = section.index("python3 -m venv .venv && . .venv/bin/activate")
    assert venv < section.index("pip install --no-cache-dir")
    # not a ```bash block: tests/test_readme.py reads the first two of those as CI's commands
    assert re.search(r"```sh\npython3 -m venv \.venv && \. \.venv/bin/activate\n```", section)


@tool(effect="side_effect")
def send_email(to: str, body: str) -> str:
    """Send an e-mail."""
    return f"sent to {to}"


async def test_the_pending_actions_shown_are_what_a_run_gives() -> None:
    block = README.split("A `WAITING_HUMAN` stop lists what waits in `stop.pending_actions`", 1)[1]
    shown_json = re.search(r"`(\[\{\"call\".+?\}\])`", block, re.S)
    assert shown_json, "the README shows pending_actions as JSON"
    shown = json.loads(re.sub(r"\s*\n\s*", " ", shown_json.group(1)))
    agent = Agent(ScriptedProvider([tool_call_response(ToolUseBlock("call_1", "send_email", {"to": "ann@example.com", "body": "…"})),
                                    "Sent."]),
                  tools=[send_email], middleware=[HumanApproval(tools=["send_email"])])
    result = await agent.run("Mail the report to Ann")
    assert result.stop.reason is StopReason.WAITING_HUMAN
    got = unstructure(result.stop.pending_actions)
    assert [{**p, "call": {k: v for k, v in p["call"].items() if k not in ("raw_input", "provider_data")}}
            for p in got] == shown
    assert got[0]["call"]["raw_input"] is None and got[0]["call"]["provider_data"] is None
    (pending,) = result.stop.pending_actions
    assert (pending.call.id, pending.call.name, pending.call.input["to"]) == ("call_1", "send_email", "ann@example.com")
    assert pending.allowed_decisions == ("approve", "edit", "reject", "respond")
    # the loop the README shows decides it by its id
    decisions = {p.call.id: Decision.approve() for p in result.stop.pending_actions}
    assert (await agent.resume(result.session_id, decisions=decisions)).output == "Sent."
