"""The SSE writer: exact frame bytes, header rules, CR/LF/NUL rejection, heartbeat, send timeout."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fsm_agent.server.sse import ClientGone, SSEWriter, encode_frame, event_frame, event_json
from fsm_agent.store.base import EventRecord


def test_frame_bytes_exactly() -> None:
    assert encode_frame(b'{"a":1}', id=3, event="message") == b'id: 3\nevent: message\ndata: {"a":1}\n\n'
    assert encode_frame("x") == b"data: x\n\n"
    assert encode_frame("", retry=2500) == b"retry: 2500\ndata: \n\n"


def test_multi_line_data_is_split_into_data_lines() -> None:
    assert encode_frame("a\nb\r\nc\rd", id=1) == b"id: 1\ndata: a\ndata: b\ndata: c\ndata: d\n\n"


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\0b", "\n"])
def test_cr_lf_nul_rejected_in_id_and_event(bad: str) -> None:
    with pytest.raises(ValueError):
        encode_frame("x", id=bad)
    with pytest.raises(ValueError):
        encode_frame("x", event=bad)


def test_event_frame_is_seq_type_and_compact_json() -> None:
    rec = EventRecord("s1", 7, "message", {"text": "hi\nthere", "n": 1}, turn_id="s1:1", ts=1.5, event_id="e7")
    data = event_json(rec)
    assert orjson.loads(data) == {"seq": 7, "type": "message", "ts": 1.5, "turn_id": "s1:1", "event_id": "e7",
                                  "payload": {"text": "hi\nthere", "n": 1}}
    assert b"\n" not in data and b" " not in data.replace(b"hi\\nthere", b"")
    assert event_frame(rec) == b"id: 7\nevent: message\ndata: " + data + b"\n\n"


async def test_headers_retry_once_heartbeat_and_no_compression() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        w = SSEWriter(request, retry_ms=1234, heartbeat=0.05)
        await w.prepare()
        await w.send("one", id=1, event="e")
        await w.send_heartbeat()
        await w.send("two", id=2, event="e")
        await w.close()
        return w.response

    app = web.Application()
    app.router.add_get("/s", handler)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        resp = await client.get("/s", headers={"Accept-Encoding": "gzip, deflate"})
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        assert resp.headers["Cache-Control"] == "no-cache"
        assert resp.headers["X-Accel-Buffering"] == "no"
        assert "Content-Encoding" not in resp.headers
        body = await resp.read()
    assert body == b"retry: 1234\n\nid: 1\nevent: e\ndata: one\n\n: hb\n\nid: 2\nevent: e\ndata: two\n\n"


async def test_a_write_that_never_completes_drops_the_client_after_the_send_timeout() -> None:
    class Stuck:
        async def write(self, data: bytes) -> None:
            await asyncio.sleep(3600)

    aborted: list[bool] = []
    transport = SimpleNamespace(abort=lambda: aborted.append(True), get_extra_info=lambda name: None,
                                get_write_buffer_size=lambda: 1 << 20)  # the client reads nothing: the buffer is full
    w = SSEWriter(SimpleNamespace(transport=transport, path="/x"), send_timeout=0.1)  # type: ignore[arg-type]
    w.response = Stuck()  # type: ignore[assignment]
    t0 = time.monotonic()
    with pytest.raises(ClientGone):
        await w.write(b"data: x\n\n")
    assert time.monotonic() - t0 < 1.0
    assert aborted == [True] and w.closed
    with pytest.raises(ClientGone):
        await w.write(b"data: y\n\n")
