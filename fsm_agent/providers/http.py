"""The aiohttp layer: one ClientSession per provider, POST with typed errors, SSE reading.

This is the only module of the provider layer that imports aiohttp (besides
the error boundary). Reads use ``StreamReader.readany()`` with the project's own
line splitter (:mod:`.sse`), never ``readline()``/``async for line in
resp.content``, whose line cap (128 KiB in aiohttp 3.13) breaks large events
(case B18).

Timeouts (seed 000 §5.2.7): the first data event must arrive within the
first-token timeout; after it, at most ``chunk_timeout`` seconds may pass
between data events (comment keep-alives do not count). A timeout raises
:class:`~fsm_agent.errors.ProviderTimeoutError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any, NamedTuple, Protocol

import aiohttp

from ..errors import ProviderConnectionError, ProviderProtocolError, ProviderTimeoutError
from .errors import classify_error, map_transport_errors
from .sse import SSEDecoder, ServerSentEvent

__all__ = ["HttpClient", "Interceptor", "iter_sse", "set_interceptor"]

_ERROR_BODY_LIMIT = 1024 * 1024


class Interceptor(Protocol):
    """What :func:`set_interceptor` installs: a recorded-traffic cassette
    (:class:`fsm_agent.testing.Cassette`) that every :class:`HttpClient` of the process consults.

    ``replay`` runs before a request is sent: it returns a response to use instead of the network
    (an object with the ``ClientResponse`` surface the provider layer reads), ``None`` to send it,
    or raises (a changed request, a refused network call). ``recording`` says whether the network's
    exchanges should be handed to ``record``, which gets each one once it has ended, with the
    body's network reads as they came and when (seconds after the request was sent), and whether
    the body was read to its end.
    """

    @property
    def recording(self) -> bool: ...

    def replay(self, url: str, headers: Mapping[str, str], body: bytes, secrets: tuple[str, ...]) -> Any: ...

    def record(self, exchange: Exchange) -> None: ...


class Exchange(NamedTuple):
    """One finished exchange, as :meth:`Interceptor.record` gets it."""

    url: str
    request_headers: dict[str, str]
    request_body: bytes
    status: int
    response_headers: dict[str, str]
    chunks: list[bytes]
    """The body's network reads, in order (one item for a body read whole)."""
    times: list[float]
    """When each read arrived, in seconds after the request was sent."""
    complete: bool
    """The body was read to its end (``False``: the connection dropped, or the reader stopped early)."""
    secrets: tuple[str, ...]
    """The client's secret values (the API key), to scrub."""


_interceptor: Interceptor | None = None


def set_interceptor(interceptor: Interceptor | None) -> Interceptor | None:
    """Install ``interceptor`` for every :class:`HttpClient` of the process (``None`` removes it);
    returns the one it replaces. Used by :class:`fsm_agent.testing.Cassette`; one at a time."""
    global _interceptor
    previous, _interceptor = _interceptor, interceptor
    return previous


class _Tap(list[bytes]):
    """The network reads of one body (``list[bytes]``), each with its arrival time in :attr:`times`."""

    def __init__(self, t0: float) -> None:
        super().__init__()
        self.t0 = t0
        self.times: list[float] = []

    def append(self, chunk: bytes) -> None:
        self.times.append(asyncio.get_running_loop().time() - self.t0)
        super().append(chunk)


