"""What the model reads when an MCP server's answer is an error or is malformed (issue 19 item 5).

* A result flagged ``isError`` reaches the model as the error's own text, whatever
  ``prefer_structured`` says; its ``structuredContent`` only stands in when there is no text.
* An answer that is no valid ``tools/call`` result (``"result": null``, a list, a string, no
  result, a result without ``content`` ...) is told as "the server answered with an invalid
  result: <what was wrong>", at once: not as a timeout after the call's deadline.

The peers are the ``mcp`` package's own servers: the low-level ``Server`` in process, and
``tests/orchestration/mcp_liar.py`` over stdio and Streamable HTTP, whose one ``tools/call``
answer is swapped for the malformed shape on the wire. Calls go through a real
:class:`~fsm_agent.Agent`.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from mcp.server import Server
from mcp.types import CallToolResult, ListToolsResult, TextContent
from mcp.types import Tool as Spec

from fsm_agent import Agent, ScriptedProvider, StopReason
from fsm_agent.orchestration.mcp import content_blocks, mcp_tools
from fsm_agent.providers import tool_call_response
from fsm_agent.types import TextBlock, ToolResultMessage, ToolUseBlock

from .mcp_liar import JUNK, MODES, http_app

LIAR = str(Path(__file__).with_name("mcp_liar.py"))
OBJ = {"type": "object", "properties": {}}

WHAT = {
    "result_null": "its 'result' is null, not an object",
    "result_missing": "it has neither a 'result' nor an 'error'",
    "result_list": """its 'result' is [{"type":"text","text":"running"}], not an object""",
    "result_string": """its 'result' is "running", not an object""",
    "result_without_content": "content: Field required",
    "content_not_a_list": 'content: Input should be a valid list (got "running")',
    "content_item_without_text": "content.0.TextContent.text: Field required",
    "error_not_an_object": """its 'error' is "boom", not an object with a code and a message""",
}
"""Mode of :mod:`mcp_liar` → what the model is told was wrong."""

CALL_TIMEOUT = 10.0
"""The toolset's per-call timeout. The servers answer at once; before the fix, the dropped answers
were reported as a timeout after this long."""


async def run_one(tools: Any, name: str = "job_status") -> tuple[Any, ToolResultMessage]:
    agent = Agent(ScriptedProvider([tool_call_response(ToolUseBlock("c0", name, {})), "done"]), tools=list(tools))
    result = await agent.run("go")
    (res,) = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    return result, res


def in_process(handler: Callable[[Any], Any]) -> Server[Any]:
    async def list_tools(ctx: Any, params: Any) -> ListToolsResult:
        return ListToolsResult(tools=[Spec(name="job_status", input_schema=OBJ)])

    async def call_tool(ctx: Any, params: Any) -> Any:
        return handler(params)

    return Server("in-process", on_list_tools=list_tools, on_call_tool=call_tool)


# -- isError keeps the error's text -------------------------------------------------------------

ERROR_TEXT = "cannot read /var/log/app.log: permission denied"
STALE = {"status": "ok", "lines": []}
"""A structured payload next to the error text (a stale default, a schema-shaped placeholder)."""


@pytest.mark.parametrize("prefer_structured", [False, True])
async def test_an_is_error_result_reaches_the_model_as_its_error_text(prefer_structured: bool) -> None:
    server = in_process(lambda p: CallToolResult(content=[TextContent(type="text", text=ERROR_TEXT)],
                                                 structured_content=STALE, is_error=True))
    async with mcp_tools(server, prefer_structured=prefer_structured) as ts:
        result, res = await run_one(ts)
    assert result.stop.reason is StopReason.COMPLETED
    assert res.is_error and res.metadata == {"error": "mcp_tool_error"}
    assert res.text == ERROR_TEXT and '"status"' not in res.text


def test_content_blocks_of_an_error_keep_its_text_and_fall_back_to_the_payload_only_without_text() -> None:
    both = CallToolResult(content=[TextContent(type="text", text=ERROR_TEXT)], structured_content=STALE, is_error=True)
    for prefer in (False, True):
        assert content_blocks(both, prefer_structured=prefer) == (TextBlock(ERROR_TEXT),)
    only_payload = CallToolResult(content=[], structured_content={"error": "quota exceeded"}, is_error=True)
    assert content_blocks(only_payload, prefer_structured=True) == (TextBlock('{"error":"quota exceeded"}'),)
    # a result that is not an error keeps the documented choice
    fine = CallToolResult(content=[TextContent(type="text", text="12 lines")], structured_content={"lines": 12})
    assert content_blocks(fine, prefer_structured=True) == (TextBlock('{"lines":12}'),)
    assert content_blocks(fine) == (TextBlock("12 lines"),)


# -- a malformed answer is an invalid result, not a timeout --------------------------------------

@pytest.fixture
async def http_liar(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[str], Any]]:
    """Start :func:`mcp_liar.http_app` in ``mode`` under uvicorn on a loopback port; give its URL."""
    servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    async def start(mode: str) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        srv = uvicorn.Server(uvicorn.Config(http_app(mode), log_level="warning", lifespan="on"))
        task = asyncio.create_task(srv.serve(sockets=[sock]))
        servers.append((srv, task))
        while not srv.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.02)
        return f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"

    yield start
    for srv, task in servers:
        srv.should_exit = True
        await task


@pytest.mark.parametrize("transport", ["stdio", "http", "http+json"])
@pytest.mark.parametrize("mode", sorted(MODES))
async def test_a_malformed_answer_is_told_as_an_invalid_result_not_a_timeout(
        mode: str, transport: str, http_liar: Callable[[str], Any]) -> None:
    if transport == "stdio":
        target: Any = [sys.executable, LIAR, mode]
    else:
        target = await http_liar(mode + transport.removeprefix("http"))
    async with mcp_tools(target, timeout=CALL_TIMEOUT) as ts:
        result, res = await run_one(ts)
    assert result.stop.reason is StopReason.COMPLETED  # the run goes on: the model reads the error
    assert res.is_error and res.metadata == {"error": "mcp_invalid_result"}, res.text
    assert f"the server answered with an invalid result: {WHAT[mode]}" in res.text
    assert "did not answer within" not in res.text
    assert "Continue without it" in res.text


@pytest.mark.parametrize("answer", [
    {"content": "running"},               # not a list
    {"content": [{"type": "text"}]},      # an item without its text
    {},                                   # no content at all
])
async def test_a_malformed_result_from_an_in_process_server_is_an_invalid_result(answer: dict[str, Any]) -> None:
    # the SDK server checks what its handler returns; a server middleware that answers by itself is trusted
    server = in_process(lambda p: CallToolResult(content=[TextContent(type="text", text="running")]))

    async def lying(ctx: Any, call_next: Any) -> Any:
        return dict(answer) if ctx.method == "tools/call" else await call_next(ctx)

    server.middleware.append(lying)
    async with mcp_tools(server, timeout=CALL_TIMEOUT) as ts:
        result, res = await run_one(ts)
    assert res.is_error and res.metadata == {"error": "mcp_invalid_result"}, res.text
    assert "the server answered with an invalid result: content" in res.text
    assert "ValidationError" not in res.text


async def test_a_line_that_is_no_json_rpc_is_named_in_the_timeout_it_may_have_caused() -> None:
    # over stdio a line that is not JSON names no request (a server may log to stdout): the call
    # still times out, and the model is told what came instead of an answer
    async with mcp_tools([sys.executable, LIAR, "junk"], timeout=1.0) as ts:
        _, res = await run_one(ts)
    assert res.is_error and res.metadata == {"error": "timeout"}
    assert "did not answer within 1 s" in res.text
    assert f"sent 1 message(s) that are not valid JSON-RPC and name no request (the last: {JUNK!r})" in res.text


async def test_over_http_a_body_that_is_no_json_is_an_invalid_result(http_liar: Callable[[str], Any]) -> None:
    async with mcp_tools(await http_liar("junk"), timeout=CALL_TIMEOUT) as ts:
        _, res = await run_one(ts)
    assert res.metadata == {"error": "mcp_invalid_result"}, res.text
    assert f"the server answered with an invalid result: it is not JSON (Invalid JSON: expected value at line 1 " \
           f"column 1): {JUNK!r}" in res.text
