"""MidTurn: the model's tool calls, through the tool-call ledger.

Per call, in the model's order:

1. **The ledger first.** A call the ledger has closed (completed, failed, rejected, responded,
   interrupted, not run) is never run again: its recorded result is used. A call the ledger
   says *started* but never finished (its worker died) is treated the same whatever was decided
   before: a ``side_effect`` call is settled by its tool's ``on_reconcile`` hook or put to a
   person (``unknown_outcome``); a ``pure`` or ``idempotent`` call runs again with the same
   idempotency key. A person's approval replayed from a checkpoint cannot run it twice.
2. **A person's decision** (given at resume, or in process with Hang-Wait): approve, edit,
   reject, respond. It is written to the ledger at once.
3. **Policy**: ``on_tool_call`` of each middleware (allow, deny, ask, edit, respond).

Calls to run get ``approved`` and then ``started`` (one durable write for the batch when any has
effects) before any of them starts, then run in parallel inside the composed ``wrap_tool_call``
chain; each result is written (``completed`` / ``failed``) as it arrives. When one call's chain
raises (``StopRun``, a fail-closed middleware), the other calls are cancelled and the driver
closes every open call (see :meth:`~fsm_agent.machine.driver.Driver._close_open_calls`). A call
whose tool raises :class:`~fsm_agent.errors.SuspendCall` gets no result: the others finish, and
the run stops with that call pending (its ledger entry stays ``started``): WAITING_HUMAN when a
tool raised :class:`~fsm_agent.errors.WaitForHuman`, else INTERRUPTED.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import TYPE_CHECKING, Any

import orjson
from attrs import evolve

from ..control import Decision
from ..errors import SuspendCall, ToolArgumentsError, WaitForHuman
from ..middleware import AskApproval, Deny, Edit, Respond
from ..store.base import ControlKind, LedgerEntry, LedgerStatus
from ..tools.execution import execute_tool_call, idempotency_key, result_blocks
from ..tools.registry import RUN_AGAIN, ToolContext, ToolEffect
from ..types.codec import structure, unstructure
from ..types.content import ToolUseBlock
from ..types.events import ApprovalRequested, ToolFinished, ToolProgress, ToolStarted, UsageRolledUp
from ..types.messages import ToolResultMessage, Usage
from ..types.run import PendingAction, StopReason
from .journal import ledger_entry
from .outcome import Move, Outcome, Stop
from .phases import Phase, Trigger

if TYPE_CHECKING:
    from .driver import Driver

log = logging.getLogger("fsm_agent.driver")

__all__ = ["RUN_ON_REJECT", "WAITING_CALLS", "MidTurn"]

WAITING_CALLS = "waiting_calls"
"""``RunState.metadata`` key: ids of the calls whose tool raised :class:`WaitForHuman` and wait for a
person's decision (a decision on one of them runs it again with the decision; a ``reject`` only
when the call is in :data:`RUN_ON_REJECT`)."""
RUN_ON_REJECT = "waiting_calls_run_on_reject"
"""``RunState.metadata`` key: the :data:`WAITING_CALLS` whose tool raised ``WaitForHuman(...,
run_on_reject=True)``: a ``reject`` runs them again too, instead of closing them."""


class MidTurn:
    """The MidTurn phase of one driver. ``started_ids``, ``settled`` and ``done`` describe the
    current MidTurn for the driver's clean-up when it stops early."""

    def __init__(self, driver: Driver) -> None:
        self.d = driver
        self.started_ids: set[str] = set()
        """Calls whose ``started`` state was recorded (in flight until their result arrives)."""
        self.settled: dict[str, ToolResultMessage] = {}
        """Every result known in this MidTurn (run, denied, answered, decided), by call id."""
        self.done: set[str] = set()
        """Calls that ran to a result in this MidTurn."""
        self.suspended: dict[str, SuspendCall] = {}
        """Calls whose tool raised :class:`SuspendCall` (or :class:`WaitForHuman`) in this MidTurn (no
        result), by call id."""
        self.sink = _RunSink(driver)
        """Where the tools' progress and usage reports go (the run's log, usage and observers)."""

    # -- ledger ---------------------------------------------------------------------------
    def effect(self, call: ToolUseBlock) -> ToolEffect:
        tool = self.d.ctx.tools.get(call.name)
        return tool.effect if tool is not None else ToolEffect.PURE

    def all_pure(self, calls: list[ToolUseBlock]) -> bool:
        return all(self.effect(c) is ToolEffect.PURE for c in calls)

    async def ledger(self, call: ToolUseBlock, status: LedgerStatus, result: ToolResultMessage | None = None,
                     *, durable: bool | None = None) -> None:
        """Record a ledger state. By default it is written at once for calls with effects (``idempotent``,
        ``side_effect``) and with the next commit for ``pure`` ones, which a crash can only make run again."""
        d = self.d
        run = d.run_state
        effect = self.effect(call)
        entry = ledger_entry(d.ctx.session_id, run.turn, call, status, effect=effect.value, result=result)
        d.ledger[call.id] = entry
        d._observe(call, status, result)
        j = d.journal
        if j is None:
            return
        j.record("tool_call", {"call_id": call.id, "tool": call.name, "status": status.value}, run.turn)
        await j.ledger(entry, durable=effect is not ToolEffect.PURE if durable is None else durable)

    def _tool_context(self, call_id: str, name: str, turn: int, decision: Decision | None = None) -> ToolContext:
        sid = self.d.ctx.session_id
        return ToolContext(call_id, idempotency_key(sid, call_id), sid, turn, name, self.sink, decision)

    async def _reconcile(self, call: ToolUseBlock) -> Any:
        """A side-effect call found started but unfinished: ask its tool what happened."""
        tool = self.d.ctx.tools.get(call.name)
        if tool is None or tool.reconcile is None:
            return None
        outcome = tool.reconcile(dict(call.input), self._tool_context(call.id, call.name, self.d.run_state.turn))
        if inspect.isawaitable(outcome):
            outcome = await outcome
        if outcome is None or outcome is RUN_AGAIN:
            return outcome
        return ToolResultMessage(call.id, result_blocks(outcome), name=call.name, metadata={"reconciled": True})

    def compensable(self, entry: LedgerEntry) -> bool:
        """Whether the tool of ``entry`` has an ``on_compensate`` hook."""
        tool = self.d.ctx.tools.get(entry.tool)
        return tool is not None and tool.compensate is not None

    async def compensate(self, entry: LedgerEntry, *, confirmed: bool = False) -> bool:
        """Run the tool's ``on_compensate`` for a call that happened (or may have); ``True`` when it was
        compensated (the ledger then says ``rejected``), ``False`` without a hook or when the hook
        returned ``False`` (nothing undone: the entry stays as it was). ``confirmed``: a person
        confirmed the cancel (the hook's ``ToolContext.decision`` is then ``approve``).

        Raises:
            WaitForHuman: the hook cannot undo the call before a person confirms the cancel (a
                sub-agent's cancel waits for its own confirmation); never when ``confirmed``.
        """
        d = self.d
        tool = d.ctx.tools.get(entry.tool)
        if tool is None or tool.compensate is None:
            return False
        ctx = self._tool_context(entry.call_id, entry.tool, entry.turn, Decision.approve() if confirmed else None)
        try:
            out = tool.compensate(entry.arguments, entry.result, ctx)
            if inspect.isawaitable(out):
                out = await out
        except WaitForHuman:
            if not confirmed:
                raise
            out = False  # asked again after the person confirmed: nothing more can be done
        if out is False:
            return False
        compensated = evolve(entry, status=LedgerStatus.REJECTED, updated_at=time.time())
        d.ledger[entry.call_id] = compensated
        if d.journal is not None:
            d.journal.record("compensated", {"call_id": entry.call_id, "tool": entry.tool,
                                             "was": entry.status.value}, d.run_state.turn)
            await d.journal.ledger(compensated)
        return True

    def decided(self, call: ToolUseBlock, decision: Decision
                ) -> tuple[ToolUseBlock | None, ToolResultMessage | None, LedgerStatus]:
        """Apply a person's decision: (call to run, or None), (result, or None), its ledger status."""
        kind = decision.kind
        if kind == "approve":
            return call, None, LedgerStatus.APPROVED
        if kind == "edit":
            edited = evolve(call, input=dict(decision.arguments or {}), raw_input=None)
            tool = self.d.ctx.tools.get(call.name)
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
        d = self.d
        ctx, run = d.ctx, d.run_state
        calls = list(run.pending_calls)
        if not calls and run.last_response is not None:
            calls = list(run.last_response.tool_calls)
            run.pending_calls = list(calls)
        results: dict[str, ToolResultMessage] = dict(run.decided_results)
        self.settled = results
        self.started_ids = set()
        self.done = set()
        self.suspended = {}
        to_run: list[ToolUseBlock] = []
        pending: list[PendingAction] = []
        approved: dict[str, Decision] = {}  # a person's decisions whose calls have not run yet
        waiting_ids = set(run.metadata.get(WAITING_CALLS) or ())  # calls whose tool raised WaitForHuman
        run_on_reject = set(run.metadata.get(RUN_ON_REJECT) or ())
        for call in calls:
            if call.id in results:
                continue
            entry = d.ledger.get(call.id)
            if entry is not None and entry.status.final and entry.result:
                results[call.id] = structure(entry.result, ToolResultMessage)  # never run twice
                run.decisions.pop(call.id, None)
                continue
            if entry is not None and entry.status is LedgerStatus.STARTED and call.id not in run.decisions:
                # Started, never finished (its worker died). Only a person's answer to this unknown outcome
                # (given at this resume; replayed approvals were dropped) may settle it otherwise.
                if self.effect(call) is ToolEffect.SIDE_EFFECT:
                    outcome = await self._reconcile(call)
                    if outcome is RUN_AGAIN:
                        to_run.append(call)
                    elif outcome is None:
                        pending.append(PendingAction(call, "unknown_outcome", ("approve", "reject", "respond")))
                    else:
                        await self.ledger(call, LedgerStatus.COMPLETED, outcome)
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
                        await self.ledger(call, status, res, durable=True)
                        results[call.id] = res
                        continue
                assert again is not None
                await self.ledger(again, LedgerStatus.APPROVED, durable=True)
                to_run.append(again)
                approved[call.id] = decision
                continue
            if decision is not None:  # a person's decision is written at once, whatever the tool
                run_call, res, status = self.decided(call, decision)
                if res is not None:
                    await self.ledger(call, status, res, durable=True)
                    results[call.id] = res
                elif run_call is not None:
                    await self.ledger(run_call, LedgerStatus.APPROVED, durable=True)
                    to_run.append(run_call)
                    approved[call.id] = decision
                continue
            decided, final, status, ask = await self._policy(call)
            if ask is not None:
                pending.append(PendingAction(decided, ask.reason, ask.allowed_decisions))
            elif final is not None:
                await self.ledger(call, status, final, durable=False)
                results[call.id] = final
            else:
                await self.ledger(decided, LedgerStatus.APPROVED, durable=False)
                to_run.append(decided)
        if pending and d.bus.wants(ApprovalRequested):
            await d.bus.emit(ApprovalRequested(ctx.session_id, run.turn, tuple(pending)))
        if pending and run.config.approval_timeout and d.journal is not None:
            pending, more = await self._hang_wait(pending)
            for call, run_call, res, status in more:
                if res is not None:
                    await self.ledger(call, status, res)
                    results[call.id] = res
                elif run_call is not None:
                    await self.ledger(run_call, LedgerStatus.APPROVED)
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
        if self.suspended:
            # the other calls have their results (in the ledger too); these stay open
            return self._suspended_stop(calls, results)
        announce = d.bus.wants(ToolFinished)
        for call in calls:
            res = results[call.id]
            if announce and call.id not in self.done:  # denied, answered by policy or a person
                await d.bus.emit(ToolFinished(ctx.session_id, run.turn, call, res, 0.0))
            d._append(res)
        run.pending_calls = []
        run.decided_results = {}
        run.metadata.pop(WAITING_CALLS, None)
        run.metadata.pop(RUN_ON_REJECT, None)
        return Move(Trigger.TOOLS_DONE, f"{len(calls)} tool result(s) recorded")

    def _suspended_stop(self, calls: list[ToolUseBlock], results: dict[str, ToolResultMessage]) -> Stop:
        """The stop of a MidTurn in which tools raised :class:`SuspendCall`: WAITING_HUMAN when one of
        them waits for a person (:class:`WaitForHuman`), else INTERRUPTED; those calls pending."""
        run = self.d.run_state
        human = sorted(cid for cid, w in self.suspended.items() if isinstance(w, WaitForHuman))
        run.metadata[WAITING_CALLS] = human
        run.metadata[RUN_ON_REJECT] = sorted(cid for cid, w in self.suspended.items()
                                             if isinstance(w, WaitForHuman) and w.run_on_reject)
        run.decided_results = dict(results)
        waiting = [(c, self.suspended[c.id]) for c in calls if c.id in self.suspended]
        payload: dict[str, Any] = {
            "pending_actions": tuple(PendingAction(c, w.reason, w.allowed_decisions) for c, w in waiting),
            "last_safe_point": Phase.MID_TURN.value}
        detail = "; ".join(f"{c.name}({c.id}): {w.detail}" for c, w in waiting)
        if human:
            payload["required_decision"] = "; ".join(w.detail for _, w in waiting if isinstance(w, WaitForHuman))
            return Stop(StopReason.WAITING_HUMAN, detail, payload)
        return Stop(StopReason.INTERRUPTED, f"{detail} (left open, to run again on resume)", payload)

    async def _policy(self, call: ToolUseBlock
                      ) -> tuple[ToolUseBlock, ToolResultMessage | None, LedgerStatus, AskApproval | None]:
        """The middleware's decisions on ``call``: (the call as edited, a final result or None, the
        ledger status of that result, an approval request or None)."""
        decided, final, status, ask = call, None, LedgerStatus.APPROVED, None
        for name, dec in await self.d.chain.tool_decisions(call, self.d.ctx):
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

    async def _execute(self, to_run: list[ToolUseBlock], results: dict[str, ToolResultMessage],
                       approved: dict[str, Decision]) -> None:
        """``started`` for every call (durably, in one write, when any has effects), then all in parallel.
        If one call's chain raises, the others are cancelled before the error goes on."""
        d = self.d
        for c in to_run:
            await self.ledger(c, LedgerStatus.STARTED, durable=False)
        if d.journal is not None and any(self.effect(c) is not ToolEffect.PURE for c in to_run):
            await d.journal.flush()
        # Only now can a tool begin: a stop that lands during the write above finds them not run
        # (a later ``not_run`` entry supersedes a ``started`` that did reach the store).
        self.started_ids.update(c.id for c in to_run)
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
        """Hang-Wait: wait in process (up to ``approval_timeout`` seconds) for decisions on the pending calls."""
        d = self.d
        deadline = time.monotonic() + (d.run_state.config.approval_timeout or 0)
        waiting = {p.call.id: p for p in pending}
        decided: list[Any] = []
        while waiting and time.monotonic() < deadline:
            for c in await d.take(ControlKind.DECISION):
                data = _decision_of(c.text)
                if data is None or data[0] not in waiting:
                    continue
                p = waiting.pop(data[0])
                run_call, res, status = self.decided(p.call, data[1])
                decided.append((p.call, run_call, res, status))
            if waiting:
                await asyncio.sleep(min(d.control_poll, max(0.0, deadline - time.monotonic())))
        return list(waiting.values()), decided

    async def _run_tool(self, call: ToolUseBlock, decision: Decision | None = None) -> ToolResultMessage | None:
        """Run one call through the chain and record its result; ``None`` when its tool raised
        :class:`SuspendCall` (nothing recorded: its ledger entry stays ``started``)."""
        d = self.d
        ctx, run = d.ctx, d.run_state
        run.tool_calls_made += 1
        run.tool_call_counts[call.name] = run.tool_call_counts.get(call.name, 0) + 1
        if d.bus.wants(ToolStarted):
            await d.bus.emit(ToolStarted(ctx.session_id, run.turn, call))
        started = time.monotonic()

        async def execute(c: ToolUseBlock) -> ToolResultMessage:
            self.sink.loop = asyncio.get_running_loop()
            return await execute_tool_call(c, ctx.tools, session_id=ctx.session_id, turn=run.turn,
                                           timeout=run.config.tool_timeout, sink=self.sink, decision=decision)

        try:
            result = await d.chain.tool_call(call, ctx, execute)
        except SuspendCall as wait:
            self.suspended[call.id] = wait
            return None
        await self.ledger(call, LedgerStatus.FAILED if result.is_error else LedgerStatus.COMPLETED, result)
        self.settled[call.id] = result
        self.done.add(call.id)
        if d.bus.wants(ToolFinished):
            await d.bus.emit(ToolFinished(ctx.session_id, run.turn, call, result, time.monotonic() - started))
        return result


