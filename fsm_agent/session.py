"""The link between a running driver and its store: the journal, and loading a session back.

:class:`Journal` appends every state change of a run to the session's event log (buffered, then
committed in one transaction at each safe point), writes checkpoints at safe points (entering
PreTurn or MidTurn, and at the end), and writes tool-call ledger entries durably *before* the
step they name. :func:`load_session` rebuilds a session from its latest checkpoint plus the
``message`` events up to the checkpoint's seq.

Event types written (payload keys): ``session_started`` (goal, config), ``transition`` (from,
trigger, to, reason), ``message`` (message), ``model_call`` (model, provider, stop_reason,
usage, cost_usd), ``tool_call`` (call_id, tool, status), ``control`` (kind, text),
``recovered`` (state, checkpoint_id, reason), ``run_stopped`` (stop).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from attrs import define, field

from .store.base import (
    SCHEMA_VERSION,
    Checkpoint,
    ControlKind,
    EventRecord,
    LedgerEntry,
    LedgerStatus,
    SessionRecord,
    Store,
    WriteBatch,
    new_id,
)
from .types.codec import structure, unstructure
from .types.content import ToolUseBlock
from .types.messages import Message, ToolResultMessage, Usage

if TYPE_CHECKING:
    from .machine.context import RunContext

__all__ = ["Journal", "LoadedSession", "load_session", "send_control", "upgrade_event"]


def upgrade_event(record: EventRecord) -> EventRecord:
    """Bring an event written by an older schema version to the current one (see docs/schema.md).

    Version 1 is the first; readers accept every version up to :data:`SCHEMA_VERSION` and refuse
    newer ones with a clear error (a newer worker wrote them).
    """
    if record.schema_version > SCHEMA_VERSION:
        raise ValueError(f"event {record.seq} of session {record.session_id} has schema version "
                         f"{record.schema_version}, newer than this fsm_agent ({SCHEMA_VERSION}); upgrade fsm_agent")
    return record


@define
class Journal:
    """Buffers a run's events and commits them with checkpoints and ledger entries."""

    store: Store
    session_id: str
    next_seq: int
    owner: str | None = None
    """Lease owner: writes are fenced to it."""
    buffer: list[EventRecord] = field(factory=list)
    queued_ledger: dict[str, LedgerEntry] = field(factory=dict)
    """Ledger entries that may wait for the next commit (see :meth:`ledger`)."""
    last_checkpoint: str | None = None
    _lock: asyncio.Lock = field(factory=asyncio.Lock)
    _config_cache: tuple[Any, Any] | None = None
    """Serializes commits: parallel tool calls write their ledger entries concurrently."""

    def record(self, type: str, payload: dict[str, Any], turn: int | None = None) -> int:
        """Buffer one event; returns its seq."""
        seq = self.next_seq
        self.next_seq += 1
        # (session_id, seq) is unique, so the event id is derived from it rather than drawn at random
        self.buffer.append(EventRecord(self.session_id, seq, type, payload,
                                       f"{self.session_id}:{turn}" if turn else None, time.time(),
                                       f"{self.session_id}:{seq}"))
        return seq

    def message(self, message: Message, turn: int) -> None:
        self.record("message", {"message": unstructure(message)}, turn)

    async def flush(self, *, checkpoint: Checkpoint | None = None, ledger: tuple[LedgerEntry, ...] = (),
                    state: str | None = None, stop: dict[str, Any] | None = None) -> None:
        """Commit buffered events (and what is given) in one transaction.

        Raises:
            LeaseLost: another worker took the session over.
        """
        async with self._lock:
            if (not self.buffer and checkpoint is None and not ledger and not self.queued_ledger and state is None
                    and stop is None):
                return
            events, self.buffer = tuple(self.buffer), []
            queued, self.queued_ledger = self.queued_ledger, {}
            for entry in ledger:
                queued[entry.call_id] = entry
            try:
                await self.store.write(WriteBatch(self.session_id, events, checkpoint, tuple(queued.values()), state,
                                                  stop, self.owner))
            except BaseException:
                self.buffer = list(events) + self.buffer
                self.queued_ledger = {**queued, **self.queued_ledger}
                raise
            if checkpoint is not None:
                self.last_checkpoint = checkpoint.checkpoint_id

    def _config(self, config: Any) -> Any:
        """The run's config as JSON, made once per run (it does not change while a run goes on)."""
        cached = self._config_cache
        if cached is None or cached[0] is not config:
            cached = self._config_cache = (config, unstructure(config))
        return cached[1]

    def checkpoint(self, ctx: RunContext, safe_point: str) -> Checkpoint:
        """A checkpoint of ``ctx`` at the last buffered seq (call :meth:`flush` with it)."""
        data = {
            "turn": ctx.turn,
            "usage": unstructure(ctx.usage),
            "cost_usd": ctx.cost_usd,
            "tool_calls_made": ctx.tool_calls_made,
            "tool_call_counts": dict(ctx.tool_call_counts),
            "pending_calls": [unstructure(c) for c in ctx.pending_calls],
            "elapsed": ctx.elapsed,
            "context_retry": ctx.context_retry,
            "config": self._config(ctx.config),
            "transcript_len": len(ctx.transcript),
            "state": ctx.machine.state.value,
            "evidence": list(ctx.evidence),
            "decided_results": {k: unstructure(v) for k, v in ctx.extra_stop.get("decided_results", {}).items()},
            "last_stop_reason": ctx.last_response.stop_reason.value if ctx.last_response else None,
            "decisions": {k: unstructure(v) for k, v in ctx.decisions.items()},
        }
        return Checkpoint(new_id(), self.session_id, self.next_seq - 1, safe_point, data)

    async def ledger(self, *entries: LedgerEntry, durable: bool = True) -> None:
        """Write ledger entries (and buffered events) durably now, or, with ``durable=False``, with the
        next commit (for states whose loss a crash makes harmless: a pure tool simply runs again)."""
        if durable:
            await self.flush(ledger=tuple(entries))
        else:
            for entry in entries:
                self.queued_ledger[entry.call_id] = entry


