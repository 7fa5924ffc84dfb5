"""Reading sessions back: the latest checkpoint as a :class:`~fsm_agent.machine.state.RunState`, the
transcript up to it, the ledger, turn records; queueing control events; upgrading old records.

Compatibility (``docs/schema.md``): readers accept every schema version up to
:data:`~fsm_agent.store.base.SCHEMA_VERSION` and refuse newer ones with a clear error.

* Version 1 checkpoints held a flat dict of hand-picked keys; :func:`upgrade_checkpoint` maps
  them onto :class:`RunState` (the last response is rebuilt from the transcript's last
  assistant message and the saved model stop reason).
* Version 2 checkpoints are ``unstructure(RunState)``.
"""

from __future__ import annotations

from typing import Any

from attrs import define

from ..errors import ResumeError
from ..types.codec import structure
from ..types.messages import AssistantMessage, Message, ModelStopReason
from ..types.requests import MessageResponse
from ..types.run import StopReason, TurnRecord
from .base import (
    SCHEMA_VERSION,
    Checkpoint,
    ControlKind,
    ControlRecord,
    EventRecord,
    LedgerEntry,
    SessionLink,
    SessionRecord,
    Store,
)

__all__ = ["LoadedSession", "descendants", "load_session", "read_turns", "send_control", "upgrade_checkpoint",
           "upgrade_event"]


def upgrade_event(record: EventRecord) -> EventRecord:
    """Bring an event written by an older schema version to the current one.

    Raises:
        ValueError: the event is newer than this fsm_agent (a newer worker wrote it).
    """
    if record.schema_version > SCHEMA_VERSION:
        raise ValueError(f"event {record.seq} of session {record.session_id} has schema version "
                         f"{record.schema_version}, newer than this fsm_agent ({SCHEMA_VERSION}); upgrade fsm_agent")
    return record


_V1_KEYS = ("turn", "cost_usd", "tool_calls_made", "context_retry")


def upgrade_checkpoint(ck: Checkpoint, transcript: list[Message]) -> dict[str, Any]:
    """The checkpoint's data as version-2 ``RunState`` data.

    Raises:
        ValueError: the checkpoint is newer than this fsm_agent.
    """
    if ck.schema_version > SCHEMA_VERSION:
        raise ValueError(f"checkpoint {ck.checkpoint_id} has schema version {ck.schema_version}, newer than this "
                         f"fsm_agent ({SCHEMA_VERSION}); upgrade fsm_agent")
    if ck.schema_version >= 2:
        return ck.data
    d = ck.data
    out: dict[str, Any] = {k: d[k] for k in _V1_KEYS if k in d}
    out.update(
        config=d.get("config") or {},
        state=d.get("state", ck.safe_point),
        usage=d.get("usage") or {},
        tool_call_counts=dict(d.get("tool_call_counts") or {}),
        pending_calls=list(d.get("pending_calls") or ()),
        decisions=dict(d.get("decisions") or {}),
        decided_results=dict(d.get("decided_results") or {}),
        evidence=list(d.get("evidence") or ()),
        elapsed=d.get("elapsed", 0.0),
        transcript_len=d.get("transcript_len", len(transcript)),
    )
    stop = d.get("last_stop_reason")
    last = next((m for m in reversed(transcript) if isinstance(m, AssistantMessage)), None)
    if stop is not None and last is not None:
        from ..types.codec import unstructure

        out["last_response"] = unstructure(MessageResponse("", "", last, ModelStopReason(stop)))
    return out


@define
class LoadedSession:
    """A session read back from its store."""

    record: SessionRecord
    checkpoint: Checkpoint | None
    """The latest checkpoint, or ``None`` when the session never reached one."""
    transcript: list[Message]
    """The ``message`` events up to the checkpoint's seq (the whole log without a checkpoint)."""
    ledger: dict[str, LedgerEntry]
    """The store's ledger by call id (written before each step, so never older than the checkpoint)."""
    state_data: dict[str, Any] | None
    """The checkpoint's run state as current-version data (``structure`` it into
    :class:`~fsm_agent.machine.state.RunState`); ``None`` without a checkpoint."""


async def load_session(store: Store, session_id: str) -> LoadedSession | None:
    """The session's record, latest checkpoint and run state, transcript up to it, and ledger;
    ``None`` for an unknown session.

    Raises:
        ValueError: records newer than this fsm_agent.
        StoreError: the store could not be read.
    """
    record = await store.get_session(session_id)
    if record is None:
        return None
    ck = await store.latest_checkpoint(session_id)
    until = ck.seq if ck is not None else record.last_seq
    transcript: list[Message] = []
    for ev in await store.read_events(session_id, 0, until, types=("message",)):
        ev = upgrade_event(ev)
        transcript.append(structure(ev.payload["message"], Message))
    ledger = await store.ledger(session_id)
    data = upgrade_checkpoint(ck, transcript) if ck is not None else None
    return LoadedSession(record, ck, transcript, ledger, data)


async def read_turns(store: Store, session_id: str) -> list[TurnRecord]:
    """The session's turn records (seed 004 §2), oldest first.

    Raises:
        ResumeError: unknown session.
    """
    if await store.get_session(session_id) is None:
        raise ResumeError(f"unknown session {session_id!r}")
    return [structure(ev.payload["turn"], TurnRecord)
            for ev in await store.read_events(session_id, 0, None, types=("turn",))]


async def send_control(store: Store, session_id: str, kind: ControlKind, text: str = "") -> str:
    """Queue a control event for a session; returns a note for the user.

    Raises:
        ResumeError: unknown session; it ended for good (COMPLETED, FAILED_TERMINAL, CANCELLED); or an
            interrupt for a session that is not running (nothing to interrupt).
    """
    rec = await store.get_session(session_id)
    if rec is None:
        raise ResumeError(f"unknown session {session_id!r}")
    try:
        stopped: StopReason | None = StopReason(rec.state)
    except ValueError:
        stopped = None
    if stopped is not None and not stopped.resumable:
        raise ResumeError(f"session {session_id} ended {stopped.value}; it takes no more control events")
    if stopped is not None and kind is ControlKind.INTERRUPT:
        raise ResumeError(f"session {session_id} is not running ({stopped.value}): there is nothing to interrupt")
    await store.push_control(ControlRecord(session_id, kind, text))
    if stopped is not None:
        return f"queued {kind.value} for session {session_id} ({stopped.value}): it applies when the session is resumed"
    return f"queued {kind.value} for session {session_id}"


async def descendants(store: Store, session_id: str) -> list[SessionLink]:
    """Every link below ``session_id`` (children, their children ...), breadth first, each
    parent's children oldest first. A link seen twice (a cycle written by hand) is followed once.

    Raises:
        NotImplementedError: the store keeps no links.
        StoreError: the store could not be read.
    """
    found: list[SessionLink] = []
    seen = {session_id}
    frontier = [session_id]
    while frontier:
        nxt: list[str] = []
        for sid in frontier:
            for link in await store.children(sid):
                if link.child_id in seen:
                    continue
                seen.add(link.child_id)
                found.append(link)
                nxt.append(link.child_id)
        frontier = nxt
    return found
