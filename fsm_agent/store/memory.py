"""In-process store: the default of the Python API. Resume works within the process; nothing
survives it (use :class:`~fsm_agent.store.sqlite.SQLiteStore` for that).

Event payloads and checkpoint data are kept as JSON bytes, as the SQLite store keeps them: a
session's log costs its encoded size (not a tree of Python objects), and what a reader gets back
is a fresh value, never an object another reader or the writer holds."""

from __future__ import annotations

import time
import zlib
from array import array
from collections.abc import Sequence
from typing import Any

import orjson
from attrs import evolve

from ..errors import LeaseLost, SessionConflictError, SessionExistsError
from .base import (
    Checkpoint,
    ControlKind,
    ControlRecord,
    EventRecord,
    LedgerEntry,
    SessionLink,
    SessionRecord,
    Store,
    WriteBatch,
    check_link,
)

__all__ = ["MemoryStore"]


class _Log:
    """One session's events: their JSON lines in one growing buffer, and where each starts. An
    event's ids that follow the usual pattern (``<session>:<seq>``) are not stored, only rebuilt."""

    __slots__ = ("buf", "starts", "last_seq")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.starts = array("Q")
        self.last_seq = 0

    def append(self, sid: str, events: Sequence[EventRecord]) -> None:
        for e in events:
            event_id = None if e.event_id == f"{sid}:{e.seq}" else e.event_id
            self.starts.append(len(self.buf))
            self.buf += orjson.dumps([e.seq, e.type, e.payload, e.turn_id, e.ts, event_id, e.schema_version])
            self.last_seq = e.seq

    def read(self, sid: str, after: int, until: int | None) -> list[EventRecord]:
        # seqs run from 1 without gaps: event n sits at index n - 1
        first = max(0, after)
        stop = len(self.starts) if until is None else max(first, min(until, len(self.starts)))
        out = []
        buf, starts = self.buf, self.starts
        for i in range(first, stop):
            end = starts[i + 1] if i + 1 < len(starts) else len(buf)
            seq, type_, payload, turn_id, ts, event_id, version = orjson.loads(buf[starts[i]:end])
            out.append(EventRecord(sid, seq, type_, payload, turn_id, ts,
                                   f"{sid}:{seq}" if event_id is None else event_id, version))
        return out


def _kept(value: Any) -> bytes:
    """``value`` as JSON bytes of exactly their size: orjson's own result keeps a buffer of at least
    4 KiB, which a log of thousands of small events would keep too."""
    return bytes(memoryview(orjson.dumps(value)))


