"""Decisions: a person's answers to pending tool calls, with one writer and one reader.

A run that needs a person stops WAITING_HUMAN with its pending calls (Stop-Resume), or waits for
them in process (Hang-Wait, ``RunConfig.approval_timeout``). Either way the question is the same:
*these calls are pending; approve, edit, reject or respond to each*. This module is the only code
that writes or reads the answers:

* **the writer**, :func:`write_decisions` (and :func:`write_decision`): checks each decision
  against the question pending now with :func:`check_decision` (a pure function), then stores it
  atomically. The approval route, A2A and :meth:`fsm_agent.Agent.decide` all write through it.
* **the reader**, :func:`read_decisions`: the stored decisions that answer the calls pending now.
  ``execute`` (the server's runs, in process or on a worker of another host),
  :meth:`fsm_agent.Agent.resume` and Hang-Wait (:mod:`fsm_agent.machine.midturn`, through the run's
  port) all read through it.

**Storage.** A decision has one home: the record stored under ``decision:<call id>#<round>`` in
the session's idempotency keys (:meth:`~fsm_agent.store.base.Store.claim_idempotency_key`: one
atomic insert in every store, so of two writers racing on one question exactly one wins, across
processes and hosts). The record is ``{"request": {"call_id", "decision"}, "outcome": {...},
"call_id", "decision"}``; ``outcome`` is the writer's answer (:meth:`DecisionOutcome.to_json`).

**Rounds.** A decision answers one question. A call's question is asked again after its decision
was used (after a crash, "the outcome is unknown: run it again?"): that is a new round, and only a
new decision answers it. The round of a call is how many decisions of it were used: the
``resume`` events of the session's log (what each resume was given) and the
:data:`DECISIONS_TAKEN` events (what a Hang-Wait took).

**The question pending now** (:func:`read_question`): for a session stopped WAITING_HUMAN, the
pending actions of its stop. For a run waiting in process, the pending actions of its last
:data:`DECISIONS_AWAITED` event, when no transition followed it, less the calls a
:data:`DECISIONS_TAKEN` event took since. At any other time nothing is pending.

**Waking a run that waits.** When the writer stores a decision for a run waiting in process, it
also queues a :attr:`~fsm_agent.store.base.ControlKind.DECISION` control: a wake-up without
content (its text is the call id), so that the waiting run reads the decisions again at once
instead of at its next poll. The decision itself is read only from its record.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from attrs import field, frozen

from ..control import Decision
from ..errors import ConfigurationError, DecisionRefused, ToolArgumentsError
from ..types.codec import structure, unstructure
from ..types.run import StopReason
from .base import QUEUED, ControlKind, ControlRecord, SessionRecord, Store

if TYPE_CHECKING:
    from ..tools.registry import Tool

__all__ = ["DECISIONS_AWAITED", "DECISIONS_TAKEN", "DECISION_KEY", "DECISION_KINDS", "DecisionOutcome",
           "DecisionRefused", "Question", "ToolLookup", "check_decision", "decision_key", "merge_decisions",
           "read_decisions", "read_question", "write_decision", "write_decisions"]

DECISION_KINDS = ("approve", "edit", "reject", "respond")
"""The kinds of a person's decision on a pending tool call."""

DECISION_KEY = "decision:"
"""Prefix of the idempotency key a decision is stored under: ``decision:<call id>#<round>``."""

DECISIONS_AWAITED = "decisions_awaited"
"""Log event of a run that starts waiting in process (Hang-Wait): ``pending_actions`` (the calls it
waits for, as in a WAITING_HUMAN stop) and ``timeout`` (seconds it waits at most)."""

DECISIONS_TAKEN = "decisions_taken"
"""Log event of a run waiting in process that took decisions: ``decisions`` (call id -> decision).
Like the ``decisions`` of a ``resume`` event, each one used closes its call's round."""

_WAITING = StopReason.WAITING_HUMAN.value
_STOPS = frozenset(r.value for r in StopReason)


class ToolLookup(Protocol):
    """What :func:`check_decision` needs of the tools: a tool by name (``None``: unknown), whose
    ``validate(arguments)`` raises :class:`~fsm_agent.errors.ToolArgumentsError` for arguments that
    break its schema (a :class:`~fsm_agent.tools.ToolRegistry` is one)."""

    def get(self, name: str) -> Tool | None: ...


def decision_key(call_id: str, round_: int) -> str:
    """The idempotency key of the decision on round ``round_`` of ``call_id``'s question."""
    return f"{DECISION_KEY}{call_id}#{round_}"


