"""Turn records: each turn written as seed 004 describes it (a ``turn`` event at its end).

A :class:`~fsm_agent.types.TurnRecord` holds the turn's input event, a hash and seq of exactly what
the model was sent, the model call with its cost, the tool calls, their observations, the
verification and the stop reason. The request hash is of the request's converted form; messages
are frozen, so only the ones new to this request are converted (and hashed) each turn.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
from attrs import evolve

from ..errors import StoreError
from ..store.base import LedgerStatus
from ..types.codec import unstructure
from ..types.content import ToolUseBlock
from ..types.messages import Message, ToolResultMessage
from ..types.requests import MessageRequest
from ..types.run import ContextRef, TurnRecord
from .journal import FormCache, Journal
from .state import RunState

__all__ = ["TurnRecorder"]

_EMPTY_MESSAGES = b'"messages":[]'


class TurnRecorder:
    """Fills the current turn's record as the turn goes and writes it when the turn ends (only
    when the run is journaled)."""

    __slots__ = ("journal", "run", "session_id", "current", "last_message_seq", "transition_seq", "verdict",
                 "forms", "_sent", "_tool_forms")

    def __init__(self, journal: Journal | None, run: RunState, session_id: str) -> None:
        self.journal = journal
        self.run = run
        self.session_id = session_id
        self.current: dict[str, Any] | None = None
        """The current turn's record, or ``None``."""
        self.last_message_seq: int | None = None
        """Seq of the session's last ``message`` event (the input of the next turn)."""
        self.transition_seq: int | None = None
        """Seq of the last ``transition`` event (the input of a turn resumed in MidTurn)."""
        self.verdict: str | None = None
        """PostTurn's verdict, for the record of the turn that ends the run."""
        self.forms = journal.forms if journal is not None else FormCache()
        """Converted and encoded forms of the messages (shared with the journal)."""
        self._sent: tuple[bytes, tuple[Message, ...], Any] | None = None
        """The last request's head, messages and the hash state after them."""
        self._tool_forms: tuple[tuple[int, ...], Any, Any] | None = None

    def start(self, request: MessageRequest) -> None:
        """A model call starts a turn: its context hash and input."""
        j = self.journal
        if j is None:
            self.current = None
            return
        self.current = {"turn": self.run.turn, "input_seq": self.last_message_seq,
                        "context": ContextRef(self.digest(request), j.next_seq - 1, len(request.messages))}

    def digest(self, request: MessageRequest) -> str:
        """``sha256(orjson.dumps(unstructure(request)))`` as hex, computed without converting or hashing
        the whole conversation again each turn: each message is encoded once, and the hash state after
        the messages the last request shared with this one (by identity, as the transcript grows) is
        carried on, so a call costs what its new messages cost."""
        data: dict[str, Any] = unstructure(evolve(request, messages=(), tools=()))
        if request.tools:  # the same definitions every turn: converted once
            key = tuple(map(id, request.tools))
            if self._tool_forms is None or self._tool_forms[0] != key:
                self._tool_forms = (key, unstructure(request.tools), request.tools)
            data["tools"] = self._tool_forms[1]
        raw = orjson.dumps(data)
        at = raw.index(_EMPTY_MESSAGES) + len(_EMPTY_MESSAGES) - 1  # only "model" (a string) comes first
        head, tail = raw[:at], raw[at:]
        msgs = request.messages
        last = self._sent
        if last is not None and last[0] == head and len(last[1]) <= len(msgs) and all(
                a is b for a, b in zip(last[1], msgs)):
            state, done = last[2].copy(), len(last[1])
        else:
            state, done = hashlib.sha256(head), 0
        encode = self.forms.json
        for i in range(done, len(msgs)):
            if i:
                state.update(b",")
            state.update(encode(msgs[i]))
        self._sent = (head, msgs, state.copy())
        state.update(tail)
        return state.hexdigest()

    @property
    def context(self) -> ContextRef | None:
        """The current turn's context reference, or ``None``."""
        return self.current.get("context") if self.current else None

    def model_call(self, info: dict[str, Any], calls: tuple[ToolUseBlock, ...]) -> None:
        """The turn's model call (as logged) and the tool calls it asked for."""
        if self.current is not None:
            self.current["model_call"] = info
            self.current["tool_calls"] = [c.id for c in calls]

    def observe(self, call: ToolUseBlock, status: LedgerStatus, result: ToolResultMessage | None) -> None:
        """A tool call's ledger state, as an observation of the turn."""
        if self.current is not None:
            self.current.setdefault("observations", []).append(
                {"call_id": call.id, "tool": call.name, "status": status.value,
                 "is_error": bool(result.is_error) if result is not None else None})

    def end(self, *, stop_reason: str | None = None, verification: str | None = None) -> None:
        """Write the current turn's record (nothing without a journal or a turn)."""
        rec, j = self.current, self.journal
        if rec is None or j is None:
            return
        self.current = None
        if verification is None:
            verification, self.verdict = self.verdict, None
        turn = TurnRecord(rec["turn"], rec.get("input_seq"), rec.get("context"), rec.get("model_call"),
                          tuple(rec.get("tool_calls", ())), tuple(rec.get("observations", ())),
                          verification, stop_reason, rec.get("resumed", False))
        j.record("turn", {"turn": unstructure(turn)}, turn.turn)

    def resumed(self) -> None:
        """A run resumed in MidTurn finishes a turn whose record was written when it stopped: the rest
        of that turn (its tool calls, observations, verification) gets a ``resumed`` record."""
        if self.journal is None or not self.run.pending_calls:
            return
        self.current = {"turn": self.run.turn, "input_seq": self.transition_seq, "resumed": True,
                        "tool_calls": [c.id for c in self.run.pending_calls]}

    async def find_input_seq(self) -> None:
        """The seq of the session's last message, for the input of this run's first turn: the initial
        messages were journaled before the driver ran, and a resumed run appended none yet."""
        j = self.journal
        if j is None or self.last_message_seq is not None:
            return
        buffered = [e.seq for e in j.buffer if e.type == "message"]
        if buffered:
            self.last_message_seq = buffered[-1]
            return
        try:
            found = await j.store.read_events(self.session_id, 0, None, types=("message",))
        except StoreError:  # only the turn record's input_seq is lost
            return
        if found:
            self.last_message_seq = found[-1].seq
