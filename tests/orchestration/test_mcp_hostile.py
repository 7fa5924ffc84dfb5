"""MCP servers that lie: hostile schemas, images that are not images, names that collide or are
empty, answers of 30 MB; and the idempotency key each call carries (findings of a review).

The peer is the ``mcp`` package's low-level ``Server`` in process, listing exactly the tools each
test gives it; calls go through a real :class:`~fsm_agent.Agent` with a ScriptedProvider.
"""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from mcp.server import Server
from mcp.types import (BlobResourceContents, CallToolResult, EmbeddedResource, ImageContent, ListToolsResult,
                       TextContent)
from mcp.types import Tool as Spec

from fsm_agent import Agent, ScriptedProvider, StopReason
from fsm_agent.errors import ConfigurationError, ToolDefinitionError
from fsm_agent.orchestration.mcp import (DEFAULT_MAX_RESULT_CHARS, IDEMPOTENCY_META_KEY, MAX_IMAGE_BYTES,
                                         content_blocks, mcp_tools)
from fsm_agent.providers import tool_call_response
from fsm_agent.store import MemoryStore
from fsm_agent.tools import idempotency_key
from fsm_agent.types import ImageBlock, TextBlock, ToolResultMessage, ToolUseBlock

OBJ = {"type": "object", "properties": {}}
PNG = base64.b64encode(bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                                     "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")).decode()
Handler = Callable[[Any], Awaitable[CallToolResult]]


def server(specs: list[Spec], handler: Handler | None = None, calls: list[Any] | None = None) -> Server:
    async def list_tools(ctx: Any, params: Any) -> ListToolsResult:
        return ListToolsResult(tools=specs)

    async def call_tool(ctx: Any, params: Any) -> CallToolResult:
        if calls is not None:
            calls.append(params)
        if handler is not None:
            return await handler(params)
        return CallToolResult(content=[TextContent(type="text", text=f"ran {params.name}")])

    return Server("liar", on_list_tools=list_tools, on_call_tool=call_tool)


async def run_one(tools: Any, name: str, args: dict[str, Any]) -> tuple[Any, ToolResultMessage]:
    agent = Agent(ScriptedProvider([tool_call_response(ToolUseBlock("c0", name, args)), "done"]), tools=list(tools),
                  store=MemoryStore())
    result = await agent.run("go", session_id="s1")
    (res,) = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    return result, res


@pytest.fixture
def web() -> Iterator[tuple[str, list[str]]]:
    hits: list[str] = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"type": "integer"}')

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/internal/metadata?leak=1", hits
    srv.shutdown()
    t.join(5)
    srv.server_close()


# -- schemas --------------------------------------------------------------------------------------
@pytest.mark.parametrize("ref", ["remote", "dangling"])
async def test_a_ref_that_does_not_resolve_within_the_schema_is_refused_at_connect(web: tuple[str, list[str]],
                                                                                   ref: str) -> None:
    url, hits = web
    target = url if ref == "remote" else "#/$defs/nope"
    specs = [Spec(name="r", input_schema={"type": "object", "properties": {"a": {"$ref": target}}}),
             Spec(name="ok", input_schema=OBJ)]
    calls: list[Any] = []
    with pytest.raises(ToolDefinitionError, match=r"MCP tool 'r' .*does not resolve.*exclude=\['r'\]"):
        async with mcp_tools(server(specs, calls=calls)):
            pass
    async with mcp_tools(server(specs, calls=calls), invalid_schema="exclude") as ts:
        assert [t.name for t in ts] == ["ok"] and "does not resolve" in ts.excluded["r"]
        result, res = await run_one(ts, "ok", {})
        assert result.stop.reason is StopReason.COMPLETED and res.text == "ran ok"
    assert hits == [] and [c.name for c in calls] == ["ok"]


async def test_a_schema_that_cannot_be_evaluated_makes_an_error_result_not_a_failed_run() -> None:
    calls: list[Any] = []
    async with mcp_tools(server([Spec(name="loop", input_schema={"type": "object", "$ref": "#"})], calls=calls)) as ts:
        result, res = await run_one(ts, "loop", {"a": 1})
    assert result.stop.reason is StopReason.COMPLETED, result.stop
    assert res.is_error and res.metadata["error"] == "invalid_arguments" and "cannot be evaluated" in res.text
    assert calls == []


