"""The agents whose recorded workflow histories guard the engine against changes that would break
runs in flight (tests/temporal/test_history_replay.py; regenerate with make_histories.py)."""

from __future__ import annotations

from fsm_agent import Agent, ScriptedProvider, tool
from fsm_agent.providers import tool_call_response
from fsm_agent.store import MemoryStore
from fsm_agent.types import ToolUseBlock
from fsm_agent_middleware.approval import HumanApproval


@tool
def lookup(city: str) -> str:
    """Weather for a city."""
    return f"{city}: 21 C"


@tool(effect="side_effect")
def book(city: str) -> str:
    """Book a trip."""
    return f"booked {city}"


def script() -> list:
    return [tool_call_response(ToolUseBlock("h1", "lookup", {"city": "Oslo"}),
                               ToolUseBlock("h2", "lookup", {"city": "Rome"})),
            tool_call_response(ToolUseBlock("h3", "book", {"city": "Rome"})), "Booked Rome."]


def trip_agent() -> Agent:
    """Parallel tools, an approval wait, a resume."""
    return Agent(ScriptedProvider(script() * 3), tools=[lookup, book], middleware=[HumanApproval(tools=["book"])],
                 system_prompt="You plan trips.", store=MemoryStore())


AGENTS = {"history:trip": trip_agent}
