"""fsm_agent's A2A client against a hostile server (a real aiohttp server on loopback answering each
request with a canned body): every bad answer is a typed error naming what was wrong, and the
tool turns it into an error result, never a crash."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from a2a_peers import Live
from fsm_agent import Agent, ScriptedProvider
from fsm_agent.orchestration.a2a import (A2AClient, A2AConnectionError, A2AHTTPError, A2AProtocolError,
                                         A2ARemoteError, AgentCard, AgentCardError, remote_agent_tool)
from fsm_agent.providers import tool_call_response
from fsm_agent.store import MemoryStore
from fsm_agent.types import ToolResultMessage, ToolUseBlock

ANSWER: dict[str, Any] = {}


async def endpoint(request: web.Request) -> web.StreamResponse:
    status, ctype, body = ANSWER["now"]
    if ctype == "drop":
        request.transport.abort()  # type: ignore[union-attr]
        return web.Response()
    return web.Response(status=status, body=body, content_type=ctype)


def card(base: str, streaming: bool = True) -> AgentCard:
    return AgentCard.parse({"name": "hostile", "description": "answers badly", "capabilities": {"streaming": streaming},
                            "supportedInterfaces": [{"url": base + "/rpc", "protocolBinding": "JSONRPC",
                                                     "protocolVersion": "1.0"}]})


CASES: list[tuple[str, tuple[int, str, bytes], type[Exception], str]] = [
    ("not json", (200, "application/json", b"<html>oops"), A2AProtocolError, "not JSON"),
    ("a list", (200, "application/json", b"[1, 2]"), A2AProtocolError, "not a JSON-RPC 2.0 response"),
    ("no result", (200, "application/json", b'{"jsonrpc": "2.0", "id": 1}'), A2AProtocolError,
     "neither 'result' nor 'error'"),
    ("error not object", (200, "application/json", b'{"jsonrpc": "2.0", "id": 1, "error": "bad"}'),
     A2AProtocolError, "'error' is not an object"),
    ("remote error", (200, "application/json",
                      b'{"jsonrpc": "2.0", "id": 1, "error": {"code": -32001, "message": "gone",'
                      b' "data": [{"reason": "TASK_NOT_FOUND"}]}}'), A2ARemoteError, "error -32001: gone"),
    ("not a task", (200, "application/json", b'{"jsonrpc": "2.0", "id": 1, "result": {"state": "x"}}'),
     A2AProtocolError, "expected an A2A Task"),
    ("http 500", (500, "text/plain", b"boom"), A2AHTTPError, "HTTP 500"),
    ("http 401", (401, "text/plain", b"who are you"), A2AHTTPError, "give the agent's token"),
    ("dropped", (200, "drop", b""), A2AConnectionError, "GetTask"),
]

STREAM_CASES: list[tuple[str, tuple[int, str, bytes], type[Exception], str]] = [
    ("frame not json", (200, "text/event-stream", b"data: {nope\n\n"), A2AProtocolError, "not JSON"),
    ("unknown kind", (200, "text/event-stream", b'data: {"jsonrpc": "2.0", "id": 1, "result": {"weird": {}}}\n\n'),
     A2AProtocolError, "not one of task, message"),
    ("error frame", (200, "text/event-stream", b'event: error\ndata: {"jsonrpc": "2.0", "id": 1, "error": '
                                                b'{"code": -32603, "message": "it broke"}}\n\n'),
     A2ARemoteError, "it broke"),
    ("json instead of a stream", (200, "application/json", b'{"jsonrpc": "2.0", "id": 1, "result": {"task": {}}}'),
     A2AProtocolError, "expected an event stream"),
]


@pytest.mark.parametrize(("name", "answer", "error", "fragment"), CASES, ids=[c[0] for c in CASES])
async def test_bad_answers_are_typed_errors(name: str, answer: tuple[int, str, bytes], error: type[Exception],
                                            fragment: str) -> None:
    app = web.Application()
    app.router.add_post("/rpc", endpoint)
    ANSWER["now"] = answer
    async with Live(app) as live, A2AClient(card(live.base)) as client:
        with pytest.raises(error, match=fragment):
            await client.get_task("t1")


@pytest.mark.parametrize(("name", "answer", "error", "fragment"), STREAM_CASES, ids=[c[0] for c in STREAM_CASES])
async def test_bad_streams_are_typed_errors(name: str, answer: tuple[int, str, bytes], error: type[Exception],
                                            fragment: str) -> None:
    app = web.Application()
    app.router.add_post("/rpc", endpoint)
    ANSWER["now"] = answer
    async with Live(app) as live, A2AClient(card(live.base)) as client:
        with pytest.raises(error, match=fragment):
            [ev async for ev in client.subscribe("t1")]


async def test_the_tool_answers_a_hostile_server_with_an_error_result() -> None:
    app = web.Application()
    app.router.add_post("/rpc", endpoint)
    ANSWER["now"] = (200, "application/json", b"<html>oops")
    async with Live(app) as live:
        ask = remote_agent_tool(card(live.base), name="ask")
        agent = Agent(ScriptedProvider([tool_call_response(ToolUseBlock("c0", "ask", {"message": "hi"})), "ok"]),
                      tools=[ask], store=MemoryStore())
        result = await agent.run("go")
        (res,) = [m for m in result.messages if isinstance(m, ToolResultMessage)]
        assert res.is_error and res.metadata == {"error": "a2a_protocol"} and "not JSON" in res.text
        assert result.output == "ok"


@pytest.mark.parametrize(("data", "fragment"), [
    ([], "not a JSON object"),
    ({"supportedInterfaces": []}, "has no 'name'"),
    ({"name": "x"}, "no 'supportedInterfaces' list"),
    ({"name": "x", "supportedInterfaces": [{"protocolBinding": "JSONRPC", "protocolVersion": "2.0", "url": "u"}]},
     "offered: JSONRPC 2.0"),
    ({"name": "x", "supportedInterfaces": ["junk", {"protocolBinding": "JSONRPC", "protocolVersion": "1.0"}]},
     "no JSONRPC interface"),
])
def test_unusable_cards_are_refused_by_name(data: Any, fragment: str) -> None:
    with pytest.raises(AgentCardError, match=fragment):
        AgentCard.parse(data)
