"""Server-Sent Events decoding: pure, incremental, protocol-agnostic.

Follows the WHATWG HTML "event stream interpretation" algorithm
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):

* lines end in CR, LF or CRLF, and a CRLF may be split across two reads;
* a line starting with ``:`` is a comment (keep-alives such as llama.cpp's bare ``:``);
* ``field:value`` strips exactly one leading space from the value (``data:x`` and
  ``data: x`` both give ``x``);
* repeated ``data`` lines of one event are joined with ``\\n`` (case B16);
* an empty line dispatches the event, unless its data buffer is empty: an
  ``id:`` line and a comment alone dispatch nothing (the openai SDK bug, B16);
* ``id`` sets the last event id (ignored if it contains NUL); ``retry`` takes digits only.

Bytes are split into lines before decoding, and only complete lines are
decoded, so a multi-byte UTF-8 character split across reads is never broken
(case B15); invalid UTF-8 is a :class:`~fsm_agent.errors.ProviderProtocolError`,
never a silent U+FFFD. There is no line-length limit of the transport's (case
B18: aiohttp's ``readline`` caps lines at 128 KiB); instead one event may hold
at most ``max_event_bytes`` (16 MiB by default), beyond which decoding fails
with an error naming the limit.

Deviation, on purpose: at end of input, :meth:`SSEDecoder.flush` dispatches an
event whose final blank line never came (the spec discards it). Recorded
bodies and some servers end that way; the protocol layer still decides whether
the stream was complete.
"""

from __future__ import annotations

from attrs import frozen

from ..errors import ProviderProtocolError

__all__ = ["DEFAULT_MAX_EVENT_BYTES", "SSEDecoder", "ServerSentEvent"]

DEFAULT_MAX_EVENT_BYTES = 16 * 1024 * 1024
"""Largest event (data plus the partial line being read) accepted, in bytes."""


@frozen
class ServerSentEvent:
    """One dispatched event."""

    data: str
    """The data lines joined with ``\\n``."""
    event: str = "message"
    """The ``event:`` field, ``message`` when absent."""
    id: str | None = None
    """The last event id in effect when this event was dispatched, or ``None``."""
    retry: int | None = None
    """A ``retry:`` value (milliseconds) seen in this event, or ``None``."""


class SSEDecoder:
    """Feed bytes in any split; get complete :class:`ServerSentEvent` values back.

    Not thread-safe; one decoder per stream.
    """

    __slots__ = (
        "_pending",
        "_pending_len",
        "_skip_lf",
        "_data",
        "_data_len",
        "_event",
        "_last_id",
        "_retry",
        "_max",
        "_offset",
        "comments",
        "ended_mid_line",
    )

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._pending: list[bytes] = []
        self._pending_len = 0
        self._skip_lf = False
        self._data: list[str] = []
        self._data_len = 0
        self._event: str | None = None
        self._last_id: str | None = None
        self._retry: int | None = None
        self._max = max_event_bytes
        self._offset = 0
        self.comments = 0
        """Comment lines seen so far (keep-alives)."""
        self.ended_mid_line = False
        """Set by :meth:`flush`: the input ended in the middle of a line (no CR or LF after its last
        bytes), as when a connection closes mid-event. Callers treat a failure to decode that last
        line as a dropped connection, not as a protocol error."""

    @property
    def last_event_id(self) -> str | None:
        """The last ``id:`` seen (what a client sends back as ``Last-Event-ID``)."""
        return self._last_id

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """Consume ``chunk`` and return the events it completed (often none).

        Raises:
            ProviderProtocolError: invalid UTF-8 in a line, or an event larger than the limit.
        """
        if not chunk:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if chunk[0] == 10:  # the LF of a CRLF split across reads
                chunk = chunk[1:]
                self._offset += 1
                if not chunk:
                    return []
        if b"\n" not in chunk and b"\r" not in chunk:
            self._pending.append(chunk)
            self._pending_len += len(chunk)
            if self._pending_len + self._data_len > self._max:
                self._too_big()
            return []
        if self._pending:
            self._pending.append(chunk)
            buf = b"".join(self._pending)
            self._pending = []
            self._pending_len = 0
        else:
            buf = chunk
        lines = buf.splitlines(keepends=True)
        last = lines[-1]
        tail = last[-1]
        if tail != 10 and tail != 13:
            lines.pop()
            self._pending.append(last)
            self._pending_len = len(last)
        elif tail == 13:
            self._skip_lf = True
        out: list[ServerSentEvent] = []
        for raw in lines:
            self._line(raw, out)
        if self._pending_len + self._data_len > self._max:
            self._too_big()
        return out

    def flush(self) -> list[ServerSentEvent]:
        """End of input: process a last unterminated line and dispatch a pending event.

        Sets :attr:`ended_mid_line` when there was such a line."""
        out: list[ServerSentEvent] = []
        self.ended_mid_line = bool(self._pending)
        if self._pending:
            buf = b"".join(self._pending)
            self._pending = []
            self._pending_len = 0
            self._line(buf, out)
        if self._data or self._event is not None:
            self._dispatch(out)
        return out

    # -- internals -----------------------------------------------------------
    def _too_big(self) -> None:
        raise ProviderProtocolError(
            f"SSE event larger than the {self._max} byte limit "
            f"(set max_event_bytes on the provider to accept larger events)"
        )

    def _line(self, raw: bytes, out: list[ServerSentEvent]) -> None:
        n = len(raw)
        self._offset += n
        if raw.endswith(b"\r\n"):
            raw = raw[:-2]
        elif raw and raw[-1] in (10, 13):
            raw = raw[:-1]
        if not raw:
            self._dispatch(out)
            return
        if raw[0] == 58:  # ':' comment
            self.comments += 1
            return
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProviderProtocolError(
                f"invalid UTF-8 in SSE stream near byte {self._offset - n + exc.start}: {raw[:80]!r}"
            ) from exc
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._data_len += len(raw) + 1
            if self._data_len > self._max:
                self._too_big()
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\x00" not in value:
                self._last_id = value
        elif name == "retry":
            if value.isdigit():
                self._retry = int(value)
        # other field names are ignored, as the spec says

    def _dispatch(self, out: list[ServerSentEvent]) -> None:
        if not self._data:
            self._event = None
            self._retry = None
            return
        data = self._data[0] if len(self._data) == 1 else "\n".join(self._data)
        out.append(ServerSentEvent(data, self._event or "message", self._last_id, self._retry))
        self._data = []
        self._data_len = 0
        self._event = None
        self._retry = None
