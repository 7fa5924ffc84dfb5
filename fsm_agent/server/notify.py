"""Wake-ups for event-stream tails: a per-session :class:`Notifier`, the :class:`NotifyingStore`
that rings it after each commit, and :class:`LiveDeltas`, the observer that publishes a model
call's streaming deltas (live only: no id, never stored).

The ordering rule for live deltas: each one is tagged with its *basis*, the last log seq this
process knew to be committed for the session when the delta was produced. A stream sends a delta
only when the last event it sent is exactly that seq. A delta whose basis is behind what the stream
sent is superseded by the log (the ``message`` event that follows carries the whole text) and is
dropped; one ahead of it waits until the stream has caught up. So a client never sees a delta after
the message it belongs to, and a client that reconnects mid-answer still ends with the log's state.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Any

import orjson

from ..store.base import (
    Checkpoint,
    ControlKind,
    ControlRecord,
    EventRecord,
    LedgerEntry,
    SessionLink,
    SessionRecord,
    Store,
    WriteBatch,
)
from ..machine.phases import Phase
from ..types.events import ModelStreamEvent, TransitionEvent
from ..types.stream import RefusalDelta, TextDelta, ThinkingDelta, ToolCallArgumentsDelta
from .sse import encode_frame

__all__ = ["LIVE_BACKLOG", "LiveDeltas", "Notifier", "NotifyingStore", "Subscription"]

LIVE_BACKLOG = 2048
"""Live frames kept per subscriber before the oldest are dropped (deltas are best effort)."""


class Subscription:
    """One event stream's wake-up flag and its queue of live frames ``(basis seq, frame bytes)``."""

    __slots__ = ("live", "session_id", "wake")

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.wake = asyncio.Event()
        self.live: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=LIVE_BACKLOG)

    def take_live(self, last_sent: int) -> list[bytes]:
        """The live frames to send now, given the seq of the last log event sent (see the module doc)."""
        out: list[bytes] = []
        live = self.live
        while live:
            basis, frame = live[0]
            if basis > last_sent:
                break
            live.popleft()
            if basis == last_sent:
                out.append(frame)
        return out


class Notifier:
    """Per-session subscriptions, woken after each commit (and by live deltas), in one process.

    Across hosts, :mod:`fsm_agent.server.queue` feeds PostgreSQL ``NOTIFY`` messages into
    :meth:`notify` on every replica.
    """

    def __init__(self) -> None:
        self._subs: dict[str, set[Subscription]] = {}
        self._last_seq: dict[str, int] = {}

    def subscribe(self, session_id: str) -> Subscription:
        """A subscription woken on every later commit of ``session_id``; :meth:`unsubscribe` it when done."""
        sub = Subscription(session_id)
        self._subs.setdefault(session_id, set()).add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop waking ``sub``."""
        subs = self._subs.get(sub.session_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.session_id]
                self._last_seq.pop(sub.session_id, None)

    def notify(self, session_id: str, last_seq: int | None = None) -> None:
        """Wake every subscriber of ``session_id`` (never blocks); ``last_seq``: the log's last seq now."""
        subs = self._subs.get(session_id)
        if not subs:
            return
        if last_seq is not None and last_seq > self._last_seq.get(session_id, -1):
            self._last_seq[session_id] = last_seq
        for sub in subs:
            sub.wake.set()

    def observe(self, session_id: str, seq: int) -> None:
        """Record that the log of a watched session has reached ``seq`` (a stream read it), without
        waking anyone: a live delta produced now follows ``seq`` (a subscriber that joined after
        the last commit still gets the deltas of the answer in progress)."""
        if session_id in self._subs and seq > self._last_seq.get(session_id, -1):
            self._last_seq[session_id] = seq

    def publish_live(self, session_id: str, frame: bytes, basis: int | None = None) -> None:
        """Queue a live frame (no id) for every subscriber of ``session_id`` and wake them.

        ``basis``: the last committed seq the frame follows (default: the last one this notifier saw).
        """
        subs = self._subs.get(session_id)
        if not subs:
            return
        b = self._last_seq.get(session_id) if basis is None else basis
        if b is None:
            return  # no known position in the log: the message event will carry the text
        for sub in subs:
            sub.live.append((b, frame))
            sub.wake.set()

    def sessions(self) -> list[str]:
        """The sessions that have at least one subscriber."""
        return list(self._subs)

    def subscribers(self, session_id: str) -> int:
        """How many streams watch ``session_id``."""
        return len(self._subs.get(session_id, ()))