class _RunSink:
    """A :class:`~fsm_agent.tools.registry.ToolSink` into the run: each report is logged in the session
    and delivered to observers; usage is added to the run's (so budgets count it). Reports may come
    from a tool's worker thread: they are handed to the event loop."""

    __slots__ = ("d", "loop", "tasks")

    def __init__(self, driver: Driver) -> None:
        self.d = driver
        self.loop: asyncio.AbstractEventLoop | None = None
        """The run's event loop (taken when the first call runs)."""
        self.tasks: set[asyncio.Task[None]] = set()

    def _deliver(self, event: ToolProgress | UsageRolledUp) -> None:
        d = self.d
        if d.journal is not None:
            d.journal.record(event.TAG, unstructure(event), event.turn)
        if isinstance(event, UsageRolledUp):
            run = d.run_state
            run.usage = run.usage + event.usage
            if run.cost_usd is not None:
                run.cost_usd = None if event.cost_usd is None else run.cost_usd + event.cost_usd
                if run.cost_usd is None and run.config.max_cost_usd is not None:
                    who = f"session {event.child_session_id}" if event.child_session_id else f"call {event.call_id}"
                    note = (f"the cost budget (${run.config.max_cost_usd:g}) cannot be enforced from now on: the "
                            f"cost of {who} (tool {event.tool!r}) is unknown (a model without a known price; "
                            "fsm_agent.pricing.register_price adds one); the other budgets still apply")
                    log.warning("session %s: %s", d.ctx.session_id, note)
                    if d.journal is not None:
                        d.journal.record("warning", {"kind": "cost_unknown", "tool": event.tool,
                                                     "child_session_id": event.child_session_id, "message": note},
                                         event.turn)
        if d.bus.wants(type(event)):
            task = asyncio.ensure_future(d.bus.emit(event))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _hand_over(self, event: ToolProgress | UsageRolledUp) -> None:
        loop = self.loop
        try:
            if loop is None or loop.is_closed():
                return
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                self._deliver(event)
            else:
                loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # the loop closed meanwhile: the report has nowhere to go
            pass

    def progress(self, ctx: ToolContext, progress: float, total: float | None, message: str | None) -> None:
        self._hand_over(ToolProgress(ctx.session_id, ctx.turn, ctx.call_id, ctx.tool_name, progress, total,
                                     None if message is None else str(message)[:2000]))

    def usage(self, ctx: ToolContext, usage: Usage, cost_usd: float | None, child_session_id: str | None) -> None:
        self._hand_over(UsageRolledUp(ctx.session_id, ctx.turn, ctx.call_id, ctx.tool_name, usage, cost_usd,
                                      child_session_id))

    def budget_left(self) -> dict[str, float]:
        run = self.d.run_state
        cfg = run.config
        left: dict[str, float] = {}
        if cfg.max_tokens is not None:
            left["max_tokens"] = cfg.max_tokens - run.usage.total_tokens
        if cfg.max_cost_usd is not None and run.cost_usd is not None:
            left["max_cost_usd"] = cfg.max_cost_usd - run.cost_usd
        return left


def _decision_of(text: str) -> tuple[str, Decision] | None:
    try:
        data = orjson.loads(text)
        return data["call_id"], structure(data["decision"], Decision)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
