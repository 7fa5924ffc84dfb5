"""A small Server-Sent Events writer on :class:`aiohttp.web.StreamResponse`.

Wire rules (``../shared/design/server.md``): frames are pre-encoded bytes; ``id:`` is the event's
log ``seq``; ``event:`` its type; ``data:`` the compact JSON of the event (a multi-line payload is
split into several ``data:`` lines). ``retry:`` is sent once, a ``: hb`` comment on idle. No
compression, and headers that stop proxies from buffering. ``id`` and ``event`` must not contain
CR, LF or NUL (``ValueError``). Every write is bounded by a send timeout: a dead or slow client is
dropped (:class:`ClientGone`), so nothing upstream ever waits on a client.
"""

from __future__ import annotations

import asyncio
import re
import socket
import orjson
from aiohttp import web

from ..store.base import EventRecord

__all__ = ["HEADERS", "ClientGone", "SSEWriter", "encode_frame", "event_frame", "event_json"]

HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
"""Response headers of every event stream."""

HEARTBEAT = b": hb\n\n"
_FAST_BUFFER = 16 * 1024
"""Below this many bytes waiting in the transport, a write goes out without a send-timeout timer."""
_LINES = re.compile(rb"\r\n|\r|\n")
_BAD = ("\r", "\n", "\0")


class ClientGone(Exception):
    """The client disconnected, or did not take a frame within the send timeout (it was dropped)."""


def _field(name: str, value: str) -> bytes:
    if any(c in value for c in _BAD):
        raise ValueError(f"SSE {name} must not contain CR, LF or NUL: {value!r}")
    return f"{name}: {value}\n".encode()


def encode_frame(data: bytes | str, *, id: int | str | None = None, event: str | None = None,  # noqa: A002
                 retry: int | None = None) -> bytes:
    """One SSE frame as bytes (ends with a blank line).

    Raises:
        ValueError: ``id`` or ``event`` contains CR, LF or NUL.
    """
    out = bytearray()
    if id is not None:
        out += _field("id", str(id))
    if event is not None:
        out += _field("event", event)
    if retry is not None:
        out += b"retry: %d\n" % int(retry)
    raw = data.encode() if isinstance(data, str) else data
    for line in _LINES.split(raw):
        out += b"data: " + line + b"\n"
    out += b"\n"
    return bytes(out)


def event_json(record: EventRecord) -> bytes:
    """The compact JSON of a log event, as sent in ``data:``."""
    return orjson.dumps({"seq": record.seq, "type": record.type, "ts": record.ts, "turn_id": record.turn_id,
                         "event_id": record.event_id, "payload": record.payload},
                        option=orjson.OPT_NON_STR_KEYS)


_TYPES: dict[str, bytes] = {}
"""Event types already checked, with their encoded ``event:`` line."""


def event_frame(record: EventRecord) -> bytes:
    """The SSE frame of a log event: ``id`` = seq, ``event`` = type, ``data`` = :func:`event_json`.

    The same bytes as ``encode_frame(event_json(record), id=record.seq, event=record.type)``, built
    in one step: compact JSON has no line breaks (orjson escapes them), so it is one ``data:`` line.

    Raises:
        ValueError: the type contains CR, LF or NUL.
    """
    line = _TYPES.get(record.type)
    if line is None:
        line = _TYPES[record.type] = _field("event", record.type)
    return b"id: %d\n%sdata: %s\n\n" % (record.seq, line, event_json(record))


class SSEWriter:
    """Writes pre-encoded frames to one client.

    Args:
        request: the request to answer.
        retry_ms: the reconnection delay sent once (``retry:``), or ``None``.
        send_timeout: seconds a write may take before the client is dropped.
        heartbeat: seconds of idle before a ``: hb`` comment (used by callers through :attr:`heartbeat`).
    """

    def __init__(self, request: web.Request, *, retry_ms: int | None = 3000, send_timeout: float = 10.0,
                 heartbeat: float = 15.0, headers: dict[str, str] | None = None) -> None:
        self.request = request
        self.retry_ms = retry_ms
        self.send_timeout = send_timeout
        self.heartbeat = heartbeat
        self.response = web.StreamResponse(status=200, headers={**HEADERS, **(headers or {})})
        self.closed = False

    async def prepare(self) -> web.StreamResponse:
        """Send the headers (and ``retry:``); sets ``TCP_USER_TIMEOUT`` where the platform has it."""
        transport = self.request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None and hasattr(socket, "TCP_USER_TIMEOUT") and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(self.send_timeout * 1000)))
            except OSError:
                pass
        await self.response.prepare(self.request)
        if self.retry_ms is not None:
            await self.write(b"retry: %d\n\n" % int(self.retry_ms))
        return self.response

    async def write(self, frame: bytes) -> None:
        """Write one pre-encoded frame.

        Raises:
            ClientGone: the client is gone, or did not take the frame within ``send_timeout`` (the
                connection is then aborted).
        """
        if self.closed:
            raise ClientGone("the stream is closed")
        transport = self.request.transport
        try:
            if transport is not None and transport.get_write_buffer_size() < _FAST_BUFFER:
                # the socket takes data: the write cannot wait on the client (aiohttp drains only
                # when the transport's buffer is over its high-water mark), so no timer is needed
                await self.response.write(frame)
                return
            async with asyncio.timeout(self.send_timeout):
                await self.response.write(frame)
        except TimeoutError as e:
            self.abort()
            raise ClientGone(f"client took no data for {self.send_timeout}s: dropped") from e
        except (ConnectionError, RuntimeError) as e:  # RuntimeError: aiohttp's "connection closed"
            self.abort()
            raise ClientGone(str(e) or type(e).__name__) from e

    async def send(self, data: bytes | str, *, id: int | str | None = None,  # noqa: A002
                   event: str | None = None) -> None:
        """Encode and write one event (see :func:`encode_frame`)."""
        await self.write(encode_frame(data, id=id, event=event))

    async def send_heartbeat(self) -> None:
        """Write the ``: hb`` comment."""
        await self.write(HEARTBEAT)

    def abort(self) -> None:
        """Drop the connection at once."""
        self.closed = True
        transport = self.request.transport
        if transport is not None:
            transport.abort()

    async def close(self) -> None:
        """End the stream normally."""
        if self.closed:
            return
        self.closed = True
        try:
            async with asyncio.timeout(self.send_timeout):
                await self.response.write_eof()
        except (TimeoutError, ConnectionError, RuntimeError):
            self.abort()

    def __repr__(self) -> str:
        return f"SSEWriter({self.request.path!r}, closed={self.closed})"
