"""Who drives the runs a server accepts: the :class:`RunRequest`, the :class:`Runner` interface,
the in-process :class:`LocalRunner`, and :func:`execute`, which carries out one request on an
:class:`~fsm_agent.Agent` for every runner (in process here, or a worker of
:mod:`fsm_agent.server.queue` on another host).

Decisions are not carried in requests: the approval route and A2A store each one through the one
writer (:func:`fsm_agent.store.decisions.write_decisions`), and :func:`execute` reads, through the
one reader (:func:`~fsm_agent.store.decisions.read_decisions`), the decisions that answer the calls
pending when it resumes. Several decisions posted for one stop are all applied: after a run stops
WAITING_HUMAN, :func:`execute` resumes again at once when stored decisions answer calls still pending.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from typing import Any, Literal

from attrs import field, frozen

from ..agent import Agent
from ..errors import ResumeError, SessionBusyError
from ..orchestration.a2a_wire import SERVER_STOPPING  # its home: A2A tells such a task WORKING
from ..store.base import QUEUED, ControlKind, Store
from ..store.decisions import read_decisions
from ..types.run import RunResult, StopReason
from .notify import Notifier

__all__ = ["RESUME_LIMITS", "SERVER_STOPPING", "STOPPED_STATES", "Busy", "LocalRunner", "RunRequest", "Runner",
           "drain_tasks", "execute"]

log = logging.getLogger("fsm_agent.server")

STOPPED_STATES = frozenset(r.value for r in StopReason)
"""The session states of a stopped session (a StopReason's value); any other is a phase or ``QUEUED``."""
_STOPS = STOPPED_STATES

RESUME_LIMITS: dict[str, tuple[type, ...]] = {
    "max_iterations": (int,), "max_wall_clock": (int, float), "max_tokens": (int,), "max_cost_usd": (int, float),
    "max_output_tokens": (int,), "tool_timeout": (int, float)}
"""The RunConfig fields a resume may raise (REST ``limits``, an A2A ``limits`` data part), with the
JSON types they take."""


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


async def execute(agent: Agent, request: RunRequest) -> RunResult | None:
    """Carry out ``request`` on ``agent``; ``None`` when there was nothing to run.

    A ``start`` runs the QUEUED session's task. A ``resume`` resumes with the stored decisions that
    answer the pending calls (:func:`~fsm_agent.store.decisions.read_decisions`, the one reader).
    After a run that stops WAITING_HUMAN, it resumes again while stored decisions answer newly
    pending calls.

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
        waiting = rec.state == StopReason.WAITING_HUMAN.value
        decisions = await read_decisions(store, rec) if waiting else {}
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
            elif await read_decisions(store, rec) or (
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
