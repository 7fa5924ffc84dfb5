"""MCP tools: an MCP server's tools as fsm_agent tools, against the official SDK's own server.

The peer is ``MCPServer`` from the ``mcp`` package (tests/orchestration/mcp_server.py), in process
and over stdio (a real subprocess). Calls go through a real :class:`~fsm_agent.Agent` with a
:class:`~fsm_agent.ScriptedProvider`; the server's own counters say what reached it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mcp.server import Server
from mcp.types import CallToolResult, ListToolsResult, TextContent
from mcp.types import Tool as MCPToolSpec

from fsm_agent import (
    Agent,
    ConfigurationError,
    ScriptedProvider,
    TextBlock,
    ToolEffect,
    ToolProgress,
    ToolRegistry,
    ToolResultMessage,
    tool,
)
from fsm_agent.errors import ToolDefinitionError
from fsm_agent.orchestration.mcp import MCPConnectionError, MCPToolset, effect_from_annotations, mcp_tools
from fsm_agent.providers import tool_call_response
from fsm_agent.store import MemoryStore
from fsm_agent.tools import execute_tool_call
from fsm_agent.types import ImageBlock, ToolUseBlock

from .mcp_server import PNG_1PX, build_server

SERVER_FILE = Path(__file__).with_name("mcp_server.py")
STDIO = [sys.executable, str(SERVER_FILE)]


async def server_stats(ts: MCPToolset) -> dict[str, Any]:
    """The server's own record (calls per tool, cancellations), read over the toolset's session."""
    result = await ts.client.call_tool("stats", {})
    return dict(result.structured_content or json.loads(result.content[0].text))  # type: ignore[union-attr]


@pytest.fixture(params=["in_process", "stdio"])
async def toolset(request: pytest.FixtureRequest) -> AsyncIterator[MCPToolset]:
    """The test server's tools, prefixed ``t``: in process, and as a subprocess over stdio."""
    server: Any = build_server()[0] if request.param == "in_process" else STDIO
    async with mcp_tools(server, prefix="t") as ts:
        yield ts


def results(provider: ScriptedProvider, request_index: int) -> list[ToolResultMessage]:
    """The tool results the model was sent in request ``request_index`` (the last turn's)."""
    msgs = provider.requests[request_index].messages
    out: list[ToolResultMessage] = []
    for m in reversed(msgs):
        if not isinstance(m, ToolResultMessage):
            break
        out.insert(0, m)
    return out


# -- mapping -------------------------------------------------------------------------------------

async def test_tools_keep_the_servers_schema_and_map_annotations_to_effects(toolset: MCPToolset) -> None:
    by_name = {t.name: t for t in toolset}
    assert {n: t.effect for n, t in by_name.items() if n in ("t_add", "t_put", "t_delete_record", "t_slow_write")} == {
        "t_add": ToolEffect.PURE,  # readOnlyHint
        "t_put": ToolEffect.IDEMPOTENT,  # idempotentHint
        "t_delete_record": ToolEffect.SIDE_EFFECT,  # destructiveHint
        "t_slow_write": ToolEffect.SIDE_EFFECT,  # no annotations: MCP's defaults
    }
    listing = {t.name: t for t in (await toolset.client.list_tools()).tools}
    add = by_name["t_add"]
    assert add.parameters == listing["add"].input_schema and add.remote_name == "add"
    assert add.description == "Add two integers."
    assert by_name["t_files_read"].remote_name == "files.read"  # '.' is not allowed in fsm_agent names
    assert toolset["files.read"] is toolset["t_files_read"]
    assert len(toolset) == len(listing)