@frozen
class Question:
    """What a session asks a person now: the input of :func:`check_decision`."""

    session_id: str
    state: str
    """The session's state (``WAITING_HUMAN``, a phase while a run waits in process, ...)."""
    pending: Mapping[str, Mapping[str, Any]] = field(factory=dict)
    """The calls waiting for a decision, by call id: unstructured
    :class:`~fsm_agent.types.run.PendingAction` s (``call`` with ``id``, ``name``, ``input``;
    ``reason``; ``allowed_decisions``)."""
    rounds: Mapping[str, int] = field(factory=dict)
    """How many decisions of each call were used already, by call id (absent: 0)."""
    live: bool = False
    """The run waits in process (Hang-Wait): a decision also wakes it."""

    @property
    def waiting(self) -> bool:
        """Whether the session waits for decisions at all now."""
        return self.state == _WAITING or self.live

    def round_of(self, call_id: str) -> int:
        """The round of ``call_id``'s question now."""
        return self.rounds.get(call_id, 0)


@frozen
class DecisionOutcome:
    """What the writer did with one decision."""

    session_id: str
    call_id: str
    decision: Decision
    round: int
    """The round of the call's question it answers."""
    reason: str = ""
    """Why the call waited (the pending action's ``reason``)."""
    replayed: bool = False
    """``True``: the same decision had been taken already; this is the first one's outcome and
    nothing was stored now."""
    live: bool = False
    """The run waited in process (Hang-Wait) when the decision was taken."""

    @property
    def key(self) -> str:
        """The idempotency key its record is stored under."""
        return decision_key(self.call_id, self.round)

    def to_json(self) -> dict[str, Any]:
        """The answer to give a client: ``session_id``, ``call_id``, ``decision`` (the kind),
        ``status`` (``accepted``), ``reason``, ``round``, and ``replayed: true`` for a repeat."""
        out: dict[str, Any] = {"session_id": self.session_id, "call_id": self.call_id, "decision": self.decision.kind,
                               "status": "accepted", "reason": self.reason, "round": self.round}
        if self.replayed:
            out["replayed"] = True
        return out

    def record(self) -> dict[str, Any]:
        """The record to store under :attr:`key` (see the module doc)."""
        request = _request(self.call_id, self.decision)
        outcome = {k: v for k, v in self.to_json().items() if k != "replayed"}
        return {"request": request, "outcome": outcome, "call_id": self.call_id, "decision": request["decision"]}

    @classmethod
    def from_record(cls, record: Mapping[str, Any], session_id: str, call_id: str, round_: int,
                    *, replayed: bool = True, live: bool = False) -> DecisionOutcome:
        """The outcome a stored record holds (a repeat of it is answered with this)."""
        outcome = _member(record, "outcome")
        return cls(session_id, call_id, _stored_decision(record), int(outcome.get("round", round_)),
                   str(outcome.get("reason") or ""), replayed, live)


def _request(call_id: str, decision: Decision) -> dict[str, Any]:
    return {"call_id": call_id, "decision": unstructure(decision)}