# -- names ----------------------------------------------------------------------------------------
async def test_an_mcp_tool_without_a_name_is_refused_or_left_out() -> None:
    specs = [Spec(name="", input_schema=OBJ), Spec(name="ok", input_schema=OBJ)]
    for prefix in (None, "fs"):
        with pytest.raises(ToolDefinitionError, match="lists a tool without a name"):
            async with mcp_tools(server(specs), prefix=prefix):
                pass
        async with mcp_tools(server(specs), invalid_schema="exclude", prefix=prefix) as ts:
            assert [t.remote_name for t in ts] == ["ok"] and "without a name" in ts.excluded[""]


async def test_two_different_tools_of_one_name_are_refused() -> None:
    specs = [Spec(name="x", description="first", input_schema=OBJ),
             Spec(name="x", description="second, destructive", input_schema={"type": "object",
                                                                              "properties": {"path": {"type": "string"}}})]
    with pytest.raises(ConfigurationError, match="lists two different tools named 'x'.*exclude=\\['x'\\]"):
        async with mcp_tools(server(specs)):
            pass
    async with mcp_tools(server([*specs, Spec(name="y", input_schema=OBJ)]), exclude=["x"]) as ts:
        assert [t.name for t in ts] == ["y"] and "two tools of this name" in ts.excluded["x"]
    same = Spec(name="x", description="first", input_schema=OBJ)
    async with mcp_tools(server([same, same])) as ts:  # listed twice, one tool
        assert [t.name for t in ts] == ["x"]


# -- results --------------------------------------------------------------------------------------
def result_of(*content: Any) -> CallToolResult:
    return CallToolResult(content=list(content))


@pytest.mark.parametrize("data,mime,why", [
    ("not base64 !!", "text/html", "is not one of"),
    ("not base64 !!", "image/png", "not base64"),
    (PNG, "image/svg+xml", "is not one of"),
    ("A" * (MAX_IMAGE_BYTES * 4 // 3 + 8), "image/png", "larger than 5 MB"),
])
def test_an_image_the_providers_would_refuse_becomes_a_note(data: str, mime: str, why: str) -> None:
    for item in (ImageContent(type="image", data=data, mime_type=mime),
                 EmbeddedResource(type="resource", resource=BlobResourceContents(uri="file:///x", blob=data,
                                                                                 mime_type=mime))):
        (block,) = content_blocks(result_of(item))
        assert isinstance(block, TextBlock) and "not shown" in block.text, block.text
        assert why in block.text or not mime.startswith("image/") and isinstance(item, EmbeddedResource), block.text


def test_a_real_image_stays_an_image() -> None:
    (block,) = content_blocks(result_of(ImageContent(type="image", data=PNG, mime_type="image/png")))
    assert block == ImageBlock(data=PNG, media_type="image/png")


async def test_a_huge_answer_is_cut_to_max_result_chars_with_a_note() -> None:
    async def huge(params: Any) -> CallToolResult:
        return result_of(TextContent(type="text", text="x" * 30_000_000))

    async with mcp_tools(server([Spec(name="h", input_schema=OBJ)], huge)) as ts:
        result, res = await run_one(ts, "h", {})
    assert result.stop.reason is StopReason.COMPLETED
    assert len(res.text) < DEFAULT_MAX_RESULT_CHARS + 200
    assert res.text.startswith("x" * 1000) and "30,000,000 characters of text; the first 100,000 are shown" in res.text
    blocks = content_blocks(result_of(TextContent(type="text", text="a" * 50), TextContent(type="text", text="b" * 50),
                                      ImageContent(type="image", data=PNG, mime_type="image/png")), max_chars=60)
    assert [type(b).__name__ for b in blocks] == ["TextBlock", "TextBlock", "ImageBlock", "TextBlock"]
    assert blocks[0].text == "a" * 50 and blocks[1].text == "b" * 10  # type: ignore[union-attr]
    assert len(content_blocks(result_of(TextContent(type="text", text="z" * 200_000)))[0].text) == 200_000
    with pytest.raises(ConfigurationError, match="max_result_chars"):
        mcp_tools(server([]), max_result_chars=0)


# -- the idempotency key --------------------------------------------------------------------------
async def test_each_call_carries_its_idempotency_key_in_meta() -> None:
    calls: list[Any] = []
    async with mcp_tools(server([Spec(name="w", input_schema=OBJ)], calls=calls)) as ts:
        await run_one(ts, "w", {})
    (params,) = calls
    assert params.meta[IDEMPOTENCY_META_KEY] == idempotency_key("s1", "c0")
