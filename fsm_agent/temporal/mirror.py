"""The session store as a session's workflow sees it: an in-memory mirror of its own session.

The engine runs inside the workflow and writes its journal, checkpoints and ledger as it does in
process. Here each write is applied to the mirror at once (reads answer from it, deterministically,
with no round trip) and queued for the real store; the queue goes with the next activity (a model
call, a tool) and is applied there before that activity does anything else, so every write lands
before the step it names, as in process. Control events come from the workflow's signals.

The mirror holds one session: its record, its ``message`` events (loaded when a workflow continues a
session that exists) and everything written since, its latest checkpoints, its ledger.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from attrs import evolve

from ..errors import SessionConflictError, SessionExistsError
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
from ..types.codec import unstructure

__all__ = ["MirrorStore"]


class MirrorStore(Store):
    """See the module doc. ``now``: the workflow's clock (Unix seconds)."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self.record: SessionRecord | None = None
        self.events: list[EventRecord] = []
        self.checkpoints: dict[str, Checkpoint] = {}
        self.latest: str | None = None
        self.entries: dict[str, LedgerEntry] = {}
        self.controls: list[ControlRecord] = []
        self.kept: dict[str, dict[str, Any]] = {}
        self.links: dict[str, SessionLink] = {}
        self.pending: list[dict[str, Any]] = []
        """Writes not yet applied to the real store, in order (JSON-ready ops)."""

    # -- loading a session that exists ----------------------------------------------------------
    def seed(self, record: SessionRecord, messages: Sequence[EventRecord], checkpoint: Checkpoint | None,
             ledger: dict[str, LedgerEntry], kept: dict[str, dict[str, Any]]) -> None:
        """Start from what the real store holds (its record, message events, latest checkpoint, ledger
        and decision records)."""
        self.record = evolve(record, lease_owner=None, lease_until=None)
        self.events = list(messages)
        if checkpoint is not None:
            self.checkpoints = {checkpoint.checkpoint_id: checkpoint}
            self.latest = checkpoint.checkpoint_id
        self.entries = dict(ledger)
        self.kept = dict(kept)

    def _queue(self, op: str, **data: Any) -> None:
        self.pending.append({"op": op, **{k: unstructure(v) for k, v in data.items()}})

    def _mine(self, session_id: str) -> SessionRecord:
        if self.record is None or self.record.session_id != session_id:
            raise KeyError(f"unknown session {session_id}")
        return self.record

    # -- the Store interface --------------------------------------------------------------------
    async def create_session(self, record: SessionRecord) -> None:
        if self.record is not None:
            raise SessionExistsError(record.session_id)
        self.record = record
        self._queue("create", record=record)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        return self.record if self.record is not None and self.record.session_id == session_id else None

    async def list_sessions(self, limit: int = 50) -> list[SessionRecord]:
        return [self.record][:limit] if self.record is not None else []

    async def update_metadata(self, session_id: str, metadata: dict[str, Any], goal_version: int | None = None) -> None:
        rec = self._mine(session_id)
        self.record = evolve(rec, metadata={**rec.metadata, **metadata}, goal_version=goal_version or rec.goal_version,
                             updated_at=self._now())
        self._queue("metadata", session_id=session_id, metadata=metadata, goal_version=goal_version)

    async def write(self, batch: WriteBatch) -> None:
        rec = self._mine(batch.session_id)
        last = rec.last_seq
        for e in batch.events:
            if e.seq != last + 1:
                raise SessionConflictError(batch.session_id, e.seq, last)
            last = e.seq
        self.events.extend(batch.events)
        if batch.checkpoint is not None:
            self.checkpoints[batch.checkpoint.checkpoint_id] = batch.checkpoint
            self.latest = batch.checkpoint.checkpoint_id
        for entry in batch.ledger:
            self.entries[entry.call_id] = entry
        changes: dict[str, Any] = {"updated_at": self._now(), "last_seq": last}
        if batch.state is not None:
            changes["state"] = batch.state
        if batch.stop is not None:
            changes["stop"] = batch.stop
        self.record = evolve(rec, **changes)
        # the workflow is the fence (one worker runs it at a time): the real store's lease is not used
        self._queue("write", batch=evolve(batch, expected_owner=None))

    async def read_events(self, session_id: str, after_seq: int = 0, until_seq: int | None = None,
                          types: Sequence[str] | None = None) -> list[EventRecord]:
        return [e for e in self.events if e.session_id == session_id and e.seq > after_seq
                and (until_seq is None or e.seq <= until_seq) and (types is None or e.type in types)]

    async def latest_checkpoint(self, session_id: str) -> Checkpoint | None:
        return self.checkpoints.get(self.latest) if self.latest and self.record is not None \
            and self.record.session_id == session_id else None

    async def get_checkpoint(self, checkpoint_id: str) -> Checkpoint | None:
        return self.checkpoints.get(checkpoint_id)

    async def ledger(self, session_id: str) -> dict[str, LedgerEntry]:
        return dict(self.entries) if self.record is not None and self.record.session_id == session_id else {}

    async def acquire_lease(self, session_id: str, owner: str, ttl: float) -> bool:
        self._mine(session_id)
        return True  # a workflow runs on one worker at a time: Temporal is the lease

    async def release_lease(self, session_id: str, owner: str) -> None:
        return None

    async def push_control(self, record: ControlRecord) -> None:
        self._mine(record.session_id)
        self.controls.append(record)

    async def take_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> list[ControlRecord]:
        taken = [c for c in self.controls if c.session_id == session_id and c.kind in kinds]
        self.controls = [c for c in self.controls if c not in taken]
        return taken

    async def peek_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> bool:
        return any(c.session_id == session_id and c.kind in kinds for c in self.controls)

    async def claim_idempotency_key(self, session_id: str, key: str, value: dict[str, Any]
                                    ) -> tuple[dict[str, Any], bool]:
        self._mine(session_id)
        if key in self.kept:
            return self.kept[key], False
        self.kept[key] = dict(value)
        self._queue("claim", session_id=session_id, key=key, value=value)
        return self.kept[key], True

    async def idempotency_records(self, session_id: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        return {k: v for k, v in self.kept.items() if k.startswith(prefix)}

    async def link_session(self, link: SessionLink) -> tuple[SessionLink, bool]:
        kept = self.links.get(link.child_id)
        if kept is not None:
            return kept, False
        self.links[link.child_id] = link
        self._queue("link", link=link)
        return link, True

    async def parent(self, session_id: str) -> SessionLink | None:
        return self.links.get(session_id)

    async def children(self, session_id: str) -> list[SessionLink]:
        return [x for x in self.links.values() if x.parent_id == session_id]

    async def close(self) -> None:
        return None

