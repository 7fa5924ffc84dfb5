"""Who drives the runs a server accepts: the :class:`RunRequest`, the :class:`Runner` interface,
the in-process :class:`LocalRunner`, and :func:`execute`, which carries out one request on an
:class:`~fsm_agent.Agent` for every runner (in process here, or a worker of
:mod:`fsm_agent.server.queue` on another host).

Decisions are not carried in requests: the approval route stores each one under the idempotency
key ``decision:<call id>#<round>`` (:meth:`~fsm_agent.store.base.Store.claim_idempotency_key`),
and :func:`execute` reads the stored decisions for the calls pending when it resumes. Several
decisions posted for one stop are all applied: after a run stops WAITING_HUMAN, :func:`execute`
resumes again at once when stored decisions answer calls still pending.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from typing import Any, Literal

from attrs import field, frozen

from ..agent import Agent
from ..control import Decision
from ..errors import ResumeError, SessionBusyError, ToolArgumentsError
from ..store.base import QUEUED, SessionRecord, Store
from ..tools.registry import ToolRegistry
from ..types.codec import structure, unstructure
from ..types.run import RunResult, StopReason
from .notify import Notifier

__all__ = ["DECISION_KEY", "DECISION_KINDS", "RESUME_LIMITS", "SERVER_STOPPING", "STOPPED_STATES", "Busy", "DecisionRefused",
           "LocalRunner", "RunRequest", "Runner", "decision_key", "decision_record", "decision_rounds",
           "drain_tasks", "execute", "stored_decisions"]

log = logging.getLogger("fsm_agent.server")

STOPPED_STATES = frozenset(r.value for r in StopReason)
"""The session states of a stopped session (a StopReason's value); any other is a phase or ``QUEUED``."""
_STOPS = STOPPED_STATES

DECISION_KINDS = ("approve", "edit", "reject", "respond")
"""The kinds of a person's decision on a pending tool call."""

RESUME_LIMITS: dict[str, tuple[type, ...]] = {
    "max_iterations": (int,), "max_wall_clock": (int, float), "max_tokens": (int,), "max_cost_usd": (int, float),
    "max_output_tokens": (int,), "tool_timeout": (int, float)}
"""The RunConfig fields a resume may raise (REST ``limits``, an A2A ``limits`` data part), with the
JSON types they take."""

SERVER_STOPPING = "server stopping"
"""The detail of a run a stopping server interrupted (:meth:`LocalRunner.close`)."""

DECISION_KEY = "decision:"
"""Prefix of the idempotency key under which a decision is stored: ``decision:<call id>#<round>``
(:func:`decision_key`)."""


@frozen
class RunRequest:
    """A run to carry out: the first run of a QUEUED session (``start``), a resume, or the
    recovery of a session whose worker died mid-run (``recover``: a resume only while the session
    is still in a phase, never of a session that stopped)."""

    session_id: str
    kind: Literal["start", "resume", "recover"]
    task: str | None = None
    """For ``start``: the task (user message)."""
    limits: dict[str, Any] = field(factory=dict)
    """For ``resume``: raised RunConfig fields (``max_iterations`` ...)."""
    confirm_cancel: bool = False


class Busy(Exception):
    """The session is driven by another worker now; try the request again later."""


async def decision_rounds(store: Store, session_id: str) -> dict[str, int]:
    """How many times each call's decision has been consumed by a resume (the ``resume`` events
    of the log), by call id. A call's decisions are numbered by round: the question pending now is
    round ``decision_rounds(...).get(call_id, 0)``."""
    rounds: dict[str, int] = {}
    for ev in await store.read_events(session_id, types=("resume",)):
        for cid in ev.payload.get("decisions") or {}:
            rounds[cid] = rounds.get(cid, 0) + 1
    return rounds


def decision_key(call_id: str, round_: int) -> str:
    """The idempotency key of the decision on round ``round_`` of ``call_id``'s question."""
    return f"{DECISION_KEY}{call_id}#{round_}"


async def stored_decisions(store: Store, rec: SessionRecord) -> dict[str, Decision]:
    """The stored, not yet consumed decisions that answer the calls pending in a WAITING_HUMAN
    session, by call id (none for a session in any other state).

    A decision answers one round of a call's question: once a resume consumed it, a later question
    about the same call (e.g. "the outcome is unknown after a crash: run it again?") is a new round
    that only a new decision answers. An approval is never replayed onto a different question.
    """
    if rec.state != StopReason.WAITING_HUMAN.value:
        return {}
    pending = [p["call"]["id"] for p in (rec.stop or {}).get("pending_actions") or ()]
    if not pending:
        return {}
    rounds = await decision_rounds(store, rec.session_id)
    records = await store.idempotency_records(rec.session_id, DECISION_KEY)
    out: dict[str, Decision] = {}
    for cid in pending:
        stored = records.get(decision_key(cid, rounds.get(cid, 0)))
        if stored is not None:
            out[cid] = structure(stored["decision"], Decision)
    return out


class DecisionRefused(Exception):
    """A decision that cannot be taken (:func:`decision_record`); ``kind``: ``not_waiting`` (the
    session does not wait for a decision), ``not_pending`` (no such pending call), ``not_allowed``
    (a kind the call does not allow) or ``bad_arguments`` (an edit whose arguments break the tool's
    schema). The message says what was wrong."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def decision_record(rec: SessionRecord, call_id: str, decision: Decision, round_: int,
                    tools: ToolRegistry) -> dict[str, Any]:
    """The record to store under :func:`decision_key` ``(call_id, round_)`` for a person's decision
    on a call pending in ``rec`` (what the approval route and an A2A message both store):
    ``request`` (call id, decision), ``outcome`` (the answer to give), ``call_id``, ``decision``.

    Raises:
        DecisionRefused: see the class.
    """
    sid = rec.session_id
    waiting = rec.state == StopReason.WAITING_HUMAN.value
    pending = {p["call"]["id"]: p for p in (rec.stop or {}).get("pending_actions") or ()} if waiting else {}
    p = pending.get(call_id)
    if p is None:
        if waiting:
            raise DecisionRefused("not_pending", f"no pending tool call {call_id!r} in session {sid} "
                                                 f"(pending: {', '.join(pending) or 'none'})")
        raise DecisionRefused("not_waiting", f"session {sid} is {rec.state}, not WAITING_HUMAN: tool call {call_id!r} "
                                             "is not waiting for a decision (decisions are taken while the session "
                                             "waits; watch its events for the stop)")
    allowed = tuple(p.get("allowed_decisions") or DECISION_KINDS)
    if decision.kind not in allowed:
        raise DecisionRefused("not_allowed", f"tool call {call_id!r} allows {', '.join(allowed)}, not {decision.kind!r}")
    if decision.kind == "edit":
        t = tools.get(p["call"]["name"])
        if t is not None:
            try:
                t.validate(decision.arguments or {})
            except ToolArgumentsError as e:
                raise DecisionRefused("bad_arguments", f"'arguments': {e}") from e
    value = {"call_id": call_id, "decision": unstructure(decision)}
    outcome = {"session_id": sid, "call_id": call_id, "decision": decision.kind, "status": "accepted",
               "reason": p.get("reason") or "", "round": round_}
    return {"request": value, "outcome": outcome, "call_id": call_id, "decision": value["decision"]}


async def execute(agent: Agent, request: RunRequest) -> RunResult | None:
    """Carry out ``request`` on ``agent``; ``None`` when there was nothing to run.

    A ``start`` runs the QUEUED session's task. A ``resume`` resumes with the stored decisions of
    the pending calls (:func:`stored_decisions`). After a run that stops WAITING_HUMAN, it resumes
    again while stored decisions answer newly pending calls.

    Raises:
        Busy: another worker holds the session's lease.
    """
    store = agent.store
    sid = request.session_id
    rec = await store.get_session(sid)
    if rec is None:
        log.warning("run request for unknown session %s dropped", sid)
        return None
    result: RunResult | None = None
    kind = request.kind
    if kind == "start" and rec.state != QUEUED:
        # started already: by a worker that died (recover it once its lease expired), or a duplicate
        kind = "recover"
    if kind == "recover" and rec.state in _STOPS:
        return None  # it stopped (its worker was alive after all): a stop is resumed only when asked
    first_resume = kind != "start"
    if not first_resume:
        try:
            task = request.task or str(rec.metadata.get("task") or rec.goal)
            result = await agent.run(task, session_id=sid)
        except SessionBusyError as e:
            raise Busy(str(e)) from e
    limits, confirm = dict(request.limits), request.confirm_cancel
    while True:
        rec = await store.get_session(sid)
        if rec is None:
            return result
        decisions = await stored_decisions(store, rec)
        waiting = rec.state == StopReason.WAITING_HUMAN.value
        if not first_resume and not (waiting and decisions):
            return result
        if waiting and not decisions and not limits and not confirm and not await _has_controls(store, sid):
            return result  # nothing new to resume with: it would stop WAITING_HUMAN again at once
        first_resume = False
        try:
            await agent.check_resume(sid, decisions)
        except SessionBusyError as e:
            raise Busy(str(e)) from e
        except ResumeError as e:
            log.info("resume of %s not possible: %s", sid, e)
            return result
        try:
            result = await agent.resume(sid, decisions=decisions, confirm_cancel=confirm, **limits)
        except SessionBusyError as e:
            raise Busy(str(e)) from e
        limits, confirm = {}, False


async def _has_parent(store: Store, sid: str) -> bool:
    try:
        return await store.parent(sid) is not None
    except NotImplementedError:  # a store that keeps no links
        return False


async def _has_controls(store: Store, sid: str) -> bool:
    from ..store.base import ControlKind

    return await store.peek_controls(sid, [ControlKind.STEER, ControlKind.FOLLOWUP, ControlKind.CANCEL])


async def drain_tasks(tasks: list[asyncio.Task[Any]], timeout: float) -> None:
    """Wait up to ``timeout`` seconds for ``tasks`` to end, then cancel the rest and wait for them
    (an interrupted run ends on its own; a cancelled one records INTERRUPTED)."""
    if not tasks:
        return
    _done, left = await asyncio.wait(tasks, timeout=timeout)
    for t in left:
        t.cancel()
    for t in left:
        with contextlib.suppress(BaseException):
            await t


class Runner(abc.ABC):
    """Carries out :class:`RunRequest` s somewhere: in this process (:class:`LocalRunner`) or on
    workers (:class:`fsm_agent.server.queue.QueueRunner`)."""

    async def start(self) -> None:
        """Called when the app starts."""

    @abc.abstractmethod
    async def submit(self, request: RunRequest) -> None:
        """Accept ``request``; returns at once (the run happens in the background)."""

    @abc.abstractmethod
    async def busy(self, session_id: str) -> bool:
        """Whether a run of ``session_id`` is queued or in progress (an event stream stays open)."""

    async def close(self) -> None:
        """Stop: runs in progress are interrupted (they end INTERRUPTED, resumable)."""


class LocalRunner(Runner):
    """Runs requests as tasks of this process, one session at a time: a request for a session
    that is running waits for that run to end (so decisions and controls that arrive meanwhile are
    applied by the next run, never lost).

    Args:
        agent: the agent that drives every run.
        notifier: woken when a session's runs are done, so that its event streams can close.
        retry_busy: seconds to wait before trying again a session another process drives.
    """

    def __init__(self, agent: Agent, notifier: Notifier | None = None, *, retry_busy: float = 1.0) -> None:
        self.agent = agent
        self.notifier = notifier
        self.retry_busy = retry_busy
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._next: dict[str, list[RunRequest]] = {}

    async def start(self) -> None:
        """Pick up what a previous server process left: sessions still ``QUEUED``, sessions left
        in a phase (that process died mid-run: each is recovered once its lease expires), sessions
        it interrupted when it stopped, and WAITING_HUMAN sessions whose stored decisions were
        never applied. A child session (an agent called as a tool, a handoff's successor, a
        leader's worker: it has a parent link) is left to its parent, which resumes it when the
        parent's call runs again (this server's agent may not be the child's agent)."""
        store = self.agent.store
        for rec in await store.list_sessions(100_000):
            kind: Literal["start", "resume", "recover"]
            if rec.state == QUEUED:
                kind = "start"
            elif rec.state not in _STOPS:
                kind = "recover"
            elif await stored_decisions(store, rec) or (
                    rec.state == StopReason.INTERRUPTED.value
                    and str((rec.stop or {}).get("detail", "")).startswith(SERVER_STOPPING)):
                kind = "resume"
            else:
                continue
            if not await _has_parent(store, rec.session_id):
                await self.submit(RunRequest(rec.session_id, kind))

    async def submit(self, request: RunRequest) -> None:
        sid = request.session_id
        self._next.setdefault(sid, []).append(request)
        if sid not in self._tasks:
            task = asyncio.get_running_loop().create_task(self._drain(sid), name=f"fsm-run-{sid}")
            self._tasks[sid] = task

    async def busy(self, session_id: str) -> bool:
        return session_id in self._tasks

    async def _drain(self, sid: str) -> None:
        try:
            while self._next.get(sid):
                request = self._next[sid].pop(0)
                while True:
                    try:
                        await execute(self.agent, request)
                        break
                    except Busy as e:
                        log.info("session %s: %s; trying again in %.1fs", sid, e, self.retry_busy)
                        await asyncio.sleep(self.retry_busy)
                    except Exception:  # noqa: BLE001 - the failure is in the session's log; keep serving
                        log.exception("run of session %s failed", sid)
                        break
        finally:
            self._tasks.pop(sid, None)
            self._next.pop(sid, None)
            if self.notifier is not None:
                self.notifier.notify(sid)

    async def close(self, grace: float = 5.0) -> None:
        """Interrupt the runs in progress (each ends INTERRUPTED, resumable, with the detail
        ``server stopping``: the next :meth:`start` resumes them), wait up to ``grace`` seconds
        for them to stop, then cancel what is left."""
        self._next.clear()
        tasks = list(self._tasks.values())
        if not tasks:
            return
        self.agent.interrupt_all(SERVER_STOPPING)
        await drain_tasks(tasks, grace)

    def __repr__(self) -> str:
        return f"LocalRunner(running={len(self._tasks)})"