class MemoryStore(Store):
    """Dictionaries behind the :class:`Store` interface (not shared between processes).

    Nothing outside the process can make it fail, so it never raises
    :class:`~fsm_agent.errors.StoreError`; wrap it in :class:`fsm_agent.testing.FaultyStore` to
    test how a caller handles one.
    """

    def __init__(self) -> None:
        self._sessions: dict[str, SessionRecord] = {}
        self._events: dict[str, _Log] = {}
        """Per session: the log, each event one JSON line in one buffer (a few bytes of overhead
        an event, not a dozen Python objects)."""
        self._checkpoints: dict[str, tuple[Checkpoint, bytes]] = {}
        """By id: the checkpoint without its data, and the data as JSON bytes (zlib-compressed once a
        later checkpoint of the session supersedes it: only the latest is read to resume)."""
        self._latest: dict[str, str] = {}
        self._ledger: dict[str, dict[str, LedgerEntry]] = {}
        self._controls: dict[str, list[ControlRecord]] = {}
        self._idempotency: dict[str, dict[str, dict[str, Any]]] = {}
        self._links: dict[str, SessionLink] = {}
        """Links by child id (insertion order is creation order)."""

    async def create_session(self, record: SessionRecord) -> None:
        if record.session_id in self._sessions:
            raise SessionExistsError(record.session_id)
        self._sessions[record.session_id] = record
        self._events[record.session_id] = _Log()

    async def get_session(self, session_id: str) -> SessionRecord | None:
        return self._sessions.get(session_id)

    async def list_sessions(self, limit: int = 50) -> list[SessionRecord]:
        return sorted(self._sessions.values(), key=lambda s: s.updated_at, reverse=True)[:limit]

    async def update_metadata(self, session_id: str, metadata: dict[str, Any], goal_version: int | None = None) -> None:
        s = self._sessions[session_id]
        self._sessions[session_id] = evolve(s, metadata={**s.metadata, **metadata},
                                            goal_version=goal_version or s.goal_version, updated_at=time.time())

    async def write(self, batch: WriteBatch) -> None:
        s = self._sessions.get(batch.session_id)
        if s is None:
            raise KeyError(f"unknown session {batch.session_id}")
        if batch.expected_owner is not None and s.lease_owner != batch.expected_owner:
            raise LeaseLost(f"session {batch.session_id} is leased by {s.lease_owner}, not {batch.expected_owner}")
        log = self._events[batch.session_id]
        last = log.last_seq
        for e in batch.events:
            if e.seq != last + 1:
                raise SessionConflictError(batch.session_id, e.seq, last)
            last = e.seq
        log.append(batch.session_id, batch.events)
        ck = batch.checkpoint
        if ck is not None:
            old = self._latest.get(batch.session_id)
            if old is not None:
                head, data = self._checkpoints[old]
                self._checkpoints[old] = (head, zlib.compress(data, 1))
            self._checkpoints[ck.checkpoint_id] = (evolve(ck, data={}), _kept(ck.data))
            self._latest[batch.session_id] = ck.checkpoint_id
        for entry in batch.ledger:
            self._ledger.setdefault(batch.session_id, {})[entry.call_id] = entry
        changes: dict[str, Any] = {"updated_at": time.time(), "last_seq": last}
        if batch.state is not None:
            changes["state"] = batch.state
        if batch.stop is not None:
            changes["stop"] = batch.stop
        self._sessions[batch.session_id] = evolve(s, **changes)

    async def read_events(self, session_id: str, after_seq: int = 0, until_seq: int | None = None,
                          types: Sequence[str] | None = None) -> list[EventRecord]:
        log = self._events.get(session_id)
        if log is None:
            return []
        return [e for e in log.read(session_id, after_seq, until_seq)
                if types is None or e.type in types]

    async def latest_checkpoint(self, session_id: str) -> Checkpoint | None:
        cid = self._latest.get(session_id)
        return await self.get_checkpoint(cid) if cid else None

    async def get_checkpoint(self, checkpoint_id: str) -> Checkpoint | None:
        kept = self._checkpoints.get(checkpoint_id)
        if kept is None:
            return None
        head, data = kept
        if self._latest.get(head.session_id) != checkpoint_id:
            data = zlib.decompress(data)
        return evolve(head, data=orjson.loads(data))

    async def ledger(self, session_id: str) -> dict[str, LedgerEntry]:
        return dict(self._ledger.get(session_id, {}))

    async def acquire_lease(self, session_id: str, owner: str, ttl: float) -> bool:
        s = self._sessions[session_id]
        now = time.time()
        if s.lease_owner not in (None, owner) and (s.lease_until or 0) > now:
            return False
        self._sessions[session_id] = evolve(s, lease_owner=owner, lease_until=now + ttl)
        return True

    async def release_lease(self, session_id: str, owner: str) -> None:
        s = self._sessions.get(session_id)
        if s is not None and s.lease_owner == owner:
            self._sessions[session_id] = evolve(s, lease_owner=None, lease_until=None)

    async def push_control(self, record: ControlRecord) -> None:
        if record.session_id not in self._sessions:
            raise KeyError(f"unknown session {record.session_id}")
        self._controls.setdefault(record.session_id, []).append(record)

    async def take_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> list[ControlRecord]:
        queued = self._controls.get(session_id, [])
        taken = [c for c in queued if c.kind in kinds]
        self._controls[session_id] = [c for c in queued if c.kind not in kinds]
        return taken

    async def peek_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> bool:
        return any(c.kind in kinds for c in self._controls.get(session_id, ()))

    async def claim_idempotency_key(self, session_id: str, key: str, value: dict[str, Any]
                                    ) -> tuple[dict[str, Any], bool]:
        if session_id not in self._sessions:
            raise KeyError(f"unknown session {session_id}")
        kept = self._idempotency.setdefault(session_id, {})
        if key in kept:
            return kept[key], False
        kept[key] = dict(value)
        return kept[key], True

    async def idempotency_records(self, session_id: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        return {k: v for k, v in self._idempotency.get(session_id, {}).items() if k.startswith(prefix)}

    async def link_session(self, link: SessionLink) -> tuple[SessionLink, bool]:
        check_link(link)
        if link.parent_id not in self._sessions:
            raise KeyError(f"unknown parent session {link.parent_id}")
        kept = self._links.get(link.child_id)
        if kept is not None:
            return kept, False
        self._links[link.child_id] = link
        return link, True

    async def parent(self, session_id: str) -> SessionLink | None:
        return self._links.get(session_id)

    async def children(self, session_id: str) -> list[SessionLink]:
        return sorted((x for x in self._links.values() if x.parent_id == session_id), key=lambda x: x.created_at)