class HttpClient:
    """Owns one ``aiohttp.ClientSession`` (created lazily inside the running loop).

    Args:
        provider: profile name, recorded on errors.
        connect_timeout: seconds to establish a connection.
        request_timeout: seconds for a whole non-streaming response (``None``: no limit).
        connector_limit: simultaneous connections per session.
    """

    def __init__(
        self,
        provider: str,
        *,
        connect_timeout: float = 10.0,
        request_timeout: float | None = 600.0,
        connector_limit: int = 256,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.provider = provider
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.connector_limit = connector_limit
        self._session = session
        self._owns_session = session is None
        self.secrets: tuple[str, ...] = ()
        """Values scrubbed from every error (the configured API key), besides key-shaped tokens."""
        self.recorder: Any = None
        """``recorder(url, request_headers, request_body, status, response_headers, response_body)`` sees
        every exchange when set (``fsm_agent.providers.record.Recorder``)."""
        self._sent: dict[int, tuple[str, dict[str, str], bytes, float]] = {}

    @property
    def recording(self) -> bool:
        """Whether exchanges are handed to a recorder (this client's, or an installed interceptor)."""
        return self.recorder is not None or (_interceptor is not None and _interceptor.recording)

    def tap(self, resp: Any) -> list[bytes] | None:
        """A list collecting the network reads of ``resp``'s body (with their times) for
        :meth:`record`, or ``None`` when nothing records."""
        sent = self._sent.get(id(resp))
        return None if sent is None else _Tap(sent[3])

    def record(self, resp: aiohttp.ClientResponse, raw: bytes | list[bytes]) -> None:
        """Hand a finished exchange to the recorders (no-op without one): ``raw`` is the whole
        body, or the list :meth:`tap` returned."""
        sent = self._sent.pop(id(resp), None)
        if sent is None:
            return
        chunks = [c for c in raw if c] if isinstance(raw, list) else [raw]
        if self.recorder is not None:
            self.recorder(sent[0], sent[1], sent[2], resp.status, dict(resp.headers), b"".join(chunks))
        icpt = _interceptor
        if icpt is not None and icpt.recording:
            if isinstance(raw, _Tap):  # iter_sse appends b"" when the body ended
                times = [t for t, c in zip(raw.times, raw) if c]
                complete = bool(raw) and not raw[-1]
            else:
                times = [asyncio.get_running_loop().time() - sent[3]] * len(chunks)
                complete = True
            icpt.record(Exchange(sent[0], sent[1], sent[2], resp.status, dict(resp.headers), chunks, list(times),
                                 complete, self.secrets))

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.connector_limit),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
            )
            self._owns_session = True
        return self._session

    async def aclose(self) -> None:
        if self._session is not None and self._owns_session and not self._session.closed:
            await self._session.close()
        self._session = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *,
                   timeout: float | None = None, timeout_message: str = "") -> aiohttp.ClientResponse:
        """POST ``body``; return the response when its status is < 400.

        ``timeout`` (seconds) bounds the wait for the response headers.

        Raises:
            ProviderError: a typed error for a status >= 400 (body and headers attached),
                a connection failure, or a timeout.
        """
        icpt = _interceptor
        resp = None if icpt is None else icpt.replay(url, headers, body, self.secrets)
        if resp is None:
            session = await self.session()
            sent_at = asyncio.get_running_loop().time()
            try:
                with map_transport_errors(self.provider, f"POST {url}"):
                    async with asyncio.timeout(timeout):
                        resp = await session.post(url, data=body, headers=dict(headers))
            except ProviderTimeoutError as exc:
                if timeout_message:
                    raise ProviderTimeoutError(timeout_message, provider=self.provider) from exc
                raise
            if self.recording:
                self._sent[id(resp)] = (url, dict(headers), body, sent_at)
        if resp.status >= 400:
            with map_transport_errors(self.provider, f"reading the error body of POST {url}"):
                try:
                    chunks: list[bytes] = []
                    size = 0
                    while size < _ERROR_BODY_LIMIT:  # read() returns what has arrived, not the whole body
                        chunk = await resp.content.read(_ERROR_BODY_LIMIT - size)
                        if not chunk:
                            break
                        chunks.append(chunk)
                        size += len(chunk)
                    raw = b"".join(chunks)
                finally:
                    resp.release()
            self.record(resp, raw)
            raise classify_error(resp.status, raw, dict(resp.headers), provider=self.provider, secrets=self.secrets)
        return resp

    async def read_body(self, resp: aiohttp.ClientResponse) -> bytes:
        """The whole body of a non-streaming response, within ``request_timeout``."""
        with map_transport_errors(self.provider, f"reading the response of {resp.url}"):
            try:
                if self.request_timeout is None:
                    raw = await resp.read()
                else:
                    async with asyncio.timeout(self.request_timeout):
                        raw = await resp.read()
            finally:
                resp.release()
        self.record(resp, raw)
        return raw