def _member(record: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = record.get(name)
    return value if isinstance(value, dict) else {}


def _stored_decision(record: Mapping[str, Any]) -> Decision:
    raw = _member(record, "request").get("decision", record.get("decision"))
    return structure(raw, Decision)


def _prior_decision(record: Mapping[str, Any]) -> Decision | None:
    try:
        return _stored_decision(record)
    except Exception:  # noqa: BLE001 - a record this release did not write: name it by what it holds
        return None


def check_decision(question: Question, call_id: str, decision: Decision, *,
                   stored: Mapping[str, Mapping[str, Any]] | None = None,
                   tools: ToolLookup | None = None) -> DecisionOutcome:
    """Check one decision against the question pending now. Pure: it reads only its arguments (a
    durable-execution host calls it as the validator of its own decision updates).

    Args:
        question: what the session asks now (:func:`read_question`).
        call_id: the pending call the decision answers.
        decision: the decision.
        stored: the decision records stored so far, by key (:func:`decision_key`): a decision
            stored for this round, and the one of the round before.
        tools: to check an edit's arguments against its tool's schema (``None``: not checked).

    Returns:
        the outcome to store (``replayed`` false), or, when the same decision answered this
        question already (or the round before, if the call is pending no more), the first one's
        outcome (``replayed`` true: store nothing).

    Raises:
        DecisionRefused: ``conflict`` (a different decision answered it first), ``not_waiting``,
            ``not_pending``, ``not_allowed``, ``bad_arguments`` (see the class).
    """
    stored = stored or {}
    sid = question.session_id
    round_ = question.round_of(call_id)
    request = _request(call_id, decision)
    prior = stored.get(decision_key(call_id, round_))
    if prior is not None:
        return _repeat(prior, request, sid, call_id, round_, question.live)
    pending = question.pending if question.waiting else {}
    p = pending.get(call_id)
    if p is None:
        earlier = stored.get(decision_key(call_id, round_ - 1)) if round_ > 0 else None
        if earlier is not None:  # a repeat after the decision was used: the first outcome, nothing runs again
            return _repeat(earlier, request, sid, call_id, round_ - 1, question.live)
        if question.waiting:
            raise DecisionRefused("not_pending", f"no pending tool call {call_id!r} in session {sid} "
                                                 f"(pending: {', '.join(pending) or 'none'})", call_id=call_id)
        raise DecisionRefused("not_waiting", f"session {sid} is {question.state}, not WAITING_HUMAN: tool call "
                                             f"{call_id!r} is not waiting for a decision (decisions are taken while "
                                             "the session waits; watch its events for the stop)", call_id=call_id)
    allowed = tuple(p.get("allowed_decisions") or DECISION_KINDS)
    if decision.kind not in allowed:
        raise DecisionRefused("not_allowed", f"tool call {call_id!r} allows {', '.join(allowed)}, not "
                                             f"{decision.kind!r}", call_id=call_id)
    if decision.kind == "edit" and tools is not None:
        tool = tools.get(str((p.get("call") or {}).get("name") or ""))
        if tool is not None:
            try:
                tool.validate(decision.arguments or {})
            except ToolArgumentsError as e:
                raise DecisionRefused("bad_arguments", f"'arguments': {e}", call_id=call_id) from e
    return DecisionOutcome(sid, call_id, decision, round_, str(p.get("reason") or ""), False, question.live)


def _repeat(prior: Mapping[str, Any], request: Mapping[str, Any], sid: str, call_id: str, round_: int,
            live: bool) -> DecisionOutcome:
    if prior.get("request") != request:
        first = _prior_decision(prior)
        what = first.kind if first is not None else str(prior.get("request"))
        raise DecisionRefused("conflict", f"tool call {call_id!r} was already decided differently ({what}); a "
                                          "different decision is refused", call_id=call_id, prior=first)
    return DecisionOutcome.from_record(prior, sid, call_id, round_, replayed=True, live=live)


# -- the store side ---------------------------------------------------------------------------------
async def read_question(store: Store, record: SessionRecord) -> Question:
    """The question ``record``'s session asks now (see the module doc), read from its stop and log.

    Raises:
        StoreError: the log could not be read.
    """
    sid = record.session_id
    live = record.state != QUEUED and record.state not in _STOPS
    types = ("resume", DECISIONS_TAKEN) + (("transition", DECISIONS_AWAITED) if live else ())
    events = await store.read_events(sid, types=types)
    rounds: dict[str, int] = {}
    for ev in events:
        if ev.type in ("resume", DECISIONS_TAKEN):
            for cid in ev.payload.get("decisions") or {}:
                rounds[cid] = rounds.get(cid, 0) + 1
    pending: dict[str, Mapping[str, Any]] = {}
    if record.state == _WAITING:
        pending = {p["call"]["id"]: p for p in (record.stop or {}).get("pending_actions") or ()}
    elif live:
        last = max((i for i, ev in enumerate(events) if ev.type == DECISIONS_AWAITED), default=None)
        if last is not None and not any(ev.type == "transition" for ev in events[last + 1:]):
            taken = {cid for ev in events[last + 1:] if ev.type == DECISIONS_TAKEN
                     for cid in ev.payload.get("decisions") or {}}
            pending = {p["call"]["id"]: p for p in events[last].payload.get("pending_actions") or ()
                       if p["call"]["id"] not in taken}
        live = bool(pending)
    return Question(sid, record.state, pending, rounds, live)


async def _stored(store: Store, session_id: str) -> dict[str, dict[str, Any]]:
    return await store.idempotency_records(session_id, DECISION_KEY)


async def write_decisions(store: Store, session_id: str, decisions: Mapping[str, Decision], *,
                          tools: ToolLookup | None = None) -> dict[str, DecisionOutcome]:
    """THE writer: take a person's decisions on calls pending in ``session_id``.

    Every decision is checked (:func:`check_decision`) against the question pending now before any
    is stored, so a refused one stores nothing of the batch. Each is then stored atomically under
    its round's key: of two writers racing on one question (two clients, two servers) exactly one
    stores its decision; the other gets the first outcome back for the same decision, and
    :class:`DecisionRefused` ``conflict`` for a different one. For a run waiting in process, a
    wake-up control is queued once the decisions are stored.

    Returns:
        each decision's outcome, by call id (``replayed``: it had been taken before).

    Raises:
        DecisionRefused: see :func:`check_decision`; ``unknown_session`` for an unknown session.
        ConfigurationError: ``store`` keeps no idempotency keys (a custom store): decisions cannot be stored.
        StoreError: the store could not be read or written.
    """
    record = await store.get_session(session_id)
    if record is None:
        cid = next(iter(decisions), "")
        raise DecisionRefused("unknown_session", f"no session {session_id!r}", call_id=cid)
    question = await read_question(store, record)
    try:
        stored = await _stored(store, session_id)
    except NotImplementedError as e:
        raise ConfigurationError(f"decisions need a store that keeps idempotency keys (MemoryStore, SQLiteStore, "
                                 f"PostgresStore); {type(store).__name__} keeps none") from e
    checked = {cid: check_decision(question, cid, d, stored=stored, tools=tools) for cid, d in decisions.items()}
    out: dict[str, DecisionOutcome] = {}
    for cid, outcome in checked.items():
        if not outcome.replayed:
            first, took = await store.claim_idempotency_key(session_id, outcome.key, outcome.record())
            if not took:  # another writer stored one for this question meanwhile
                outcome = check_decision(question, cid, decisions[cid], stored={outcome.key: first}, tools=tools)
        out[cid] = outcome
    woken = [cid for cid, o in out.items() if o.live and not o.replayed]
    if woken:
        await store.push_control(ControlRecord(session_id, ControlKind.DECISION, " ".join(woken)))
    return out


async def write_decision(store: Store, session_id: str, call_id: str, decision: Decision, *,
                         tools: ToolLookup | None = None) -> DecisionOutcome:
    """:func:`write_decisions` for one decision.

    Raises:
        DecisionRefused, ConfigurationError, StoreError: see :func:`write_decisions`.
    """
    return (await write_decisions(store, session_id, {call_id: decision}, tools=tools))[call_id]


async def read_decisions(store: Store, session: SessionRecord | str, calls: Iterable[str] | None = None
                         ) -> dict[str, Decision]:
    """THE reader: the stored decisions that answer the calls pending now, by call id.

    Args:
        session: the session's record, or its id (then it is read).
        calls: the pending calls, when the caller holds the question itself (a run waiting in
            process); ``None``: the calls pending in the session now (:func:`read_question`).

    A store that keeps no idempotency keys has no decisions: ``{}``.

    Raises:
        StoreError: the store could not be read.
    """
    record = session if isinstance(session, SessionRecord) else await store.get_session(session)
    if record is None:
        return {}
    if calls is None and (record.state == QUEUED or record.state in _STOPS) and not (
            record.state == _WAITING and (record.stop or {}).get("pending_actions")):
        return {}  # stopped, and not for a person's decisions: nothing is pending
    question = await read_question(store, record)
    wanted = list(calls) if calls is not None else list(question.pending)
    if not wanted:
        return {}
    try:
        stored = await _stored(store, record.session_id)
    except NotImplementedError:
        return {}
    out: dict[str, Decision] = {}
    for cid in wanted:
        found = stored.get(decision_key(cid, question.round_of(cid)))
        if found is not None:
            out[cid] = _stored_decision(found)
    return out


def merge_decisions(given: Mapping[str, Decision] | None, stored: Mapping[str, Decision]) -> dict[str, Decision]:
    """The decisions a resume applies: ``stored`` ones (:func:`read_decisions`) and those ``given``
    to it. Pure.

    Raises:
        DecisionRefused: ``conflict``: a given decision differs from the one stored for its call.
    """
    out = dict(stored)
    for cid, d in (given or {}).items():
        first = stored.get(cid)
        if first is not None and first != d:
            raise DecisionRefused("conflict", f"tool call {cid!r} was already decided differently ({first.kind}); "
                                              f"a different decision ({d.kind}) is refused", call_id=cid, prior=first)
        out[cid] = d
    return out
