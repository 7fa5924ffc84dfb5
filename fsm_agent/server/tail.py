"""Tailing a session's log to one SSE client: the one loop behind every event stream of the app
(``GET /sessions/{sid}/events`` and the run-and-stream route) and A2A's streams
(:mod:`fsm_agent.server.a2a`), which differ only in how an event becomes a frame.

A stream subscribes to the session's wake-ups first and reads the log second (no gap), sends the
events after ``after`` in order (no duplicate), then the live frames that follow the last event it
sent (see :mod:`fsm_agent.server.notify`), and waits. It ends after a ``run_stopped`` that is the
last event of the log while no run of the session is queued or running; at once when the server
stops (clients reconnect with ``Last-Event-ID``); and within :data:`GONE_POLL` seconds of the
client hanging up, even while the session is idle (no write would notice it before the next
heartbeat).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from ..store.base import EventRecord
from .notify import NotifyingStore, Subscription
from .runs import Runner
from .sse import ClientGone, SSEWriter, event_frame

__all__ = ["GONE_POLL", "TERMINAL_EVENT", "LogTail", "client_gone"]

TERMINAL_EVENT = "run_stopped"
"""The event after which a stream may end (when it is the last of the log and nothing is queued)."""
GONE_POLL = 1.0
"""Seconds between two looks, while a stream or a blocking request waits, at whether its client
hung up."""


def client_gone(request: web.Request) -> bool:
    """Whether the client of ``request`` has closed its connection."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def _plain(ev: EventRecord) -> bytes:
    return event_frame(ev)


def _same(frame: bytes, basis: int) -> bytes:
    return frame


class LogTail:
    """The app's open event streams and how they are written; :func:`~fsm_agent.server.create_app`
    makes one (``app[TAIL_KEY]``).

    Args:
        store: the app's store (its notifier wakes the streams).
        runner: whose ``busy`` says whether a run of the session is queued or running.
        heartbeat: seconds of idle before a ``: hb`` comment.
        send_timeout: seconds a write may take before the client is dropped.
        retry_ms: the ``retry:`` sent at the start of a stream that asks for one.
    """

    def __init__(self, store: NotifyingStore, runner: Runner, *, heartbeat: float, send_timeout: float,
                 retry_ms: int) -> None:
        self.store, self.runner = store, runner
        self.heartbeat, self.send_timeout, self.retry_ms = heartbeat, send_timeout, retry_ms
        self.closing = False
        """Set when the server stops: every stream ends, new ones end at once."""
        self.streams: set[Subscription] = set()
        """The subscriptions of the open streams."""

    async def on_shutdown(self, app: web.Application) -> None:
        """End every open stream at once (a client reconnects to the next server with its
        Last-Event-ID): a graceful stop does not wait on them."""
        self.closing = True
        for sub in list(self.streams):
            sub.wake.set()

    async def stream(
        self,
        request: web.Request,
        sid: str,
        after: int,
        *,
        frame: Callable[[EventRecord], Awaitable[bytes | None]] = _plain,
        live: Callable[[bytes, int], bytes | None] = _same,
        first: bytes | None = None,
        retry: bool = True,
        headers: dict[str, str] | None = None,
        on_error: Callable[[Exception], bytes] | None = None,
    ) -> web.StreamResponse:
        """Answer ``request`` with the log of ``sid`` after seq ``after``, then live (module doc).

        Args:
            frame: the frame of a log event, or ``None`` for an event that makes none (default: the
                event as JSON, its seq as ``id:``).
            live: the frame to send for a live frame whose basis is the last event sent, or ``None``
                (default: as it is).
            first: a frame written before the log's (a snapshot).
            retry: send ``retry:`` (:attr:`retry_ms`) first.
            headers: more response headers.
            on_error: the frame written when tailing fails with an unexpected error (then the stream
                ends); ``None``: the error propagates.
        """
        store, notifier = self.store, self.store.notifier
        writer = SSEWriter(request, retry_ms=self.retry_ms if retry else None, send_timeout=self.send_timeout,
                           heartbeat=self.heartbeat, headers=headers)
        if self.closing:  # 200 and an end (with `retry:`): a browser's EventSource reconnects, a 503 would end it
            try:
                await writer.prepare()
                if first is not None:
                    await writer.write(first)
                await writer.close()
            except ClientGone:
                pass
            return writer.response
        sub = notifier.subscribe(sid)  # subscribe first, then read the log: no gap
        self.streams.add(sub)
        try:
            await writer.prepare()
            if first is not None:
                await writer.write(first)
            last, last_type = after, None
            if after > 0:
                prev = await store.read_events(sid, after_seq=after - 1, until_seq=after)
                last_type = prev[-1].type if prev else None
            while True:
                sub.wake.clear()
                for ev in await store.read_events(sid, after_seq=last):
                    if ev.seq <= last:
                        continue
                    data = await frame(ev)
                    if data is not None:
                        await writer.write(data)
                    last, last_type = ev.seq, ev.type
                notifier.observe(sid, last)
                if last_type == TERMINAL_EVENT and not await self.runner.busy(sid):
                    # a run may have been queued after the stop was read: check the log once more
                    if not await store.read_events(sid, after_seq=last, until_seq=last + 1):
                        break  # the stop is the last frame
                    continue
                pending = sub.take_live(last)
                if last_type != TERMINAL_EVENT:  # after a stop, live frames of the ended run are stale
                    for raw in pending:
                        data = live(raw, last)
                        if data is not None:
                            await writer.write(data)
                if self.closing:
                    break
                await self._wait(request, sub, writer)
            await writer.close()
        except ClientGone:
            pass
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if on_error is None:
                raise
            try:
                await writer.write(on_error(e))
                await writer.close()
            except ClientGone:
                pass
        finally:
            self.streams.discard(sub)
            notifier.unsubscribe(sub)
        return writer.response

    async def _wait(self, request: web.Request, sub: Subscription, writer: SSEWriter) -> None:
        """Until ``sub`` is woken, or a heartbeat was sent after :attr:`heartbeat` quiet seconds.

        Raises:
            ClientGone: the client hung up (looked at every :data:`GONE_POLL` seconds).
        """
        loop = asyncio.get_running_loop()
        beat_at = loop.time() + self.heartbeat
        while not sub.wake.is_set():
            if client_gone(request):
                writer.abort()
                raise ClientGone("the client hung up")
            left = beat_at - loop.time()
            if left <= 0:
                await writer.send_heartbeat()
                return
            try:
                async with asyncio.timeout(min(left, GONE_POLL)):
                    await sub.wake.wait()
            except TimeoutError:
                pass
