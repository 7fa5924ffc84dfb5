"""BlockTools: deny chosen tools by name. The example plugin of docs/writing-middleware.md."""

from __future__ import annotations

import os

from fsm_agent import Deny, Middleware, Ordering

__all__ = ["BlockTools"]


class BlockTools(Middleware):
    """Deny calls to the named tools (default: ``$BLOCKED_TOOLS``, comma-separated); the model sees why."""

    name = "block_tools"
    ordering = Ordering(position="outermost")  # policy runs before anything else looks at the call

    def __init__(self, blocked: list[str] | None = None) -> None:
        if blocked is None:
            blocked = [t.strip() for t in os.environ.get("BLOCKED_TOOLS", "").split(",") if t.strip()]
        self.blocked = frozenset(blocked)

    def on_tool_call(self, call, ctx):
        if call.name in self.blocked:
            return Deny(f"the tool {call.name!r} is blocked by the operator's policy")
        return None

    def __repr__(self) -> str:
        return f"BlockTools(blocked={sorted(self.blocked)!r})"