def ledger_entry(ctx: RunContext, call: ToolUseBlock, status: LedgerStatus, *, effect: str = "pure",
                 result: ToolResultMessage | None = None) -> LedgerEntry:
    from .tools.execution import idempotency_key

    return LedgerEntry(ctx.session_id, call.id, call.name, dict(call.input), idempotency_key(ctx.session_id, call.id),
                       effect, status, ctx.turn, unstructure(result) if result is not None else None)


@define
class LoadedSession:
    record: SessionRecord
    checkpoint: Checkpoint | None
    transcript: list[Message]
    ledger: dict[str, LedgerEntry]

    def restore(self, ctx: RunContext) -> None:
        """Put the checkpoint's scalar state into ``ctx`` (transcript already set)."""
        ck = self.checkpoint
        if ck is None:
            return
        d = ck.data
        ctx.turn = d["turn"]
        ctx.usage = structure(d["usage"], Usage)
        ctx.cost_usd = d["cost_usd"]
        ctx.tool_calls_made = d["tool_calls_made"]
        ctx.tool_call_counts = dict(d["tool_call_counts"])
        ctx.pending_calls = [structure(c, ToolUseBlock) for c in d["pending_calls"]]
        ctx.elapsed_before = d["elapsed"]
        ctx.context_retry = d["context_retry"]
        ctx.evidence = list(d.get("evidence", ()))
        from .control import Decision

        ctx.decisions = {k: structure(v, Decision) for k, v in (d.get("decisions") or {}).items()}
        decided = d.get("decided_results") or {}
        if decided:
            ctx.extra_stop["decided_results"] = {k: structure(v, ToolResultMessage) for k, v in decided.items()}


async def send_control(store: Store, session_id: str, kind: ControlKind, text: str = "") -> str:
    """Queue a control event for a session; returns a note for the user.

    Raises:
        ResumeError: unknown session; it ended for good (COMPLETED, FAILED_TERMINAL, CANCELLED); or an
            interrupt for a session that is not running (nothing to interrupt).
    """
    from .errors import ResumeError
    from .store.base import ControlRecord
    from .types.run import StopReason

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


async def load_session(store: Store, session_id: str) -> LoadedSession | None:
    """The session's record, latest checkpoint, transcript up to it, and ledger; ``None`` if unknown."""
    record = await store.get_session(session_id)
    if record is None:
        return None
    ck = await store.latest_checkpoint(session_id)
    until = ck.seq if ck is not None else record.last_seq
    transcript: list[Message] = []
    for ev in await store.read_events(session_id, 0, until, types=("message",)):
        ev = upgrade_event(ev)
        if ev.type == "message":
            transcript.append(structure(ev.payload["message"], Message))
    return LoadedSession(record, ck, transcript, await store.ledger(session_id))