async def test_a_prefix_keeps_a_server_tool_apart_from_a_local_tool_of_the_same_name() -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Local add."""
        return a + b

    srv, _ = build_server()
    async with mcp_tools(srv) as plain, mcp_tools(srv, prefix="calc") as prefixed:
        with pytest.raises(ConfigurationError, match="two tools are named 'add'"):
            ToolRegistry([add, *plain])
        assert "calc_add" in ToolRegistry([add, *prefixed])


async def test_effects_can_be_overridden_and_annotations_distrusted() -> None:
    srv, _ = build_server()
    async with mcp_tools(srv, effects={"add": "side_effect", "delete_record": ToolEffect.IDEMPOTENT}) as ts:
        assert ts["add"].effect is ToolEffect.SIDE_EFFECT and ts["delete_record"].effect is ToolEffect.IDEMPOTENT
    async with mcp_tools(srv, trust_annotations=False, effects={"stats": "pure"}) as ts:
        assert {t.name: t.effect for t in ts if t.effect is not ToolEffect.SIDE_EFFECT} == {"stats": ToolEffect.PURE}
    assert effect_from_annotations(None) is ToolEffect.SIDE_EFFECT


async def test_include_exclude_and_names_select_and_rename() -> None:
    srv, _ = build_server()
    async with mcp_tools(srv, include=["add", "put", "files.read"], exclude=["put", "no_such_tool"],
                         names={"files.read": "read_file"}) as ts:
        assert [t.name for t in ts] == ["add", "read_file"]
        assert ts.excluded["put"] == "in exclude=" and ts.excluded["weather"] == "not in include="


@pytest.mark.parametrize(("options", "message"), [
    ({"include": ["add", "nope"]}, r"has no tool 'nope' \(named in include=\); it offers: add, count"),
    ({"effects": {"sub": "pure"}}, r"has no tool 'sub' \(named in effects=\)"),
    ({"names": {"add": "put"}}, r"tools 'add' and 'put' would both be named 'put'"),
])
async def test_options_that_name_missing_tools_or_collide_are_refused_at_connect(options: dict[str, Any],
                                                                               message: str) -> None:
    ts = mcp_tools(build_server()[0], **options)
    with pytest.raises(ConfigurationError, match=message):
        await ts.connect()
    assert not ts.connected  # the connection opened for the listing was closed again


def _schema_server(schema: dict[str, Any]) -> Server[Any]:
    """A low-level server offering ``good`` and ``broken`` (with ``schema``); MCPServer cannot list a bad schema."""

    async def list_tools(ctx: Any, params: Any) -> ListToolsResult:
        return ListToolsResult(tools=[
            MCPToolSpec(name="good", description="fine", input_schema={"type": "object", "properties": {}}),
            MCPToolSpec(name="broken", description="bad schema", input_schema=schema)])

    async def call_tool(ctx: Any, params: Any) -> CallToolResult:
        return CallToolResult(content=[TextContent(type="text", text=f"ran {params.name}")])

    return Server("schemas", on_list_tools=list_tools, on_call_tool=call_tool)


@pytest.mark.parametrize(("schema", "why"), [
    ({"type": "object", "properties": {"x": {"type": "integr"}}}, "invalid JSON Schema"),
    ({"type": "object", "properties": {"x": {"minimum": "three"}}}, "invalid JSON Schema"),
])
async def test_a_tool_with_an_invalid_schema_is_an_error_or_a_documented_exclusion(
        schema: dict[str, Any], why: str, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ToolDefinitionError, match=rf"MCP tool 'broken' of 'schemas'.*{why}.*invalid_schema='exclude'"):
        await mcp_tools(_schema_server(schema)).connect()
    async with mcp_tools(_schema_server(schema), invalid_schema="exclude") as ts:
        assert [t.name for t in ts] == ["good"]
        assert why in ts.excluded["broken"]
    assert any("tool 'broken' left out" in r.getMessage() for r in caplog.records)


def test_content_of_every_kind_becomes_blocks() -> None:
    from mcp.types import (AudioContent, BlobResourceContents, EmbeddedResource, ImageContent, ResourceLink,
                           TextResourceContents)

    from fsm_agent.orchestration.mcp import content_blocks

    result = CallToolResult(content=[
        TextContent(type="text", text="hello"),
        ImageContent(type="image", data=PNG_1PX, mime_type="image/png"),
        AudioContent(type="audio", data="AAAA", mime_type="audio/wav"),
        EmbeddedResource(type="resource", resource=TextResourceContents(uri="file:///a.txt", text="alpha")),
        EmbeddedResource(type="resource", resource=BlobResourceContents(uri="file:///p.png", mime_type="image/png",
                                                                        blob=PNG_1PX)),
        EmbeddedResource(type="resource", resource=BlobResourceContents(uri="file:///x.bin", blob="AAAAAAAA")),
        ResourceLink(type="resource_link", uri="file:///big.csv", name="big.csv"),
    ], structured_content={"answer": 42})
    assert content_blocks(result) == (
        TextBlock("hello"),
        ImageBlock(data=PNG_1PX, media_type="image/png"),
        TextBlock("[audio audio/wav, 3 bytes: not shown]"),
        TextBlock("[resource file:///a.txt]\nalpha"),
        ImageBlock(data=PNG_1PX, media_type="image/png"),
        TextBlock("[resource file:///x.bin, 6 bytes of binary data: not shown]"),
        TextBlock("[resource link file:///big.csv 'big.csv']"),
    )
    preferred = content_blocks(result, prefer_structured=True)
    assert preferred[0] == TextBlock('{"answer":42}') and TextBlock("hello") not in preferred
    assert content_blocks(CallToolResult(content=[], structured_content={"a": 1})) == (TextBlock('{"a":1}'),)


# -- configuration errors ------------------------------------------------------------------------

@pytest.mark.parametrize(("server", "options", "message"), [
    ("python -m my_server", {}, r"not an http\(s\) URL; for a stdio server pass the command line as a list, "
                                r"e.g. \['python', '-m', 'my_server'\]"),
    (42, {}, "unsupported server int"),
    ([], {}, "non-empty list of strings"),
    (["python", 3], {}, "non-empty list of strings"),
    ("http://127.0.0.1:1/mcp", {"prefix": "has space"}, "prefix 'has space' must match"),
    (["python"], {"headers": {"Authorization": "x"}}, "headers= applies to an http"),
    (["python"], {"include": "add"}, "include= takes a list of tool names"),
    (["python"], {"effects": {"add": "dangerous"}}, "effects= values must be one of"),
    (["python"], {"names": {"add": "a.b"}}, r"names\['add'\] = 'a.b' must match"),
    (["python"], {"timeout": 0}, "timeout must be a positive number of seconds"),
    (["python"], {"invalid_schema": "ignore"}, "invalid_schema must be 'raise' or 'exclude'"),
])
def test_bad_configuration_is_a_typed_error_saying_what_to_change(server: Any, options: dict[str, Any],
                                                                    message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        MCPToolset(server, **options)


async def test_a_server_that_cannot_start_or_be_reached_is_a_connection_error() -> None:
    with pytest.raises(MCPConnectionError, match="could not connect to MCP server 'no-such-mcp-server --x'") as info:
        await mcp_tools(["no-such-mcp-server", "--x"]).connect()
    assert isinstance(info.value, ConfigurationError) and isinstance(info.value, ConnectionError)
    with pytest.raises(MCPConnectionError, match=r"could not connect to MCP server 'http://127.0.0.1:9/mcp'"):
        await mcp_tools("http://127.0.0.1:9/mcp", connect_timeout=10).connect()


def _processes_with(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


async def test_a_process_that_never_answers_the_handshake_times_out_and_is_stopped() -> None:
    marker = f"mcp-silent-{uuid.uuid4().hex}"
    ts = mcp_tools([sys.executable, "-c", f"import time; time.sleep(60)  # {marker}"], connect_timeout=1.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(MCPConnectionError, match=r"did not finish the handshake and tool listing within 1 s"):
        await ts.connect()
    assert loop.time() - started < 8.0  # stopped, not waited for
    assert _processes_with(marker) == []  # the subprocess is gone


def test_the_mcp_package_is_imported_only_when_a_toolset_is_made() -> None:
    code = ("import sys, fsm_agent, fsm_agent.orchestration, fsm_agent.orchestration.mcp\n"
            "print(sorted(m for m in sys.modules if m == 'mcp' or m.startswith('mcp.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_without_the_mcp_package_a_typed_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mcp", None)  # makes `import mcp` raise ImportError
    with pytest.raises(ConfigurationError, match=r'pip install "fsm-agent\[mcp\]"'):
        mcp_tools(["python", "server.py"])


# -- lifecycle -----------------------------------------------------------------------------------

async def test_tools_before_connect_and_calls_after_close_are_clear_errors() -> None:
    ts = mcp_tools(build_server()[0])
    with pytest.raises(ConfigurationError, match="is not connected: use 'async with' or await connect()"):
        ts.tools  # noqa: B018
    await ts.connect()
    add = ts["add"]
    await ts.close()
    result = await execute_tool_call(ToolUseBlock("c1", "add", {"a": 1, "b": 2}), ToolRegistry([add]))
    assert result.is_error and result.metadata == {"error": "mcp_closed"}
    assert "its toolset was closed" in result.text
    with pytest.raises(ConfigurationError, match="was closed; make a new one"):
        await ts.connect()


async def test_connect_and_close_may_run_in_different_tasks() -> None:
    """The session lives in a task of its own (anyio scopes are bound to the task that enters them)."""
    ts = mcp_tools(STDIO)
    await asyncio.create_task(ts.connect())
    assert ts.connected and ts.connections == 1
    result = await execute_tool_call(ToolUseBlock("c1", "add", {"a": 2, "b": 2}), ToolRegistry(ts))
    assert result.text == "4"
    await asyncio.create_task(ts.close())
    assert not ts.connected


# -- through an Agent ----------------------------------------------------------------------------

async def test_a_call_reaches_the_server_and_its_result_reaches_the_model(toolset: MCPToolset) -> None:
    provider = ScriptedProvider([tool_call_response(("t_add", {"a": 2, "b": 3})), "the sum is 5"])
    result = await Agent(provider, tools=toolset).run("add 2 and 3")
    assert result.stop.reason.value == "COMPLETED"
    [answer] = results(provider, 1)
    assert (answer.text, answer.is_error, answer.name) == ("5", False, "t_add")
    assert (await server_stats(toolset))["calls"] == {"add": 1}


async def test_bad_arguments_are_refused_by_our_validator_and_never_reach_the_server(toolset: MCPToolset) -> None:
    provider = ScriptedProvider([tool_call_response(("t_add", {"a": "two", "b": 3})),
                                 tool_call_response(("t_add", {"a": 2})),
                                 tool_call_response(("t_add", {"a": 2, "b": 3})), "5"])
    result = await Agent(provider, tools=toolset).run("add")
    assert result.stop.reason.value == "COMPLETED"
    first, second, third = results(provider, 1)[0], results(provider, 2)[0], results(provider, 3)[0]
    assert first.is_error and first.metadata == {"error": "invalid_arguments"}
    assert "a: 'two' is not of type 'integer'" in first.text
    assert second.is_error and "'b' is a required property" in second.text
    assert third.text == "5" and not third.is_error
    assert (await server_stats(toolset))["calls"] == {"add": 1}  # only the valid call was sent


async def test_an_is_error_result_is_a_tool_error_with_the_servers_text(toolset: MCPToolset) -> None:
    store = MemoryStore()
    provider = ScriptedProvider([tool_call_response(("t_fail", {"reason": "disk full"})), "I could not"])
    result = await Agent(provider, tools=toolset, store=store).run("try", session_id="s-fail")
    assert result.stop.reason.value == "COMPLETED"  # an error result, not a failed run
    [answer] = results(provider, 1)
    assert answer.is_error and answer.metadata == {"error": "mcp_tool_error"}
    assert answer.text == "Error executing tool fail: cannot do that: disk full"  # the server's text, as sent
    [entry] = (await store.ledger("s-fail")).values()
    assert entry.status.value == "failed" and entry.tool == "t_fail"


async def test_progress_notifications_become_tool_progress_events_and_log_entries(toolset: MCPToolset) -> None:
    seen: list[ToolProgress] = []

    class Watch:
        def on_tool_progress(self, event: ToolProgress) -> None:
            seen.append(event)

    store = MemoryStore()
    provider = ScriptedProvider([tool_call_response(("t_count", {"n": 3, "delay": 0.01})), "counted"])
    result = await Agent(provider, tools=toolset, observers=[Watch()], store=store).run("count", session_id="s-p")
    await asyncio.sleep(0)
    assert result.stop.reason.value == "COMPLETED"
    assert [(e.progress, e.total, e.message, e.tool) for e in seen] == [
        (1.0, 3.0, "count step 1", "t_count"), (2.0, 3.0, "count step 2", "t_count"),
        (3.0, 3.0, "count step 3", "t_count")]
    logged = [e for e in await store.read_events("s-p") if e.type == "tool_progress"]
    assert len(logged) == 3
    assert results(provider, 1)[0].text == "count finished 3 steps"


async def test_the_ledger_records_each_tools_effect_so_a_destructive_call_is_never_rerun_silently(
        toolset: MCPToolset) -> None:
    store = MemoryStore()
    provider = ScriptedProvider([tool_call_response(("t_delete_record", {"key": "k"}), ("t_put", {"key": "k",
                                                                                                 "value": "v"}),
                                                    ("t_add", {"a": 1, "b": 1})), "done"])
    result = await Agent(provider, tools=toolset, store=store).run("go", session_id="s-fx")
    assert result.stop.reason.value == "COMPLETED"
    effects = {e.tool: (e.effect, e.status.value) for e in (await store.ledger("s-fx")).values()}
    assert effects == {"t_delete_record": ("side_effect", "completed"), "t_put": ("idempotent", "completed"),
                       "t_add": ("pure", "completed")}


async def test_images_and_resources_reach_the_model_as_blocks(toolset: MCPToolset) -> None:
    provider = ScriptedProvider([tool_call_response(("t_report", {})), "seen"])
    await Agent(provider, tools=toolset).run("report")
    [answer] = results(provider, 1)
    assert [type(b).__name__ for b in answer.content] == ["TextBlock", "ImageBlock", "TextBlock", "TextBlock"]
    image = answer.content[1]
    assert isinstance(image, ImageBlock) and image.data == PNG_1PX and image.media_type == "image/png"
    assert answer.content[2] == TextBlock("[resource file:///notes.txt (text/plain)]\nnote one")


def test_the_module_surface_is_sorted_and_documented() -> None:
    import inspect

    from fsm_agent.orchestration import mcp

    assert mcp.__all__ == sorted(mcp.__all__)
    for name in mcp.__all__:
        obj = getattr(mcp, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"
    for name in ("connect", "close", "tools", "client", "connected", "name"):
        assert inspect.getdoc(getattr(MCPToolset, name)), f"MCPToolset.{name} has no docstring"
