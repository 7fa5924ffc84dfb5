"""The journal: how a running driver writes to its session's store.

It appends every state change to the session's event log (buffered, then committed in one
transaction at each safe point), writes checkpoints at safe points (entering PreTurn or a
MidTurn with effects, and at the end), and writes tool-call ledger entries durably *before* the
step they name. A checkpoint's data is the whole :class:`~fsm_agent.machine.state.RunState`
through the one converter.

Event types written (payload keys): ``session_started`` (goal, config), ``transition`` (from,
trigger, to, reason), ``message`` (message), ``model_call`` (model, provider, stop_reason,
raw_stop_reason, usage, cost_usd, context), ``tool_call`` (call_id, tool, status), ``control``
(kind, text, control_id), ``control_dropped``, ``resume`` (decisions, limits, confirm_cancel: what a
resume was given), ``recovered`` (state, checkpoint_id, reason),
``turn`` (a :class:`~fsm_agent.types.run.TurnRecord`), ``run_stopped`` (stop), plus the observer
events middleware queue (``budget_warning`` ...) and ``model_retry`` (a retried model call).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson
from attrs import define, field

from ..store.base import Checkpoint, EventRecord, LedgerEntry, LedgerStatus, Store, WriteBatch
from ..tools.execution import idempotency_key
from ..types.codec import unstructure
from ..types.content import ToolUseBlock
from ..types.messages import Message, ToolResultMessage
from .state import RunState

if TYPE_CHECKING:
    from .port import EffectPort

__all__ = ["FormCache", "Journal", "ledger_entry"]


class FormCache:
    """The converted forms of the frozen values a run writes more than once (a message in its
    ``message`` event and in every request's context hash; a tool result in the ledger and in the
    transcript): each is converted once per run segment. Forms are shared: read them, never change
    them."""

    __slots__ = ("_forms", "_json")

    def __init__(self) -> None:
        self._forms: dict[int, tuple[Any, Any]] = {}
        self._json: dict[int, tuple[Any, bytes]] = {}

    def of(self, obj: Any) -> Any:
        """``unstructure(obj)``, converted once."""
        hit = self._forms.get(id(obj))
        if hit is None or hit[0] is not obj:
            hit = (obj, unstructure(obj))
            self._forms[id(obj)] = hit
        return hit[1]

    def json(self, obj: Any) -> bytes:
        """``orjson.dumps(unstructure(obj))``, encoded once."""
        hit = self._json.get(id(obj))
        if hit is None or hit[0] is not obj:
            hit = (obj, bytes(memoryview(orjson.dumps(self.of(obj)))))  # exact size: orjson keeps 4 KiB
            self._json[id(obj)] = hit
        return hit[1]


@define
class Journal:
    """Buffers a run's events and commits them with checkpoints and ledger entries.

    Every write goes through the run's port (:attr:`port`), its event times come from the port's
    clock and its checkpoint ids from the port's ids, so a replayed run writes the same bytes.

    Args:
        port: the run's effect port (its ``store`` is the session's store).
        session_id: the session.
        next_seq: the seq the next event gets (the session's ``last_seq + 1``).
        owner: the lease owner; every write is fenced to it (``None``: unfenced).
    """

    port: EffectPort
    session_id: str
    next_seq: int
    owner: str | None = None
    forms: FormCache = field(factory=FormCache)
    """Converted forms of the messages and results this journal writes (see :class:`FormCache`)."""
    buffer: list[EventRecord] = field(factory=list)
    queued_ledger: dict[str, LedgerEntry] = field(factory=dict)
    """Ledger entries that may wait for the next commit (see :meth:`ledger`)."""
    last_checkpoint: str | None = None
    _lock: asyncio.Lock = field(factory=asyncio.Lock)
    """Serializes commits: parallel tool calls write their ledger entries concurrently."""

    @property
    def store(self) -> Store:
        """The session's store (the port's)."""
        return self.port.store

    def record(self, type: str, payload: dict[str, Any], turn: int | None = None) -> int:
        """Buffer one event; returns its seq."""
        seq = self.next_seq
        self.next_seq += 1
        # (session_id, seq) is unique, so the event id is derived from it rather than drawn at random
        self.buffer.append(EventRecord(self.session_id, seq, type, payload,
                                       f"{self.session_id}:{turn}" if turn else None, self.port.now(),
                                       f"{self.session_id}:{seq}"))
        return seq

    def message(self, message: Message, turn: int) -> int:
        """Buffer a ``message`` event; returns its seq."""
        return self.record("message", {"message": self.forms.of(message)}, turn)

    async def flush(self, *, checkpoint: Checkpoint | None = None, ledger: tuple[LedgerEntry, ...] = (),
                    state: str | None = None, stop: dict[str, Any] | None = None) -> None:
        """Commit buffered events (and what is given) in one transaction.

        Raises:
            LeaseLost: another worker took the session over.
            StoreError: the store could not write (the events stay buffered for the next try).
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
                await self.port.store.write(WriteBatch(self.session_id, events, checkpoint, tuple(queued.values()), state,
                                                  stop, self.owner))
            except BaseException:
                self.buffer = list(events) + self.buffer
                self.queued_ledger = {**queued, **self.queued_ledger}
                raise
            if checkpoint is not None:
                self.last_checkpoint = checkpoint.checkpoint_id

    def checkpoint(self, run: RunState, safe_point: str) -> Checkpoint:
        """A checkpoint of ``run`` (the whole state) at the last buffered seq; commit it with :meth:`flush`."""
        return Checkpoint(self.port.new_id(), self.session_id, self.next_seq - 1, safe_point, unstructure(run),
                          self.port.now())

    async def ledger(self, *entries: LedgerEntry, durable: bool = True) -> None:
        """Write ledger entries (and buffered events) durably now, or, with ``durable=False``, with the
        next commit (for states whose loss a crash makes harmless: a pure tool simply runs again)."""
        if durable:
            await self.flush(ledger=tuple(entries))
        else:
            for entry in entries:
                self.queued_ledger[entry.call_id] = entry


def ledger_entry(session_id: str, turn: int, call: ToolUseBlock, status: LedgerStatus, *, effect: str = "pure",
                 result: ToolResultMessage | None = None, now: float, forms: FormCache | None = None) -> LedgerEntry:
    """The ledger entry of ``call`` in ``status`` at ``now`` (Unix seconds; its idempotency key is stable
    across resumes); ``forms``: where the result's converted form may already be."""
    form = None if result is None else forms.of(result) if forms is not None else unstructure(result)
    return LedgerEntry(session_id, call.id, call.name, dict(call.input), idempotency_key(session_id, call.id),
                       effect, status, turn, form, now)
