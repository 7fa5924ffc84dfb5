"""A tool's name is the one given: an empty name is refused, never replaced by the function's
(``Tool(fn, name="")`` used to become a tool named after ``fn``, so a server tool without a name
could be called under another name)."""

from __future__ import annotations

import pytest

from fsm_agent.errors import ToolDefinitionError
from fsm_agent.tools import Tool, tool


def call() -> str:
    """Call."""
    return "x"


def test_an_empty_name_is_refused() -> None:
    with pytest.raises(ToolDefinitionError, match="tool name '' must match"):
        Tool(call, name="")
    with pytest.raises(ToolDefinitionError, match="tool name '' must match"):
        tool(name="")(call)


def test_no_name_means_the_functions_name() -> None:
    assert Tool(call).name == "call" and tool(call).name == "call" and tool(name=None)(call).name == "call"
