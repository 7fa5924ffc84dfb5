"""An agent for the CLI tests on Temporal (built the same in the worker and the starter process):
a scripted model, one side-effect tool behind an approval, the store at $FSM_TEST_STORE."""

from __future__ import annotations

import os

from fsm_agent import Agent, ScriptedProvider, tool
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.types import ToolUseBlock
from fsm_agent_middleware.approval import HumanApproval


@tool(effect="side_effect")
def pay(invoice: int) -> str:
    """Pay an invoice."""
    return f"paid invoice {invoice}"


def agent() -> Agent:
    script = [tool_call_response(ToolUseBlock("call_pay", "pay", {"invoice": 17})), "Invoice 17 is paid."]
    return Agent(ScriptedProvider(script * 10), tools=[pay], middleware=[HumanApproval(tools=["pay"])],
                 store=SQLiteStore(os.environ["FSM_TEST_STORE"]))