class NotifyingStore(Store):
    """A :class:`Store` that calls :meth:`Notifier.notify` after each successful write or session
    creation, and passes everything else to ``inner``."""

    def __init__(self, inner: Store, notifier: Notifier | None = None) -> None:
        self.inner = inner
        self.notifier = notifier or Notifier()

    async def create_session(self, record: SessionRecord) -> None:
        await self.inner.create_session(record)
        self.notifier.notify(record.session_id, record.last_seq)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        return await self.inner.get_session(session_id)

    async def list_sessions(self, limit: int = 50) -> list[SessionRecord]:
        return await self.inner.list_sessions(limit)

    async def update_metadata(self, session_id: str, metadata: dict[str, Any], goal_version: int | None = None) -> None:
        await self.inner.update_metadata(session_id, metadata, goal_version)

    async def write(self, batch: WriteBatch) -> None:
        await self.inner.write(batch)
        self.notifier.notify(batch.session_id, batch.events[-1].seq if batch.events else None)

    async def read_events(self, session_id: str, after_seq: int = 0, until_seq: int | None = None,
                          types: Sequence[str] | None = None) -> list[EventRecord]:
        return await self.inner.read_events(session_id, after_seq, until_seq, types)

    async def latest_checkpoint(self, session_id: str) -> Checkpoint | None:
        return await self.inner.latest_checkpoint(session_id)

    async def get_checkpoint(self, checkpoint_id: str) -> Checkpoint | None:
        return await self.inner.get_checkpoint(checkpoint_id)

    async def ledger(self, session_id: str) -> dict[str, LedgerEntry]:
        return await self.inner.ledger(session_id)

    async def acquire_lease(self, session_id: str, owner: str, ttl: float) -> bool:
        return await self.inner.acquire_lease(session_id, owner, ttl)

    async def release_lease(self, session_id: str, owner: str) -> None:
        await self.inner.release_lease(session_id, owner)

    async def push_control(self, record: ControlRecord) -> None:
        await self.inner.push_control(record)

    async def take_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> list[ControlRecord]:
        return await self.inner.take_controls(session_id, kinds)

    async def peek_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> bool:
        return await self.inner.peek_controls(session_id, kinds)

    async def claim_idempotency_key(self, session_id: str, key: str, value: dict[str, Any]
                                    ) -> tuple[dict[str, Any], bool]:
        return await self.inner.claim_idempotency_key(session_id, key, value)

    async def idempotency_records(self, session_id: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        return await self.inner.idempotency_records(session_id, prefix)

    async def link_session(self, link: SessionLink) -> tuple[SessionLink, bool]:
        return await self.inner.link_session(link)

    async def parent(self, session_id: str) -> SessionLink | None:
        return await self.inner.parent(session_id)

    async def children(self, session_id: str) -> list[SessionLink]:
        return await self.inner.children(session_id)

    async def close(self) -> None:
        await self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"NotifyingStore({self.inner!r})"


class LiveDeltas:
    """An observer (:mod:`fsm_agent.hooks`) that publishes live-only SSE frames (no ``id``, never
    stored), so a watcher sees what the log will say before the next safe point commits it:

    * ``event: delta``, each text, thinking, refusal and tool-call-arguments delta of the Model
      phase's call (not of a plugin's side call, such as a planner's or a grader's):
      ``{"turn": int, "kind": "text"|"thinking"|"refusal"|"tool_call", "text": str, "index": int|null}``;
    * ``event: state``, each move of the machine as it happens: ``{"turn", "from", "trigger", "to"}``
      (the ``transition`` event with its seq follows when the move is committed).

    Other stream events are not sent. Never blocks the run."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier

    def on_transition(self, event: TransitionEvent) -> None:
        if not self.notifier.subscribers(event.session_id):
            return
        frame = encode_frame(orjson.dumps({"turn": event.turn, "from": event.from_state, "trigger": event.trigger,
                                           "to": event.to_state}), event="state")
        self.notifier.publish_live(event.session_id, frame)

    def on_model_event(self, event: ModelStreamEvent) -> None:
        # a plugin's side call (a planner's JSON, a grader's verdict) is not the answer: not streamed
        if event.phase != Phase.MODEL.value or not self.notifier.subscribers(event.session_id):
            return
        ev = event.event
        if isinstance(ev, TextDelta):
            kind, text, index = "text", ev.text, ev.index
        elif isinstance(ev, ThinkingDelta):
            kind, text, index = "thinking", ev.text, ev.index
        elif isinstance(ev, ToolCallArgumentsDelta):
            kind, text, index = "tool_call", ev.arguments, ev.index
        elif isinstance(ev, RefusalDelta):
            kind, text, index = "refusal", ev.text, None
        else:
            return
        frame = encode_frame(orjson.dumps({"turn": event.turn, "kind": kind, "text": text, "index": index}),
                             event="delta")
        self.notifier.publish_live(event.session_id, frame)

    def __repr__(self) -> str:
        return "LiveDeltas()"
