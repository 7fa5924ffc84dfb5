"""A connection dropped in the middle of a line ends FAILED_RETRYABLE and can be resumed (issue 9, item 10).

Real local servers write part of a stream, stop in the middle of a line (inside the JSON of an SSE
``data:`` line, or inside a multi-byte character) and close the connection, in both framings a
server can use: chunked transfer (the client sees the body end early) and a close-delimited body
(``Connection: close`` without a length: the cut looks like a clean end of the body, and the half
line is all the client has). Either way the error is a retryable ``ProviderConnectionError`` that
keeps what was decoded before the cut; the run stops FAILED_RETRYABLE with that text kept, marked
interrupted, and ``agent.resume`` completes it. On the Chat and Anthropic protocols.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from fsm_agent import Agent, StopReason
from fsm_agent.errors import ProviderConnectionError, ProviderProtocolError
from fsm_agent.providers import ProviderConfig, RetryPolicy, create_provider
from fsm_agent.store import SQLiteStore
from fsm_agent.types import AssistantMessage, ErrorEvent, MessageComplete, MessageRequest, UserMessage

REQ = MessageRequest(model="m", messages=(UserMessage("hi"),))


# -- stream bodies ---------------------------------------------------------------------------------
def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    c = {"id": "c1", "object": "chat.completion.chunk", "model": "m",
         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n"


def anthropic_event(payload: dict[str, Any]) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def chat_stream(*pieces: str) -> tuple[bytes, list[bytes]]:
    """(the stream's head, one line per text piece, then the end); joined, a whole stream."""
    head = chat_chunk({"role": "assistant", "content": ""})
    lines = [chat_chunk({"content": p}) for p in pieces]
    return head, lines + [chat_chunk({}, "stop") + b"data: [DONE]\n\n"]


def anthropic_stream(*pieces: str) -> tuple[bytes, list[bytes]]:
    head = (anthropic_event({"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
        "stop_reason": None, "usage": {"input_tokens": 5, "output_tokens": 1}}})
        + anthropic_event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}))
    lines = [anthropic_event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}})
             for p in pieces]
    end = (anthropic_event({"type": "content_block_stop", "index": 0})
           + anthropic_event({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                              "usage": {"output_tokens": 7}})
           + anthropic_event({"type": "message_stop"}))
    return head, lines + [end]


STREAMS = {"chat": chat_stream, "anthropic": anthropic_stream}


def whole(protocol: str, *pieces: str) -> bytes:
    head, lines = STREAMS[protocol](*pieces)
    return head + b"".join(lines)


def cut(protocol: str, kept: str, cut_piece: str = "and then the rest of the answer") -> bytes:
    """A stream that delivered ``kept`` and stops in the middle of the next line (inside its JSON)."""
    head, lines = STREAMS[protocol](kept, cut_piece)
    line = lines[1]
    return head + lines[0] + line[: line.index(b'"text') + 4 if protocol == "anthropic" else line.index(b"content") + 4]