async def iter_sse(
    resp: aiohttp.ClientResponse,
    decoder: SSEDecoder,
    *,
    provider: str,
    first_event_timeout: float | None,
    chunk_timeout: float | None,
    started: float | None = None,
    tap: list[bytes] | None = None,
) -> AsyncIterator[list[ServerSentEvent]]:
    """Yield the SSE events of ``resp`` as they arrive (the events each network read completed, as
    one non-empty list), enforcing the two stream timeouts.

    Raises:
        ProviderTimeoutError: no data event within ``first_event_timeout`` seconds of ``started``
            (``loop.time()`` when the request was sent; default: now), or a gap
            longer than ``chunk_timeout`` seconds between data events.
        ProviderConnectionError: the connection dropped before the body ended, or the body ended in
            the middle of a line that does not decode (a close-delimited body cut mid-event).
        ProviderProtocolError: from the decoder (bad UTF-8, oversize event).
    """
    loop = asyncio.get_running_loop()
    content = resp.content
    got_first = False
    stalled = False

    def on_deadline() -> None:  # a watchdog, not a per-read timeout: one timer re-armed per data event
        nonlocal stalled
        stalled = True
        resp.close()  # wakes the pending read; the loop below reports the timeout

    def timeout_error() -> ProviderTimeoutError:
        if got_first:
            return ProviderTimeoutError(
                f"stream stalled: no data for {chunk_timeout:g} s between chunks "
                "(raise chunk_timeout if the model is slow)", provider=provider)
        return ProviderTimeoutError(
            f"no first token within {first_event_timeout:g} s "
            "(raise first_token_timeout for slow models or very long prompts)", provider=provider)

    t0 = loop.time() if started is None else started
    watchdog = None if first_event_timeout is None else loop.call_at(t0 + first_event_timeout, on_deadline)
    try:
        while True:
            if watchdog is None and got_first and chunk_timeout is not None:
                # re-armed when reading resumes: the consumer's time between events is not the server's
                watchdog = loop.call_at(loop.time() + chunk_timeout, on_deadline)
            try:
                chunk = await content.readany()
            except aiohttp.ClientPayloadError as exc:
                if stalled:
                    raise timeout_error() from exc
                raise ProviderConnectionError(
                    f"the connection dropped in the middle of the stream ({exc})", provider=provider
                ) from exc
            except (aiohttp.ClientError, ConnectionError) as exc:
                if stalled:
                    raise timeout_error() from exc
                raise ProviderConnectionError(
                    f"the connection failed in the middle of the stream ({type(exc).__name__}: {exc})",
                    provider=provider,
                ) from exc
            if stalled:
                raise timeout_error()
            if not chunk:
                if tap is not None:
                    tap.append(b"")  # the body's end, for the recorders
                break
            if tap is not None:
                tap.append(chunk)
            events = decoder.feed(chunk)
            if events:
                got_first = True
                if watchdog is not None:
                    watchdog.cancel()
                    watchdog = None
                yield events
        try:
            rest = decoder.flush()
        except ProviderProtocolError as exc:
            if not decoder.ended_mid_line:
                raise
            raise ProviderConnectionError(
                f"the connection closed in the middle of a line: the response is incomplete ({exc.message})",
                provider=provider) from exc
        if rest:
            yield rest
    finally:
        if watchdog is not None:
            watchdog.cancel()
        if content.at_eof() and not stalled:
            resp.release()
        else:  # abandoned, stalled or failed mid-body: the connection cannot be reused
            resp.close()


def header_dict(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    return {k.lower(): v for k, v in resp.headers.items()}
