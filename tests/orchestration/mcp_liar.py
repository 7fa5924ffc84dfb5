"""A real MCP SDK server whose ``tools/call`` answer is malformed on the wire (issue 19 item 5).

The server is the ``mcp`` package's low-level ``Server`` with one tool, ``job_status``, that
answers ``running`` like any good tool. Between it and the client, its one answer to
``tools/call`` is replaced by the shape named ``mode`` (:data:`MODES`), after the SDK server
validated and serialised it: so the handshake, the listing and the framing stay the SDK's own.

* stdio: ``python tests/orchestration/mcp_liar.py MODE`` (the SDK's ``stdio_server``; the swap is
  made on its write stream).
* Streamable HTTP: :func:`http_app` wraps the SDK's ASGI app and swaps the ``data:`` line of the
  answer (SSE, the SDK's default, or a JSON body with ``json_response=True``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from mcp.server import Server
from mcp.types import CallToolResult, ListToolsResult, TextContent, Tool, ToolAnnotations

MODES: dict[str, Any] = {
    "result_null": {"result": None},
    "result_missing": {},
    "result_list": {"result": [{"type": "text", "text": "running"}]},
    "result_string": {"result": "running"},
    "result_without_content": {"result": {}},
    "content_not_a_list": {"result": {"content": "running"}},
    "content_item_without_text": {"result": {"content": [{"type": "text"}]}},
    "error_not_an_object": {"error": "boom"},
}
"""Mode → what replaces ``result`` in the answer (``jsonrpc`` and ``id`` are kept)."""

JUNK = "job_status: polling backend ..."
"""Mode ``junk``: the answer is replaced by this line, which is no JSON at all (a server that logs
to stdout) and names no request."""


def build(name: str = "liar") -> Server[Any]:
    """The server: one read-only tool, ``job_status``, answering ``running``."""
    async def list_tools(ctx: Any, params: Any) -> ListToolsResult:
        return ListToolsResult(tools=[Tool(name="job_status", input_schema={"type": "object", "properties": {}},
                                           annotations=ToolAnnotations(read_only_hint=True))])

    async def call_tool(ctx: Any, params: Any) -> CallToolResult:
        return CallToolResult(content=[TextContent(type="text", text="running")])

    return Server(name, on_list_tools=list_tools, on_call_tool=call_tool)


def _is_call_answer(message: dict[str, Any]) -> bool:
    result = message.get("result")
    return "id" in message and isinstance(result, dict) and "content" in result


def lie(message: dict[str, Any], mode: str) -> str:
    """The wire text that replaces ``message`` (a ``tools/call`` answer) in ``mode``."""
    if mode == "junk":
        return JUNK
    return json.dumps({"jsonrpc": "2.0", "id": message["id"], **MODES[mode]})


def http_app(mode: str) -> Any:
    """The SDK's Streamable HTTP app for :func:`build`, its ``tools/call`` answer swapped."""
    inner = build("liar-http").streamable_http_app(json_response=mode.endswith("+json"))
    mode = mode.removesuffix("+json")

    def swap(body: bytes) -> bytes:
        out = []
        for line in body.decode().split("\n"):
            head, sep, data = line.partition("data: ") if line.startswith("data: ") else ("", "", line)
            try:
                message = json.loads(data)
            except ValueError:
                out.append(line)
                continue
            if isinstance(message, dict) and _is_call_answer(message):
                data = lie(message, mode)
            out.append(head + sep + data)
        return "\n".join(out).encode()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await inner(scope, receive, send)
            return

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":  # the body changes length
                message = {**message, "headers": [(k, v) for k, v in message.get("headers", [])
                                                  if k.lower() != b"content-length"]}
            elif message["type"] == "http.response.body" and message.get("body"):
                message = {**message, "body": swap(message["body"])}
            await send(message)

        await inner(scope, receive, sending)

    return app


async def serve_stdio(mode: str) -> None:
    from mcp.server.stdio import stdio_server
    from mcp.shared.message import SessionMessage
    from mcp.types import JSONRPCResponse

    server = build()

    class Swapped:
        """The stdio server's write stream, with the ``tools/call`` answer swapped."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        async def send(self, item: Any) -> None:
            message = item.message if isinstance(item, SessionMessage) else None
            if isinstance(message, JSONRPCResponse):
                dumped = message.model_dump(by_alias=True, mode="json", exclude_unset=True)
                if _is_call_answer(dumped):
                    text = lie(dumped, mode)

                    class Lie(JSONRPCResponse):  # the SDK writes what model_dump_json returns, then a newline
                        def model_dump_json(self, **options: Any) -> str:
                            return text

                    item = SessionMessage(Lie.model_construct(jsonrpc="2.0", id=message.id, result={}))
            await self.inner.send(item)

        async def __aenter__(self) -> Swapped:
            await self.inner.__aenter__()
            return self

        async def __aexit__(self, *exc: Any) -> Any:
            return await self.inner.__aexit__(*exc)

    async with stdio_server() as (read, write):
        await server.run(read, Swapped(write), server.create_initialization_options())


if __name__ == "__main__":
    import anyio

    anyio.run(serve_stdio, sys.argv[1])
