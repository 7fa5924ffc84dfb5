"""A session is a workflow: the loop, the machine and the middleware chain run inside it.

The workflow's id is the session's id. It drives run segments (a start, then each resume) through
the same :class:`~fsm_agent.Agent` methods as in process, on a
:class:`~fsm_agent.temporal.port.WorkflowPort`: every effect is an activity, or comes from the
workflow's deterministic sources.

* A terminal stop (COMPLETED, FAILED_TERMINAL, CANCELLED) ends the workflow with the typed
  :class:`~fsm_agent.types.RunStop` (and the segment's result) as its result.
* A resumable stop (WAITING_HUMAN, PAUSED_BUDGET, INTERRUPTED, FAILED_RETRYABLE) is a durable wait:
  nothing runs until a decision, a resume or a control arrives, or the configured wait times out
  (the workflow then ends with that stop; the store still holds the session, and a later resume
  starts a new workflow from it).
* A decision is the ``decide`` Update, validated before anything is written to the history: an
  unknown call, a kind the call does not allow and a conflicting second decision are refused; an
  identical repeat returns the first outcome. Once every pending call has its decision, the run
  resumes.
* ``resume`` (decisions, raised limits, a confirmed cancel) is an Update that returns the next
  segment's result. Interrupt, Cancel, Steer and Followup are the ``control`` signal. The snapshot is
  the ``snapshot`` query.
* A long session continues as new before its history nears Temporal's limits: at the next PreTurn
  the run stops (an Interrupt the workflow sends itself, logged as such) and a new run of the
  workflow resumes it from the store, carrying nothing but the session's id.

Every outcome of a run is a result of the workflow, never a failed workflow task: the engine turns
everything that happens during a run into a StopReason, and what escapes it (a replay divergence,
a lost lease) fails the workflow itself (``workflow_failure_exception_types``), never its task.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from attrs import evolve
from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from ..agent import _check_decisions
    from ..store.decisions import Question, check_decision
    from ..config import RunConfig
    from ..control import Decision
    from ..errors import PayloadTooLargeError, ResumeError
    from ..hooks import observers_muted
    from ..otel import tracing_muted
    from ..store.base import ControlKind, ControlRecord, WriteBatch
    from ..types.codec import structure, unstructure
    from ..types.messages import Message
    from ..types.run import RunResult, RunStop, StopReason
    from .activities import loaded
    from .mirror import MirrorStore
    from .port import Timeouts, WorkflowPort
    from .registry import agent_named

__all__ = ["CONTINUE_AS_NEW_TEXT", "SessionWorkflow"]

CONTINUE_AS_NEW_TEXT = "continuing as a new workflow run (the history is long)"
"""The text of the Interrupt a workflow sends itself before it continues as new."""

_KINDS = {"restrict": ControlKind.RESTRICT, "request_permissions": ControlKind.REQUEST_PERMISSIONS,
          "interrupt": ControlKind.INTERRUPT, "cancel": ControlKind.CANCEL, "steer": ControlKind.STEER,
          "followup": ControlKind.FOLLOWUP}


@workflow.defn(name="fsm_agent.Session")
class SessionWorkflow:
    """One session (see the module doc). Input: ``{"agent", "session_id", "op": "run" | "resume",
    "task", "config", "metadata", "limits", "decisions", "confirm_cancel", "timeouts", "human_wait_s",
    "history_limit"}``."""

    def __init__(self) -> None:
        self.port: WorkflowPort | None = None
        self.requests: list[dict[str, Any]] = []
        self.results: list[dict[str, Any]] = []
        self.continuing = False
        self.base = 0
        """Segments run by earlier runs of this workflow (before a continue-as-new)."""
        self.stop: RunStop | None = None
        self.waiting = False
        self.running = False
        self.decided: dict[str, dict[str, Any]] = {}
        """Decisions the ``decide`` update took for the current wait, by call id (their outcomes)."""
        self.taken: dict[str, dict[str, Any]] = {}
        """Every decision the ``decide`` update took in this workflow run, by call id (the last one):
        an identical repeat returns its outcome, even after the run resumed."""
        self.session_id = ""
        self.agent = ""

    # -- the run -------------------------------------------------------------------------------------
    @workflow.run
    async def run(self, start: dict[str, Any]) -> dict[str, Any]:
        observers_muted.set(workflow.unsafe.is_replaying)
        tracing_muted.set(True)  # the workflow is replayed: its effects are traced in their activities
        agent = agent_named(start["agent"])
        self.agent = start["agent"]
        self.session_id = start["session_id"]
        self.base = int(start.get("segments") or 0)
        store = MirrorStore(lambda: workflow.now().timestamp())
        history_limit = int(start.get("history_limit") or 20_000)
        self.port = port = WorkflowPort(start["agent"], store, Timeouts(**(start.get("timeouts") or {})),
                                        history_limit=history_limit, continue_text=CONTINUE_AS_NEW_TEXT)
        human_wait = start.get("human_wait_s")
        request = dict(start)
        if start["op"] != "run":
            data = await workflow.execute_activity(
                "fsm_agent.load_session", {"agent": start["agent"], "session_id": self.session_id},
                start_to_close_timeout=timedelta(seconds=60))
            if data is None:
                return self._final(None, f"unknown session {self.session_id!r}")
            store.seed(*loaded(data))
            rec = store.record
            assert rec is not None
            self.stop = structure(rec.stop, RunStop) if rec.stop else None
        while True:
            result = await self._segment(agent, request)
            try:
                await port.flush()
            except PayloadTooLargeError as exc:
                result = await self._unstorable(port, result, exc)
                self.stop = result.stop
                self.results.append(self._result_form(result))
                await workflow.wait_condition(workflow.all_handlers_finished)
                return self._final(result)
            stop = self.stop = result.stop
            if port.continue_asked and stop.reason is StopReason.INTERRUPTED and stop.detail == CONTINUE_AS_NEW_TEXT:
                # The self-interrupt is not a segment a caller waits for: the new run's first segment
                # takes its number, and a waiting wait_stop is told to ask the new run.
                self.continuing = True
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new({**start, "op": "resume", "decisions": {}, "limits": {},
                                          "confirm_cancel": False, "segments": self.base + len(self.results)})
            self.results.append(self._result_form(result))
            if not stop.resumable:
                await workflow.wait_condition(workflow.all_handlers_finished)
                return self._final(result)
            self.waiting, self.decided = True, {}
            try:
                await workflow.wait_condition(lambda: bool(self.requests),
                                              timeout=timedelta(seconds=human_wait) if human_wait else None)
            except asyncio.TimeoutError:
                await workflow.wait_condition(workflow.all_handlers_finished)
                return self._final(result)  # the wait ran out: the session stays resumable in the store
            finally:
                self.waiting = False
            request = self.requests.pop(0)

    async def _segment(self, agent: Any, request: dict[str, Any]) -> RunResult:
        assert self.port is not None
        port = self.port
        self.running = True
        limits = dict(request.get("limits") or {})
        try:
            if request["op"] == "run":
                messages = structure(request["task"], list[Message])
                config = structure(request["config"], RunConfig) if request.get("config") else None
                return await agent.run(messages, session_id=self.session_id, config=config,
                                       metadata=request.get("metadata"), port=lambda live: port,
                                       **limits)
            decisions = {k: structure(v, Decision) for k, v in (request.get("decisions") or {}).items()}
            return await agent.resume(self.session_id, decisions=decisions,
                                      confirm_cancel=bool(request.get("confirm_cancel")),
                                      port=lambda live: port, **limits)
        finally:
            self.running = False

    # -- results -----------------------------------------------------------------------------------------
    async def _unstorable(self, port: WorkflowPort, result: RunResult, exc: PayloadTooLargeError) -> RunResult:
        """One of the segment's writes is over the payload limit (a checkpoint of a long transcript, a
        large tool result): the writes before it are stored, it and the ones after it cannot be. The run
        ends FAILED_TERMINAL with error kind ``payload_too_large``, which a small write stores with the
        session (so the store, the review page and ``sessions show`` say why), and the caller gets the
        same stop. The session's events and checkpoint stay as of the last write that was stored."""
        dropped = len(port.store.pending)
        port.store.pending.clear()
        stop = RunStop(StopReason.FAILED_TERMINAL,
                       f"the session's state can no longer be stored through the durable host: {exc}; its last "
                       f"{dropped} write(s) were not stored (the session stays as of the write before them)",
                       error={"kind": "payload_too_large", "message": str(exc), "what": exc.what, "size": exc.size,
                              "limit": exc.limit, "writes_not_stored": dropped})
        await port.store.write(WriteBatch(self.session_id, state=StopReason.FAILED_TERMINAL.value,
                                          stop=unstructure(stop)))
        await port.flush()
        return evolve(result, stop=stop)

    @staticmethod
    def _result_form(result: RunResult) -> dict[str, Any]:
        data: dict[str, Any] = unstructure(result)
        data["messages"] = []  # the transcript stays in the store: not carried through the history
        return data

    def _final(self, result: RunResult | None, error: str = "") -> dict[str, Any]:
        if result is None:
            return {"stop": None, "result": None, "error": error}
        return {"stop": unstructure(result.stop), "result": self._result_form(result), "error": ""}

    # -- updates, signals, query ------------------------------------------------------------------------
    @workflow.update(name="resume")
    async def resume(self, req: dict[str, Any]) -> int:
        """Resume the stopped run (decisions, raised limits, a confirmed cancel); returns the number of
        the segment it starts (wait for its result with ``wait_stop``)."""
        if not self.waiting or self.requests:
            raise ApplicationError(f"session {self.session_id} is being driven (its run has not stopped yet); "
                                   "interrupt it or wait", type="SessionBusyError", non_retryable=True)
        self.requests.append({"op": "resume", **req})
        return self.base + len(self.results)

    @resume.validator
    def _check_resume(self, req: dict[str, Any]) -> None:
        if not self.waiting:
            raise ResumeError(f"session {self.session_id} is being driven (its run has not stopped yet); interrupt it "
                              "or wait")
        decisions = {k: structure(v, Decision) for k, v in (req.get("decisions") or {}).items()}
        if decisions:
            _check_decisions(unstructure(self.stop) if self.stop else None, decisions)

    @workflow.update(name="wait_stop")
    async def wait_stop(self, segment: int) -> dict[str, Any]:
        """The result of segment number ``segment`` (0 is the start), once it stopped."""
        await workflow.wait_condition(lambda: self.continuing or self.base + len(self.results) > segment)
        if self.base + len(self.results) <= segment:
            return {"continued": True}  # this run continues as new: ask the new one
        i = segment - self.base
        return self.results[i] if i >= 0 else {"stop": unstructure(self.stop) if self.stop else None,
                                               "earlier": True}

    @workflow.update(name="decide")
    async def decide(self, call_id: str, decision: dict[str, Any]) -> dict[str, Any]:
        """A person's decision on one pending call; once every pending call has one, the run resumes.
        Returns the outcome (``accepted``, and ``resumed`` when this decision resumed the run)."""
        first = self.decided.get(call_id) or self.taken.get(call_id)
        if first is not None and first["decision"] == decision:
            return {**first, "replayed": True}
        reason = next((p.reason for p in self.stop.pending_actions if p.call.id == call_id), "") if self.stop else ""
        outcome = {"session_id": self.session_id, "call_id": call_id, "decision": decision, "status": "accepted",
                   "reason": reason}
        self.decided[call_id] = self.taken[call_id] = outcome
        pending = [p["call"]["id"] for p in (unstructure(self.stop) or {}).get("pending_actions") or ()]
        if all(cid in self.decided for cid in pending) and self.waiting and not self.requests:
            self.requests.append({"op": "resume", "decisions": {k: v["decision"] for k, v in self.decided.items()}})
            outcome["resumed"] = True
        return outcome

    @decide.validator
    def _check_decide(self, call_id: str, decision: dict[str, Any]) -> None:
        taken = self.taken.get(call_id)
        if taken is not None and (call_id not in self.decided or not self.waiting):
            if taken["decision"] == decision:
                return  # an identical repeat: its first outcome is returned
            raise ResumeError(f"tool call {call_id!r} was already decided ({taken['decision'].get('kind')}); "
                              "a different decision is refused")
        if not self.waiting or self.stop is None or self.stop.reason is not StopReason.WAITING_HUMAN:
            raise ResumeError(f"session {self.session_id} does not wait for a decision")
        d = structure(decision, Decision)
        pending = {p.call.id: unstructure(p) for p in self.stop.pending_actions}
        # the one check of a decision (fsm_agent.store.decisions): unknown call, kind, edited arguments
        check_decision(Question(self.session_id, StopReason.WAITING_HUMAN.value, pending), call_id, d,
                       tools=agent_named(self.agent).tools)
        first = self.decided.get(call_id)
        if first is not None and first["decision"] != decision:
            raise ResumeError(f"tool call {call_id!r} was already decided ({first['decision'].get('kind')}); "
                              "a different decision is refused")

    @workflow.signal(name="control")
    def control(self, kind: str, text: str = "") -> None:
        """Interrupt, Cancel, Steer, Followup, Restrict or RequestPermissions. A Cancel, Steer or Followup
        sent while the run waits resumes it, so that it applies (an Interrupt of a stopped run changes
        nothing); a change of permissions waits for the next resume."""
        port = self.port
        k = _KINDS.get(kind)
        if port is None or k is None:
            return
        record = ControlRecord(self.session_id, k, text, workflow.uuid4().hex, workflow.now().timestamp())
        if self.running:
            port.control_arrived(record)
        elif self.waiting and k is not ControlKind.INTERRUPT:
            port.store.controls.append(record)
            if not self.requests and k not in (ControlKind.RESTRICT, ControlKind.REQUEST_PERMISSIONS):
                self.requests.append({"op": "resume"})

    @workflow.query(name="snapshot")
    def snapshot(self) -> dict[str, Any]:
        """The session now: state, stop, pending calls, usage, last seq, results so far."""
        store = self.port.store if self.port is not None else None
        rec = store.record if store is not None else None
        last = self.results[-1] if self.results else None
        return {"session_id": self.session_id, "state": rec.state if rec is not None else "Idle",
                "segment": self.base + len(self.results),
                "stop": unstructure(self.stop) if self.stop else None,
                "pending": list((unstructure(self.stop) or {}).get("pending_actions") or ()) if self.waiting else [],
                "usage": last["usage"] if last else None, "last_seq": rec.last_seq if rec is not None else 0,
                "waiting": self.waiting, "running": self.running, "segments": len(self.results)}
