"""Tools: the ``@tool`` decorator, the registry, parallel execution, demo tools."""

from .execution import execute_tool_call, execute_tool_calls, idempotency_key
from .registry import RUN_AGAIN, Tool, ToolContext, ToolEffect, ToolRegistry, tool

__all__ = [
    "RUN_AGAIN",
    "Tool",
    "ToolContext",
    "ToolEffect",
    "ToolRegistry",
    "execute_tool_call",
    "execute_tool_calls",
    "idempotency_key",
    "tool",
]
