"""A small MCP server built on the official SDK's ``MCPServer``, the peer of the MCP tool tests.

In process: ``build_server()`` returns a fresh server and its :class:`State`. Over stdio:
``python tests/orchestration/mcp_server.py``; over Streamable HTTP in a process of its own:
``--http-fd FD`` (a listening socket the test passes down). Every tool but ``stats`` counts its
calls in the state, and the cancellable tools record a cancellation the moment the server sees it,
so a test can count what really ran on the server, whichever transport it used (``stats`` returns
the state as JSON).
"""

from __future__ import annotations

import asyncio
import base64
import os
import sys
from collections import Counter
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import EmbeddedResource, ImageContent, ResourceLink, TextContent, TextResourceContents, ToolAnnotations

PNG_1PX = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")).decode()
"""A 1x1 PNG, base64."""


class State:
    """What the server saw: calls per tool, cancellations, and the values ``put`` stored."""

    def __init__(self) -> None:
        self.journal = os.environ.get("FSM_MCP_TEST_JOURNAL")
        """A file each counted call appends its tool's name to (a record that outlives the process), or ``None``."""
        self.calls: Counter[str] = Counter()
        self.cancelled: list[str] = []
        self.started: list[str] = []
        self.store: dict[str, str] = {}

    def count(self, tool: str) -> None:
        self.calls[tool] += 1
        if self.journal:
            with open(self.journal, "a") as f:
                f.write(tool + "\n")

    def as_json(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "cancelled": list(self.cancelled), "started": list(self.started),
                "store": dict(self.store), "pid": os.getpid()}


READ_ONLY = ToolAnnotations(read_only_hint=True)
IDEMPOTENT = ToolAnnotations(read_only_hint=False, idempotent_hint=True, destructive_hint=False)
DESTRUCTIVE = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False)


def build_server(name: str = "fsm-test") -> tuple[MCPServer, State]:
    """A fresh server and the state its tools write."""
    srv = MCPServer(name, log_level="WARNING")
    state = State()

    @srv.tool(annotations=READ_ONLY)
    def add(a: int, b: int) -> int:
        """Add two integers."""
        state.count("add")
        return a + b

    @srv.tool(annotations=IDEMPOTENT)
    def put(key: str, value: str) -> str:
        """Store a value under a key (repeating it changes nothing)."""
        state.count("put")
        state.store[key] = value
        return f"stored {key}"

    @srv.tool(annotations=DESTRUCTIVE)
    def delete_record(key: str) -> str:
        """Delete a stored record."""
        state.count("delete_record")
        state.store.pop(key, None)
        return f"deleted {key}"

    async def _steps(tool: str, n: int, delay: float, ctx: Context) -> str:
        state.count(tool)
        state.started.append(tool)
        try:
            for i in range(1, n + 1):
                await ctx.report_progress(i, n, f"{tool} step {i}")
                await asyncio.sleep(delay)
        except asyncio.CancelledError:
            state.cancelled.append(tool)
            raise
        return f"{tool} finished {n} steps"

    @srv.tool(annotations=READ_ONLY)
    async def count(n: int, delay: float, ctx: Context) -> str:
        """Count to n, one step per delay seconds, reporting progress."""
        return await _steps("count", n, delay, ctx)

    @srv.tool()  # no annotations: a side effect by MCP's defaults
    async def slow_write(n: int, delay: float, ctx: Context) -> str:
        """Write n chunks, one per delay seconds, reporting progress."""
        return await _steps("slow_write", n, delay, ctx)

    @srv.tool(annotations=READ_ONLY)
    def fail(reason: str) -> str:
        """Always fails with the reason given."""
        state.count("fail")
        raise ToolError(f"cannot do that: {reason}")

    @srv.tool(annotations=READ_ONLY)
    def weather(city: str) -> dict[str, Any]:
        """Structured weather for a city."""
        state.count("weather")
        return {"city": city, "celsius": 21.5, "sky": "clear"}

    @srv.tool(annotations=READ_ONLY, structured_output=False)
    def report() -> list[Any]:
        """A report in several content kinds."""
        state.count("report")
        return [TextContent(type="text", text="summary: all good"),
                ImageContent(type="image", data=PNG_1PX, mime_type="image/png"),
                EmbeddedResource(type="resource", resource=TextResourceContents(
                    uri="file:///notes.txt", mime_type="text/plain", text="note one")),
                ResourceLink(type="resource_link", uri="file:///big.csv", name="big.csv", mime_type="text/csv",
                             description="the full data")]

    @srv.tool(name="files.read", annotations=READ_ONLY)
    def files_read(path: str) -> str:
        """A tool whose name has a dot (not allowed in fsm_agent tool names)."""
        state.count("files.read")
        return f"contents of {path}"

    @srv.tool(annotations=READ_ONLY)
    def crash() -> str:
        """Ends the server process at once (stdio only)."""
        os._exit(3)

    @srv.tool(annotations=READ_ONLY)
    def whoami(ctx: Context) -> str:
        """The X-Caller HTTP header of the request (Streamable HTTP only)."""
        state.count("whoami")
        return (ctx.headers or {}).get("x-caller", "(none)")

    @srv.tool(annotations=READ_ONLY)
    def stats() -> dict[str, Any]:
        """What the server saw (not counted)."""
        return state.as_json()

    return srv, state


async def serve_http(fd: int) -> None:
    """Serve a fresh server over Streamable HTTP on the listening socket ``fd`` (inherited from the
    test, so there is no race for a port) until the process ends."""
    import socket

    import uvicorn

    srv, _ = build_server("fsm-test-http")
    config = uvicorn.Config(srv.streamable_http_app(), log_level="warning")
    await uvicorn.Server(config).serve(sockets=[socket.socket(fileno=fd)])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http-fd":
        asyncio.run(serve_http(int(sys.argv[2])))
    else:
        build_server()[0].run()
