"""MidTurn: the model's tool calls, through the tool-call ledger.

Per call, in the model's order:

1. **The ledger first.** A call the ledger has closed (completed, failed, rejected, responded,
   interrupted, not run) is never run again: its recorded result is used. A call the ledger
   says *started* but never finished (its worker died) is treated the same whatever was decided
   before: a ``side_effect`` call is settled by its tool's ``on_reconcile`` hook or put to a
   person (``unknown_outcome``); a ``pure`` or ``idempotent`` call runs again with the same
   idempotency key. A person's approval replayed from a checkpoint cannot run it twice.
2. **A person's decision** (given at resume, or in process with Hang-Wait): approve, edit,
   reject, respond. It is written to the ledger at once. Hang-Wait logs the question
   (``decisions_awaited``), reads the answers through the one reader of decisions
   (:func:`fsm_agent.store.decisions.read_decisions`, on the port's store) and logs what it took
   (``decisions_taken``); a ``decision`` control is only a wake-up.
3. **Loop detection** (:mod:`.loops`, ``RunConfig.loop_detection`` with ``then`` ``block`` or
   ``stop``): a call that goes on with a loop the model was warned of is denied, or ends the run.
4. **Policy**: ``on_tool_call`` of each middleware (allow, deny, ask, edit, respond).

Before any of this, queued ``restrict`` controls narrow the session's permissions, and every call
about to run is checked against them (:class:`~.gate.PermissionGate`): before the policy (no
plugin sees a call outside them), after a plugin's edit, and before a person's approval or edit
runs it. A call outside them is denied (ledger ``rejected``, event ``permission_denied``).

Calls to run get ``approved`` and then ``started`` (one durable write for the batch when any has
effects) before any of them starts, then run in parallel inside the composed ``wrap_tool_call``
chain; each result is written (``completed`` / ``failed``) as it arrives. When one call's chain
raises (``StopRun``, a fail-closed middleware), the other calls are cancelled and every open call
is closed (:meth:`~fsm_agent.machine.controls.Controls.close_open_calls`). A call
whose tool raises :class:`~fsm_agent.errors.SuspendCall` gets no result: the others finish, and
the run stops with that call pending (its ledger entry stays ``started``): WAITING_HUMAN when a
tool raised :class:`~fsm_agent.errors.WaitForHuman`, else INTERRUPTED.

Tools run through the port (:meth:`~fsm_agent.machine.port.EffectPort.run_tool`), their recovery
hooks through the ledger (:class:`~fsm_agent.machine.ledger.ToolLedger`); a replay gives each call
its recorded result.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from attrs import evolve

from ..control import Decision
from ..errors import OutcomeUnknown, SuspendCall, ToolArgumentsError, WaitForHuman
from ..loops import Loop
from ..middleware import AskApproval, Deny, Edit, Respond
from ..store.base import ControlKind, LedgerStatus
from ..store.decisions import DECISIONS_AWAITED, DECISIONS_TAKEN, read_decisions
from ..tools.registry import RUN_AGAIN, ToolEffect
from ..types.codec import structure, unstructure
from ..types.content import ToolUseBlock
from ..types.events import (ApprovalRequested, PolicyDecision, ToolFinished, ToolProgress, ToolStarted,
                            UsageRolledUp)
from ..types.messages import ToolResultMessage
from ..types.run import PendingAction, StopReason
from .gate import PermissionGate
from .host import Host
from .loops import LoopWatch
from .outcome import Move, Outcome, Stop
from .phases import Phase, Trigger

__all__ = ["RUN_ON_REJECT", "WAITING_CALLS", "MidTurn"]

WAITING_CALLS = "waiting_calls"
"""``RunState.metadata`` key: ids of the calls whose tool raised :class:`WaitForHuman` and wait for a
person's decision (a decision on one of them runs it again with the decision; a ``reject`` only
when the call is in :data:`RUN_ON_REJECT`)."""
RUN_ON_REJECT = "waiting_calls_run_on_reject"
"""``RunState.metadata`` key: the :data:`WAITING_CALLS` whose tool raised ``WaitForHuman(...,
run_on_reject=True)``: a ``reject`` runs them again too, instead of closing them."""


_DECISION_KINDS: dict[type, str] = {Deny: "deny", AskApproval: "ask", Edit: "edit", Respond: "respond"}
"""The :class:`PolicyDecision` name of each tool decision."""


class MidTurn:
    """The MidTurn phase (see the module doc). What is under way (calls started, settled, done,
    suspended) is kept in the host's :class:`~.host.InFlight`, for the controls that may cut it."""

    __slots__ = ("h", "_observing", "gate", "loops", "_looping")

    def __init__(self, host: Host) -> None:
        self.h = host
        self._observing: set[asyncio.Task[None]] = set()
        self.gate = PermissionGate(host)
        self.loops = LoopWatch(host)
        self._looping: dict[str, Loop] = {}
        """The calls of the current MidTurn that go on with a loop (:meth:`LoopWatch.continuing`)."""

    async def _refused(self, call: ToolUseBlock, to_run: ToolUseBlock, results: dict[str, ToolResultMessage]) -> bool:
        """``to_run`` (``call`` as decided) is outside the session's permissions: record its denial."""
        denied = self.gate.denied(to_run)
        if denied is None:
            return False
        await self.h.ledger.record(call, LedgerStatus.REJECTED, denied, durable=True)
        results[call.id] = denied
        return True

    def decided(self, call: ToolUseBlock, decision: Decision
                ) -> tuple[ToolUseBlock | None, ToolResultMessage | None, LedgerStatus]:
        """Apply a person's decision: (call to run, or None), (result, or None), its ledger status."""
        kind = decision.kind
        if kind == "approve":
            return call, None, LedgerStatus.APPROVED
        if kind == "edit":
            edited = evolve(call, input=dict(decision.arguments or {}), raw_input=None)
            tool = self.h.view.tools.get(call.name)
            if tool is not None:
                try:
                    tool.validate(edited.input)
                except ToolArgumentsError as exc:
                    return None, ToolResultMessage(call.id, f"The edited arguments were invalid: {exc}", is_error=True,
                                                   name=call.name, metadata={"decision": "edit"}), LedgerStatus.REJECTED
            return edited, None, LedgerStatus.APPROVED
        if kind == "reject":
            return None, ToolResultMessage(call.id, f"A person rejected this tool call: {decision.message}",
                                           is_error=True, name=call.name,
                                           metadata={"decision": "reject"}), LedgerStatus.REJECTED
        return None, ToolResultMessage(call.id, decision.message, is_error=decision.is_error, name=call.name,
                                       metadata={"decision": "respond"}), LedgerStatus.RESPONDED

    # -- the phase ------------------------------------------------------------------------
    async def run(self) -> Outcome:
        h = self.h
        ctx, run, fl = h.view, h.run_state, h.inflight
        await self.gate.take_restrictions()
        calls = list(run.pending_calls)
        if not calls and run.last_response is not None:
            calls = list(run.last_response.tool_calls)
            run.pending_calls = list(calls)
        results: dict[str, ToolResultMessage] = dict(run.decided_results)
        fl.new_tools()
        fl.settled = results
        self._looping = self.loops.continuing(calls)
        to_run: list[ToolUseBlock] = []
        pending: list[PendingAction] = []
        approved: dict[str, Decision] = {}  # a person's decisions whose calls have not run yet
        waiting_ids = set(run.metadata.get(WAITING_CALLS) or ())  # calls whose tool raised WaitForHuman
        run_on_reject = set(run.metadata.get(RUN_ON_REJECT) or ())
        for call in calls:
            if call.id in results:
                continue
            entry = h.ledger.get(call.id)
            if entry is not None and entry.status.final and entry.result:
                results[call.id] = structure(entry.result, ToolResultMessage)  # never run twice
                run.decisions.pop(call.id, None)
                continue
            if entry is not None and entry.status is LedgerStatus.STARTED and call.id not in run.decisions:
                # Started, never finished (its worker died). Only a person's answer to this unknown outcome
                # (given at this resume; replayed approvals were dropped) may settle it otherwise.
                if h.ledger.effect(call) is ToolEffect.SIDE_EFFECT:
                    outcome = await h.ledger.reconcile(call)
                    if outcome is RUN_AGAIN:
                        to_run.append(call)
                    elif outcome is None:
                        pending.append(PendingAction(call, "unknown_outcome", ("approve", "reject", "respond")))
                    else:
                        await h.ledger.record(call, LedgerStatus.COMPLETED, outcome)
                        results[call.id] = outcome
                    continue
                to_run.append(call)  # pure / idempotent: running again is safe (same idempotency key)
                continue
            decision = run.decisions.pop(call.id, None)
            if decision is not None and call.id in waiting_ids and (
                    decision.kind != "reject" or call.id in run_on_reject):
                # the answer to the tool's own question: the tool runs again and reads it (ToolContext.decision)
                again: ToolUseBlock | None = call
                if decision.kind == "edit":
                    again, res, status = self.decided(call, decision)
                    if again is None:
                        assert res is not None
                        await h.ledger.record(call, status, res, durable=True)
                        results[call.id] = res
                        continue
                assert again is not None
                if await self._refused(call, again, results):
                    continue
                await h.ledger.record(again, LedgerStatus.APPROVED, durable=True)
                to_run.append(again)
                approved[call.id] = decision
                continue
            if decision is not None:  # a person's decision is written at once, whatever the tool
                run_call, res, status = self.decided(call, decision)
                if res is not None:
                    await h.ledger.record(call, status, res, durable=True)
                    results[call.id] = res
                elif run_call is not None and not await self._refused(call, run_call, results):
                    await h.ledger.record(run_call, LedgerStatus.APPROVED, durable=True)
                    to_run.append(run_call)
                    approved[call.id] = decision
                continue
            decided, final, status, ask = await self._policy(call)
            if ask is not None:
                pending.append(PendingAction(decided, ask.reason, ask.allowed_decisions))
            elif final is not None:
                await h.ledger.record(call, status, final, durable=False)
                results[call.id] = final
            else:
                await h.ledger.record(decided, LedgerStatus.APPROVED, durable=False)
                to_run.append(decided)
        if pending and h.bus.wants(ApprovalRequested):
            await h.bus.emit(ApprovalRequested(ctx.session_id, run.turn, tuple(pending)))
        if pending and run.config.approval_timeout and h.journal is not None:
            pending, more = await self._hang_wait(pending)
            for call, run_call, res, status in more:
                if res is not None:
                    await h.ledger.record(call, status, res)
                    results[call.id] = res
                elif run_call is not None and not await self._refused(call, run_call, results):
                    await h.ledger.record(run_call, LedgerStatus.APPROVED)
                    to_run.append(run_call)
        if pending:
            run.decided_results = dict(results)
            run.decisions.update(approved)  # nothing of this turn runs now: keep them for the next resume
            unknown = [p for p in pending if p.reason == "unknown_outcome"]
            what = ("the outcome of side-effect call(s) is unknown after a crash: "
                    + ", ".join(f"{p.call.name}({p.call.id})" for p in unknown) + "; "
                    "respond with its result, approve to run it again, or reject") if unknown else (
                f"{len(pending)} tool call(s) need approval: " + ", ".join(p.call.name for p in pending))
            return Stop(StopReason.WAITING_HUMAN, what,
                        {"pending_actions": tuple(pending),
                         "required_decision": "approve, edit, reject or respond to each pending tool call",
                         "last_safe_point": Phase.MID_TURN.value})
        if to_run:
            await self._execute(to_run, results, approved)
        if fl.suspended:
            # the other calls have their results (in the ledger too); these stay open
            return self._suspended_stop(calls, results)
        announce = h.bus.wants(ToolFinished)
        for call in calls:
            res = results[call.id]
            if announce and call.id not in fl.done:  # denied, answered by policy or a person
                await h.bus.emit(ToolFinished(ctx.session_id, run.turn, call, res, 0.0))
            h.append(res)
        run.pending_calls = []
        run.decided_results = {}
        run.metadata.pop(WAITING_CALLS, None)
        run.metadata.pop(RUN_ON_REJECT, None)
        return Move(Trigger.TOOLS_DONE, f"{len(calls)} tool result(s) recorded")

    def _suspended_stop(self, calls: list[ToolUseBlock], results: dict[str, ToolResultMessage]) -> Stop:
        """The stop of a MidTurn in which tools raised :class:`SuspendCall`: WAITING_HUMAN when one of
        them waits for a person (:class:`WaitForHuman`), else INTERRUPTED; those calls pending."""
        run, suspended = self.h.run_state, self.h.inflight.suspended
        human = sorted(cid for cid, w in suspended.items() if isinstance(w, (WaitForHuman, OutcomeUnknown)))
        # a decision on a lost call is an ordinary one (approve runs it again): not a tool's own question
        run.metadata[WAITING_CALLS] = [cid for cid in human if not isinstance(suspended[cid], OutcomeUnknown)]
        run.metadata[RUN_ON_REJECT] = sorted(cid for cid, w in suspended.items()
                                             if isinstance(w, WaitForHuman) and w.run_on_reject)
        run.decided_results = dict(results)
        waiting = [(c, suspended[c.id]) for c in calls if c.id in suspended]
        payload: dict[str, Any] = {
            "pending_actions": tuple(PendingAction(c, w.reason, w.allowed_decisions) for c, w in waiting),
            "last_safe_point": Phase.MID_TURN.value}
        detail = "; ".join(f"{c.name}({c.id}): {w.detail}" for c, w in waiting)
        if human:
            payload["required_decision"] = "; ".join(w.detail for _, w in waiting
                                                     if isinstance(w, (WaitForHuman, OutcomeUnknown)))
            return Stop(StopReason.WAITING_HUMAN, detail, payload)
        return Stop(StopReason.INTERRUPTED, f"{detail} (left open, to run again on resume)", payload)

    async def _policy(self, call: ToolUseBlock
                      ) -> tuple[ToolUseBlock, ToolResultMessage | None, LedgerStatus, AskApproval | None]:
        """The middleware's decisions on ``call``: (the call as edited, a final result or None, the
        ledger status of that result, an approval request or None). A call outside the session's
        permissions is denied before any plugin sees it, and an edit cannot take it outside them."""
        denied = self.gate.denied(call)
        if denied is not None:
            return call, denied, LedgerStatus.REJECTED, None
        loop = self._looping.get(call.id)
        if loop is not None:  # it goes on with a loop the model was warned of: not run (or the run stops)
            return call, await self.loops.refuse(call, loop), LedgerStatus.REJECTED, None
        decided, final, status, ask = await self._plugins_on(call)
        if final is None and decided is not call:
            denied = self.gate.denied(decided)
            if denied is not None:
                return decided, denied, LedgerStatus.REJECTED, None
        return decided, final, status, ask

    async def _plugins_on(self, call: ToolUseBlock
                          ) -> tuple[ToolUseBlock, ToolResultMessage | None, LedgerStatus, AskApproval | None]:
        """The middleware's ``on_tool_call`` decisions on ``call`` (see :meth:`_policy`)."""
        decided, final, status, ask = call, None, LedgerStatus.APPROVED, None
        decisions = await self.h.chain.tool_decisions(call, self.h.view)
        if decisions and self.h.bus.wants(PolicyDecision):
            await self._announce(call, decisions)
        for name, dec in decisions:
            if isinstance(dec, Edit):
                decided = evolve(decided, input=dict(dec.arguments), raw_input=None)
            elif isinstance(dec, Deny):
                final = ToolResultMessage(call.id, f"Tool call denied by policy ({name}): {dec.reason}",
                                          is_error=True, name=call.name, metadata={"denied_by": name})
                status = LedgerStatus.REJECTED
            elif isinstance(dec, Respond):
                final = ToolResultMessage(call.id, dec.result, is_error=dec.is_error, name=call.name,
                                          metadata={"responded_by": name})
                status = LedgerStatus.RESPONDED
            elif isinstance(dec, AskApproval):
                ask = dec
        return decided, final, status, ask

    async def _announce(self, call: ToolUseBlock, decisions: list[tuple[str, Any]]) -> None:
        """Tell the observers who decided what on ``call`` (:class:`PolicyDecision`; ``Allow`` is no decision)."""
        h = self.h
        for name, dec in decisions:
            kind = _DECISION_KINDS.get(type(dec))
            if kind is not None:
                await h.bus.emit(PolicyDecision(h.session_id, h.run_state.turn, name, "on_tool_call", kind,
                                                str(getattr(dec, "reason", "")), call))

    async def _execute(self, to_run: list[ToolUseBlock], results: dict[str, ToolResultMessage],
                       approved: dict[str, Decision]) -> None:
        """``started`` for every call (durably, in one write, when any has effects), then all in parallel.
        If one call's chain raises, the others are cancelled before the error goes on."""
        h = self.h
        for c in to_run:
            await h.ledger.record(c, LedgerStatus.STARTED, durable=False)
        if h.journal is not None and not h.ledger.all_pure(to_run):
            await h.journal.flush()
        # Only now can a tool begin: a stop that lands during the write above finds them not run
        # (a later ``not_run`` entry supersedes a ``started`` that did reach the store).
        h.inflight.started_ids.update(c.id for c in to_run)
        tasks = [asyncio.ensure_future(self._run_tool(c, approved.get(c.id))) for c in to_run]
        try:
            for r in await asyncio.gather(*tasks):
                if r is not None:
                    results[r.tool_call_id] = r
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _hang_wait(self, pending: list[PendingAction]) -> tuple[list[PendingAction], list[Any]]:
        """Hang-Wait: wait in process (up to ``approval_timeout`` seconds) for decisions on the pending calls.

        The question goes into the log first (``decisions_awaited``, committed), so that the one
        writer of decisions (:func:`fsm_agent.store.decisions.write_decisions`) can check a
        decision against it from any process. The answers are read through the one reader, on the
        port's store; a ``decision`` control only wakes the wait up before its next look."""
        h = self.h
        port = h.port
        timeout = h.run_state.config.approval_timeout or 0
        deadline = port.monotonic() + timeout
        waiting = {p.call.id: p for p in pending}
        h.record(DECISIONS_AWAITED, {"pending_actions": [unstructure(p) for p in pending], "timeout": timeout})
        assert h.journal is not None
        await h.journal.flush()
        decided: list[Any] = []
        while waiting:
            answers = await read_decisions(port.store, h.session_id, waiting)
            if answers:
                h.record(DECISIONS_TAKEN, {"decisions": {cid: unstructure(d) for cid, d in answers.items()}})
                for cid, decision in answers.items():
                    p = waiting.pop(cid)
                    decided.append((p.call, *self.decided(p.call, decision)))
                continue
            left = deadline - port.monotonic()
            if left <= 0:
                break
            await h.take(ControlKind.DECISION, wait=left)  # a wake-up: a decision was written
        return list(waiting.values()), decided

    async def _run_tool(self, call: ToolUseBlock, decision: Decision | None = None) -> ToolResultMessage | None:
        """Run one call through the chain and record its result; ``None`` when its tool raised
        :class:`SuspendCall` (nothing recorded: its ledger entry stays ``started``)."""
        h = self.h
        ctx, run, fl = h.view, h.run_state, h.inflight
        run.tool_calls_made += 1
        run.tool_call_counts[call.name] = run.tool_call_counts.get(call.name, 0) + 1
        if h.bus.wants(ToolStarted):
            await h.bus.emit(ToolStarted(ctx.session_id, run.turn, call))
        started = time.monotonic()  # for the observers only: not an effect of the run

        async def execute(c: ToolUseBlock) -> ToolResultMessage:
            return await h.port.run_tool(c, ctx._tools, session_id=ctx.session_id, turn=run.turn,
                                         timeout=run.config.tool_timeout, decision=decision, report=self._report,
                                         budget_left=h.accounting.budget_left)

        try:
            result = await h.chain.tool_call(call, ctx, execute)
        except OutcomeUnknown as lost:
            # the worker running it was lost (a durable host): settled as a crash recovery settles it
            settled = await h.ledger.reconcile(call)
            if settled is RUN_AGAIN:
                try:
                    result = await h.chain.tool_call(call, ctx, execute)
                except SuspendCall as wait:
                    fl.suspended[call.id] = wait
                    return None
            elif settled is None:
                fl.suspended[call.id] = lost
                return None
            else:
                result = settled
        except SuspendCall as wait:
            fl.suspended[call.id] = wait
            return None
        await h.ledger.record(call, LedgerStatus.FAILED if result.is_error else LedgerStatus.COMPLETED, result)
        fl.settled[call.id] = result
        fl.done.add(call.id)
        if h.bus.wants(ToolFinished):
            await h.bus.emit(ToolFinished(ctx.session_id, run.turn, call, result, time.monotonic() - started))
        return result

    def _report(self, event: ToolProgress | UsageRolledUp) -> None:
        """A running tool reported progress or usage: logged in the session, usage added to the run
        (its budgets count it), then delivered to the observers (without waiting for them)."""
        h = self.h
        if h.journal is not None:
            h.journal.record(event.TAG, unstructure(event), event.turn)
        if isinstance(event, UsageRolledUp):
            h.accounting.rolled_up(event)
        if h.bus.wants(type(event)):
            task = asyncio.ensure_future(h.bus.emit(event))
            self._observing.add(task)
            task.add_done_callback(self._observing.discard)

