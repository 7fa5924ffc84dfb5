"""A tool answers with an error result of its own: ``ToolError`` (the MCP adapter's ``isError`` path)."""

from __future__ import annotations

from fsm_agent import ToolError, ToolRegistry, tool
from fsm_agent.tools import execute_tool_call
from fsm_agent.types import ImageBlock, TextBlock, ToolUseBlock


@tool
async def refuses(kind: str) -> str:
    """Always answers with an error.

    Args:
        kind: which error.
    """
    if kind == "blocks":
        blocks = (TextBlock("no such file: a.txt"), ImageBlock(data="AA==", media_type="image/png"))
        raise ToolError("unused", content=blocks,
                        kind="remote_error")
    raise ToolError("no such file: a.txt; list the directory first")


async def test_the_message_is_the_result_marked_as_an_error() -> None:
    r = await execute_tool_call(ToolUseBlock("c1", "refuses", {"kind": "text"}), ToolRegistry([refuses]))
    assert r.is_error and r.text == "no such file: a.txt; list the directory first"
    assert r.metadata == {"error": "tool_error"}  # not "exception": no "Tool 'refuses' failed: ToolError" prefix


async def test_content_blocks_are_the_result_when_given() -> None:
    r = await execute_tool_call(ToolUseBlock("c1", "refuses", {"kind": "blocks"}), ToolRegistry([refuses]))
    assert r.is_error and r.metadata == {"error": "remote_error"}
    assert [type(b).__name__ for b in r.content] == ["TextBlock", "ImageBlock"]
    assert r.text == "no such file: a.txt"
