"""The client side: an :class:`~fsm_agent.Agent` whose sessions run on Temporal.

``Agent(..., host=TemporalHost(client, agent_name="myapp.agents:support"))`` runs, resumes, decides
and controls through the same methods as in process; each call becomes a workflow start, an
Update, a signal or a query of the session's workflow (whose id is the session's id). Workers that
serve the same agent under the same name (:func:`fsm_agent.temporal.create_worker`, or
``fsm-agent worker --temporal ...``) drive the runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from attrs import evolve
from temporalio.client import (Client, WorkflowHandle, WorkflowUpdateFailedError,
                               WorkflowUpdateRPCTimeoutOrCancelledError)
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from ..config import RunConfig
from ..control import Cancel, Decision, Followup, Interrupt, LoopControl, RequestPermissions, Restrict, Steer
from ..otel import caller_context
from ..errors import PayloadTooLargeError, ResumeError, SessionBusyError, SessionExistsError
from ..store.base import QUEUED, Store
from ..store.decisions import DecisionOutcome
from ..store.sessions import load_session
from ..types.codec import structure, unstructure
from ..types.messages import Message
from ..types.run import RunResult
from .port import Timeouts

if TYPE_CHECKING:
    from ..agent import Agent

__all__ = ["DEFAULT_TASK_QUEUE", "TemporalHost"]

DEFAULT_TASK_QUEUE = "fsm-agent"


class TemporalHost:
    """Where an agent's sessions run when they run on Temporal.

    Args:
        client: a connected ``temporalio.client.Client`` (your cluster, Temporal Cloud, or a dev server).
        agent_name: the name workers serve the agent under (``module:attr`` for ``fsm-agent worker``).
        task_queue: the workers' task queue.
        human_wait: how long a stopped session's workflow waits for a decision, a resume or a control
            before it ends (the session stays resumable in the store; a later resume starts a new
            workflow). ``None``: as long as it takes.
        timeouts: activity timeouts and retries (:class:`~fsm_agent.temporal.port.Timeouts`).
        history_limit: workflow history events after which a session continues as new.
        store: the session store the workers write (for a result's transcript); default: the agent's.
        memo: the Temporal memo of the workflows this host starts (a child session's names its parent
            session and call: ``{"child_of": {"session", "call"}}``).
    """

    def __init__(self, client: Client, *, agent_name: str, task_queue: str = DEFAULT_TASK_QUEUE,
                 human_wait: timedelta | None = None, timeouts: Timeouts | None = None, history_limit: int = 20_000,
                 store: Store | None = None, memo: Mapping[str, Any] | None = None) -> None:
        self.client = client
        self.agent_name = agent_name
        self.task_queue = task_queue
        self.human_wait = human_wait
        self.timeouts = timeouts
        self.history_limit = history_limit
        self.store = store
        self.memo = dict(memo or {})

    def __repr__(self) -> str:
        return f"TemporalHost(agent_name={self.agent_name!r}, task_queue={self.task_queue!r})"

    def _start(self, session_id: str, op: str, **data: Any) -> dict[str, Any]:
        t = self.timeouts
        return {"agent": self.agent_name, "session_id": session_id, "op": op,
                "timeouts": vars(t) if t is not None else {},
                "human_wait_s": self.human_wait.total_seconds() if self.human_wait is not None else None,
                "history_limit": self.history_limit, **data}

    def _check_size(self, what: str, data: dict[str, Any]) -> None:
        """Refuse ``data`` before it is sent when it is over the payload limit."""
        limit = (self.timeouts or Timeouts()).max_payload
        size = len(self.client.data_converter.payload_converter.to_payloads([data])[0].data)
        if size > limit:
            raise PayloadTooLargeError(what, size, limit)

    def handle(self, session_id: str) -> WorkflowHandle[Any, Any]:
        """The session's workflow."""
        return self.client.get_workflow_handle(session_id)

    # -- runs ---------------------------------------------------------------------------------------
    async def run(self, agent: Agent, messages: Sequence[Message], *, session_id: str, config: RunConfig,
                  metadata: Mapping[str, Any] | None, limits: Mapping[str, Any]) -> RunResult:
        """Start the session's workflow and wait for its first stop (see :meth:`fsm_agent.Agent.run`).

        Raises:
            SessionExistsError: a workflow (or a stored session) already has this id.
            PayloadTooLargeError: the task is larger than one payload may be (``Timeouts.max_payload``);
                nothing started.
        """
        start = self._start(session_id, "run", task=unstructure(list(messages), list[Message]),
                            config=unstructure(config), metadata=dict(metadata or {}), limits=dict(limits))
        self._check_size("the start of a run", start)
        store = self.store or agent.store
        rec = await store.get_session(session_id)
        if rec is not None and not (rec.state == QUEUED and not rec.last_seq):
            raise SessionExistsError(session_id)  # (a session a server created QUEUED is this run's own)
        try:
            with caller_context(rec.metadata if rec is not None else metadata):  # a server's caller's trace
                handle = await self.client.start_workflow(
                    "fsm_agent.Session", start, id=session_id, task_queue=self.task_queue,
                    id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                    id_conflict_policy=WorkflowIDConflictPolicy.FAIL, memo=self.memo or None)
        except RPCError as exc:
            raise SessionExistsError(session_id) from exc
        return await self._result(agent, handle, 0)

    async def resume(self, agent: Agent, session_id: str, *, decisions: Mapping[str, Decision] | None,
                     confirm_cancel: bool, limits: Mapping[str, Any]) -> RunResult:
        """Resume the session (see :meth:`fsm_agent.Agent.resume`): an Update of its waiting workflow, or
        a new workflow that continues it from the store when none is open.

        Raises:
            ResumeError: as :meth:`fsm_agent.Agent.check_resume` (a session that ended for good, a
                decision that does not fit, a session being driven).
        """
        req = {"decisions": {k: unstructure(v) for k, v in (decisions or {}).items()},
               "confirm_cancel": confirm_cancel, "limits": dict(limits)}
        handle = self.handle(session_id)
        rec = await (self.store or agent.store).get_session(session_id)
        with caller_context(rec.metadata if rec is not None else None):  # a server's caller's trace
            if await self._open(handle):
                try:
                    segment = await handle.execute_update("resume", req)
                except WorkflowUpdateFailedError as exc:
                    raise _resume_error(exc, session_id) from exc
                return await self._result(agent, handle, segment)
            # no workflow waits for it: the store says whether it can be resumed, then a new workflow does
            await agent.check_resume(session_id, decisions)
            handle = await self.client.start_workflow(
                "fsm_agent.Session", self._start(session_id, "resume", **req), id=session_id,
                task_queue=self.task_queue, id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                memo=self.memo or None)
        return await self._result(agent, handle, 0)

    async def _open(self, handle: WorkflowHandle[Any, Any]) -> bool:
        try:
            desc = await handle.describe()
        except RPCError:
            return False
        return desc.status is not None and desc.status.name == "RUNNING"

    async def _result(self, agent: Agent, handle: WorkflowHandle[Any, Any], segment: int) -> RunResult:
        """The result of segment ``segment`` of the session's workflow (its first, after a start or
        a new workflow), waiting for it to stop."""
        while True:
            try:
                data = await handle.execute_update("wait_stop", segment)
                if data.get("continued"):
                    await asyncio.sleep(0.2)  # the workflow continues as new: ask its new run
                    continue
                break
            except WorkflowUpdateRPCTimeoutOrCancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError() from None  # this wait was cancelled
                continue  # the wait's RPC timed out (a long run): wait again
            except (WorkflowUpdateFailedError, RPCError):
                if not await self._open(handle):
                    final = await handle.result()
                    data = final.get("result") or {}
                    if not data:
                        raise ResumeError(final.get("error") or f"session {handle.id}: no result") from None
                    break
                await asyncio.sleep(0.2)  # the workflow continued as new: ask its new run
        return await self._filled(agent, handle.id, data)

    async def _filled(self, agent: Agent, session_id: str, data: dict[str, Any]) -> RunResult:
        """The result with its transcript, read from the store (the workflow does not carry it)."""
        result: RunResult = structure(data, RunResult)
        loaded = await load_session(self.store or agent.store, session_id)
        if loaded is not None:
            result = evolve(result, messages=tuple(loaded.transcript))
        return result

    # -- a child session's workflow (fsm_agent.orchestration: drive_child) ----------------------------
    async def attach(self, agent: Agent, session_id: str, child_of: Mapping[str, Any]) -> RunResult | None:
        """Wait for the stop of the run the session's open workflow is driving, when it is one this
        parent's call started (its memo's ``child_of`` is ``child_of``): a call run again (its
        activity retried after a worker was lost) finds its child's workflow and waits for it rather
        than starting it anew. ``None``: no open workflow is driving a run of the session (it waits,
        it ended, or there is none).

        Raises:
            SessionLinkError: the open workflow of that id was started by someone else.
        """
        from ..errors import SessionLinkError

        handle = self.handle(session_id)
        try:
            desc = await handle.describe()
        except RPCError:
            return None
        if desc.status is None or desc.status.name != "RUNNING":
            return None
        memo = await desc.memo()
        if memo.get("child_of") not in (None, dict(child_of)):
            raise SessionLinkError(f"workflow {session_id!r} is open and was not started by session "
                                   f"{child_of.get('session')!r}: it is not taken over as that call's child")
        snap = await handle.query("snapshot")
        if snap.get("waiting"):
            return None
        return await self._result(agent, handle, int(snap.get("segment") or 0))

    async def stop_child(self, agent: Agent, session_id: str, kind: str, reason: str,
                         wait: float = 120.0) -> RunResult | None:
        """Send the session's open workflow an ``interrupt`` or a ``cancel`` (``kind``) and wait (up to
        ``wait`` seconds) for the stop it makes: the parent's call of a child was cut (interrupt) or
        the parent was cancelled (cancel). ``None``: no workflow of the session is open."""
        handle = self.handle(session_id)
        if not await self._open(handle):
            return None
        try:
            snap = await handle.query("snapshot")
        except RPCError:
            return None
        if kind == "interrupt" and snap.get("waiting"):
            return None  # stopped already: an interrupt changes nothing
        segment = int(snap.get("segment") or 0)
        await handle.signal("control", args=[kind, reason])
        try:
            return await asyncio.wait_for(self._result(agent, handle, segment), wait)
        except asyncio.TimeoutError:
            return None

    # -- controls, decisions, snapshot ----------------------------------------------------------------
    async def control(self, session_id: str, control: LoopControl) -> None:
        """Interrupt, Cancel, Steer, Followup, Restrict or RequestPermissions, as a signal to the session's
        workflow.

        Raises:
            ResumeError: no workflow of the session is open.
        """
        from ..permissions import control_text

        if isinstance(control, Restrict):
            kind, text = "restrict", control_text("restriction", control.restriction, control.reason)
        elif isinstance(control, RequestPermissions):
            kind, text = "request_permissions", control_text("permissions", control.permissions, control.reason)
        else:
            kind = {Steer: "steer", Followup: "followup", Interrupt: "interrupt", Cancel: "cancel"}[type(control)]
            text = str(getattr(control, "text", None) or getattr(control, "reason", ""))
        handle = self.handle(session_id)
        if not await self._open(handle):
            raise ResumeError(f"session {session_id} has no open workflow: it ended, or never started")
        await handle.signal("control", args=[kind, text])

    async def decide(self, session_id: str, call_id: str, decision: Decision) -> DecisionOutcome:
        """A person's decision on a pending call (an Update, validated before it is written: an unknown
        call, a kind the call does not allow and a conflicting second decision are refused; an
        identical repeat returns the first outcome). Once every pending call has one, the run
        resumes.

        Raises:
            ResumeError: the decision was refused (the message says why).
        """
        try:
            out: dict[str, Any] = await self.handle(session_id).execute_update(
                "decide", args=[call_id, unstructure(decision)])
        except WorkflowUpdateFailedError as exc:
            raise _resume_error(exc, session_id) from exc
        return DecisionOutcome(session_id, call_id, decision, 0, out.get("reason", ""), bool(out.get("replayed")),
                               live=False)

    async def snapshot(self, session_id: str) -> dict[str, Any]:
        """The session's state, stop, pending calls, usage and last seq (the workflow's query)."""
        out: dict[str, Any] = await self.handle(session_id).query("snapshot")
        return out


def _resume_error(exc: WorkflowUpdateFailedError, session_id: str) -> ResumeError:
    cause = exc.cause
    message = str(getattr(cause, "message", "") or cause or exc)
    if isinstance(cause, ApplicationError) and cause.type == "SessionBusyError":
        return SessionBusyError(message)
    return ResumeError(f"session {session_id}: {message}")