# -- servers that cut --------------------------------------------------------------------------------
class CuttingServer:
    """A real local HTTP server answering requests in order; an answer marked ``cut`` is written and
    then the connection is closed without finishing it.

    ``framing``: ``chunked`` (an aiohttp web server: ``resp.write(...)`` then
    ``request.transport.close()``) or ``close`` (a raw HTTP/1.1 response with ``Connection: close``
    and no length, the body delimited by the close).
    """

    def __init__(self, answers: list[tuple[bytes, bool]], framing: str) -> None:
        self.answers = list(answers)
        self.framing = framing
        self.bodies: list[dict[str, Any]] = []
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None

    def _next(self, body: bytes) -> tuple[bytes, bool]:
        self.bodies.append(json.loads(body))
        return self.answers.pop(0)

    async def _aiohttp(self, request: web.Request) -> web.StreamResponse:
        data, cut_it = self._next(await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(data)
        if cut_it:
            await asyncio.sleep(0.02)
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    async def _raw(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        data, _ = self._next(await reader.readexactly(length))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + data)
        await writer.drain()
        writer.close()

    async def start(self) -> str:
        if self.framing == "close":
            self._server = await asyncio.start_server(self._raw, "127.0.0.1", 0)
            port = self._server.sockets[0].getsockname()[1]
        else:
            app = web.Application()
            app.router.add_post("/{tail:.*}", self._aiohttp)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def provider(protocol: str, base: str, **cfg: Any) -> Any:
    cfg.setdefault("retry", RetryPolicy(initial_delay=0.01))
    if protocol == "anthropic":
        return create_provider("anthropic", ProviderConfig(base_url=base + "/v1", model="m", api_key="k", **cfg))
    return create_provider("openai-compatible", ProviderConfig(base_url=base, model="m", api_key="k", **cfg))


PROTOCOLS = ["chat", "anthropic"]
FRAMINGS = ["chunked", "close"]


# -- the provider call -------------------------------------------------------------------------------
@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_line_cut_after_content_is_a_retryable_connection_error_with_the_partial(protocol: str,
                                                                                        framing: str) -> None:
    server = CuttingServer([(cut(protocol, "Paris is the capital"), True)], framing)
    p = provider(protocol, await server.start())
    events: list[Any] = []
    try:
        with pytest.raises(ProviderConnectionError) as info:
            async for ev in p.chat_stream(REQ):
                events.append(ev)
    finally:
        await p.aclose()
        await server.close()
    err = info.value
    assert err.retryable and err.kind == "connection"
    assert err.partial is not None and err.partial.text == "Paris is the capital"
    assert isinstance(events[-1], ErrorEvent) and events[-1].kind == "connection"
    assert len(server.bodies) == 1  # content had streamed: not replayed inside the call


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_cut_before_any_content_is_retried_inside_the_call(protocol: str, framing: str) -> None:
    head, lines = STREAMS[protocol]("x")
    first = head[: len(head) // 2]  # the very first event is cut
    server = CuttingServer([(first, True), (whole(protocol, "Hello", " there"), False)], framing)
    p = provider(protocol, await server.start())
    try:
        events = [ev async for ev in p.chat_stream(REQ)]
    finally:
        await p.aclose()
        await server.close()
    assert isinstance(events[-1], MessageComplete) and events[-1].full_response.text == "Hello there"
    assert len(server.bodies) == 2


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_cut_inside_a_multibyte_character_is_a_connection_error(protocol: str) -> None:
    body = whole(protocol, "Grüße aus Köln")
    at = body.index("ü".encode()) + 1  # between the two bytes of ü
    server = CuttingServer([(body[:at], True)], "close")
    p = provider(protocol, await server.start(), retry=RetryPolicy(max_attempts=1))
    try:
        with pytest.raises(ProviderConnectionError, match="middle of a line"):
            async for _ in p.chat_stream(REQ):
                pass
    finally:
        await p.aclose()
        await server.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_recorded_body_cut_mid_line_decodes_to_the_same_error(protocol: str) -> None:
    p = provider(protocol, "http://127.0.0.1:9")
    with pytest.raises(ProviderConnectionError) as info:
        p.decode_stream_bytes(cut(protocol, "kept text"))
    assert info.value.retryable and info.value.partial is not None and info.value.partial.text == "kept text"
    # a stream that ends between events, with nothing usable, is still the protocol's own error
    head, _ = STREAMS[protocol]("x")
    if protocol == "anthropic":
        with pytest.raises(ProviderProtocolError):
            p.decode_stream_bytes(head[: head.index(b"event: content_block_start")])
    # and a whole body whose last line merely lacks its newline still decodes
    body = whole(protocol, "all", " there")
    assert p.decode_stream_bytes(body.rstrip(b"\n"))[-1].full_response.text == "all there"


# -- the run -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_run_stops_failed_retryable_and_resumes_to_completed(protocol: str, framing: str,
                                                                      tmp_path: Path) -> None:
    server = CuttingServer([(cut(protocol, "The capital of France"), True),
                            (whole(protocol, "The capital of France is Paris."), False)], framing)
    base = await server.start()
    p = provider(protocol, base)
    agent = Agent(p, store=SQLiteStore(str(tmp_path / "s.db")))
    try:
        first = await agent.run("What is the capital of France?")
        assert first.stop.reason is StopReason.FAILED_RETRYABLE, first.stop.detail
        assert first.stop.resumable
        assert first.stop.error is not None and first.stop.error["kind"] == "connection"
        assert first.stop.error["retryable"] is True
        # a failed answer is not history (issue 19 item 1): the streamed part rides the stop only
        assert first.stop.partial == "The capital of France"
        assert not any(isinstance(m, AssistantMessage) for m in first.messages)

        second = await agent.resume(first.session_id)
    finally:
        await p.aclose()
        await server.close()
    assert second.stop.reason is StopReason.COMPLETED, second.stop.detail
    assert second.output == "The capital of France is Paris."
    assert [m.text for m in second.messages if isinstance(m, AssistantMessage)] == [second.output]
    # the resumed request is the first one again: the same history, no trace of the failed answer
    assert server.bodies[-1]["messages"] == server.bodies[0]["messages"]
    assert "The capital of France" not in json.dumps(server.bodies[-1]["messages"])
