"""Serve recorded provider responses from a real local HTTP server.

The provider under test runs its real HTTP path (aiohttp client, SSE reader,
protocol parser) against 127.0.0.1. Bodies can be written in irregular pieces
(``chunk_sizes``) so that every read boundary the client meets is exercised,
and a connection can be dropped part-way (``drop_after``) to test recovery.

    >>> server = ReplayServer([RecordedResponse(200, b'data: {...}\\n\\n', "text/event-stream")])
    >>> base_url = await server.start()      # doctest: +SKIP
    >>> ...                                  # point a provider at base_url
    >>> await server.close()                 # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Iterable, Sequence
from typing import Any

import orjson
from aiohttp import web
from attrs import define, field, frozen

from ..providers.record import load_recording

from ._loopback import serve_on_loopback

__all__ = ["RecordedResponse", "ReceivedRequest", "ReplayServer"]


@frozen
class RecordedResponse:
    """One recorded response: status, exact body bytes, content type and extra headers."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(factory=dict)
    """Extra response headers (``retry-after`` ...)."""
    drop_after: int | None = None
    """Close the connection after this many body bytes (a dropped stream), or ``None``."""
    delay: float = 0.0
    """Seconds to wait before sending the headers."""
    chunk_delay: float = 0.0
    """Seconds between body pieces."""


@frozen
class ReceivedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


@define
class ReplayServer:
    """Answers every request with the next recorded response, in order.

    Args:
        responses: what to answer, in order (the last one repeats when ``repeat_last``).
        chunk_sizes: sizes (bytes) cycled through when writing a body; ``None`` writes it whole.
        seed: when given with ``chunk_sizes=None``, pick random piece sizes from this seed instead.
    """

    responses: Sequence[RecordedResponse]
    chunk_sizes: Sequence[int] | None = None
    seed: int | None = None
    repeat_last: bool = False
    requests: list[ReceivedRequest] = field(factory=list)
    _runner: web.AppRunner | None = None
    _pos: int = 0
    base_url: str = ""

    def _sizes(self) -> Iterable[int]:
        if self.chunk_sizes:
            return itertools.cycle(self.chunk_sizes)
        if self.seed is not None:
            rng = random.Random(self.seed)
            choices = (1, 2, 3, 5, 7, 13, 64, 257, 1024, 4096)
            return (rng.choice(choices) for _ in itertools.count())
        return itertools.repeat(1 << 30)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(ReceivedRequest(request.method, request.path_qs, dict(request.headers), body))
        if self._pos < len(self.responses):
            rec = self.responses[self._pos]
            self._pos += 1
        elif self.repeat_last and self.responses:
            rec = self.responses[-1]
        else:
            return web.json_response({"error": {"message": "replay script exhausted", "type": "test_error"}},
                                     status=500)
        if rec.delay:
            await asyncio.sleep(rec.delay)
        resp = web.StreamResponse(status=rec.status, headers={"Content-Type": rec.content_type, **rec.headers})
        if rec.drop_after is None:
            resp.content_length = len(rec.body)
        await resp.prepare(request)
        data = rec.body if rec.drop_after is None else rec.body[: rec.drop_after]
        pos = 0
        sizes = iter(self._sizes())
        while pos < len(data):
            n = next(sizes)
            await resp.write(data[pos: pos + n])
            pos += n
            if rec.chunk_delay:
                await asyncio.sleep(rec.chunk_delay)
            elif self.chunk_sizes or self.seed is not None:
                await asyncio.sleep(0)
        if rec.drop_after is not None:
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    @classmethod
    def from_recording(cls, path: Any, **kw: Any) -> ReplayServer:
        """Serve the responses of a recording file (:mod:`fsm_agent.providers.record` format, or a
        :class:`~fsm_agent.testing.Cassette`'s file), in order."""
        responses = []
        for ex in load_recording(path):
            r = ex["response"]
            body = r["body"]
            if r.get("body_base64") is not None:  # a cassette's body that is not UTF-8
                import base64

                raw = base64.b64decode(r["body_base64"])
            else:
                raw = body.encode() if isinstance(body, str) else orjson.dumps(body)
            headers = {k.lower(): v for k, v in (r.get("headers") or {}).items()}
            ctype = headers.pop("content-type", "text/event-stream" if isinstance(body, str) else "application/json")
            keep = {k: v for k, v in headers.items() if k.startswith(("retry-after", "x-ratelimit"))}
            responses.append(RecordedResponse(int(r.get("status_code", 200)), raw, ctype, keep))
        return cls(responses, **kw)

    async def start(self) -> str:
        """Start on a free loopback port; returns the base URL (``http://127.0.0.1:PORT``)."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner, self.base_url = await serve_on_loopback(app)
        return self.base_url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ReplayServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
