"""The loop: one explicit function that runs each phase and fires the trigger its outcome names.

The ``transitions`` machine only checks that each move is a row of the table. Each phase object
(:class:`~.pre_turn.PreTurn`, :class:`~.model.ModelPhase`, :class:`~.midturn.MidTurn`,
:class:`~.post_turn.PostTurn`; the controls, :class:`~.controls.Controls`, where they land) takes
the run through its :class:`~.host.Host` and returns an :data:`~.outcome.Outcome` (a
:class:`~.outcome.Move` or a :class:`~.outcome.Stop`); only :meth:`Driver.run` fires triggers, once
per outcome, with the bookkeeping that goes with each (checkpoint, stop record, turn record).

Every effect goes through the run's :class:`~.port.EffectPort`; the driver is the host the phases
run on, and holds nothing a replay could not rebuild.

Model and MidTurn (and plugins' side calls) run so that a control (through the port's watch) or a
signal (through :meth:`Driver.interrupt`) can cut them: the run's own task is cancelled while it
awaits them (as :func:`asyncio.timeout` does; no task per phase), so an Interrupt or Cancel stops a
stream or a tool mid-flight. Middleware ``call_next`` chains stay inside one task (``contextvars`` hold).

The result always names a StopReason. The driver lets out only ``asyncio.CancelledError`` (after
recording INTERRUPTED), :class:`~fsm_agent.errors.LeaseLost` (another worker owns the session now)
and :class:`~fsm_agent.errors.ReplayDivergence`. A store that cannot be written ends the run
FAILED_RETRYABLE, unrecorded: the last checkpoint stands and a resume continues from it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from attrs import evolve

from ..chain import MiddlewareChain
from ..errors import LeaseLost, MiddlewareError, ReplayDivergence, StopRun, StoreError
from ..hooks import HookBus
from ..prompt import PromptSource
from ..providers.base import Provider
from ..store.base import ControlKind, ControlRecord, LedgerEntry
from ..types.codec import unstructure
from ..types.events import PolicyDecision, TransitionEvent
from ..types.messages import AssistantMessage, Message, Usage
from ..types.requests import MessageRequest, MessageResponse
from ..types.run import RunResult, RunStop, StopReason
from .accounting import Accounting
from .controls import Controls
from .definition import MachineState
from .host import ControlCut, InFlight
from .journal import Journal
from .ledger import ToolLedger
from .midturn import MidTurn
from .model import ModelPhase
from .outcome import Move, Outcome, Stop
from .phases import Phase, Trigger
from .port import Cancellable, EffectPort
from .post_turn import PostTurn
from .pre_turn import PreTurn
from .turns import TurnRecorder
from .view import RunView

__all__ = ["STOP_TRIGGERS", "Driver"]

log = logging.getLogger("fsm_agent.driver")

T = TypeVar("T")

STOP_TRIGGERS: dict[StopReason, Trigger] = {
    StopReason.COMPLETED: Trigger.COMPLETE,
    StopReason.WAITING_HUMAN: Trigger.WAIT_HUMAN,
    StopReason.PAUSED_BUDGET: Trigger.PAUSE_BUDGET,
    StopReason.INTERRUPTED: Trigger.INTERRUPT,
    StopReason.FAILED_RETRYABLE: Trigger.FAIL_RETRYABLE,
    StopReason.FAILED_TERMINAL: Trigger.FAIL_TERMINAL,
    StopReason.CANCELLED: Trigger.CANCEL,
}
"""The trigger that moves a phase to each terminal state."""


class Driver:
    """Runs one session from its current state to a terminal state: the host of its phases.

    Args:
        view: the plugin's view of the run; the driver owns the :class:`~.state.RunState` behind it.
        chain: the middleware chain (frozen here if it is not yet).
        bus: the observer bus.
        port: every effect of the run (:class:`~.live.LivePort` for today's behaviour).
        cost_of: ``(model, usage) -> USD or None`` (the pricing table).
        journal: writes events, checkpoints and ledger entries through the port (``None``: nothing is
            persisted and control events cannot arrive).
        ledger: the session's tool-call ledger by call id, as the store has it (a resume).
        lease_ttl: seconds a lease lasts; the port's watch renews it while the run goes on.
        prompt: the agent's system prompt, read through the port at each PreTurn (``None``: the
            transcript's own system message is used as it is).
    """

    def __init__(self, view: RunView, chain: MiddlewareChain, bus: HookBus, *, port: EffectPort,
                 cost_of: Callable[[str, Usage], float | None] | None = None, journal: Journal | None = None,
                 ledger: Mapping[str, LedgerEntry] | None = None, lease_ttl: float = 30.0,
                 prompt: PromptSource | None = None) -> None:
        chain.freeze()
        self.prompt = prompt
        self.view = view
        self.run_state = view._run
        self.chain = chain
        self.bus = bus
        self.port = port
        self.journal = journal
        self.lease_ttl = lease_ttl
        self.turns = TurnRecorder(journal, self.run_state, view.session_id)
        self.ledger = ToolLedger(ledger or {}, tools=view._tools, run=self.run_state, journal=journal, turns=self.turns,
                                 port=port, session_id=view.session_id)
        self.accounting = Accounting(self.run_state, journal, cost_of, view.session_id)
        self.inflight = InFlight()
        self.controls = Controls(self)
        self.phases: dict[Phase, Any] = {
            Phase.PRE_TURN: PreTurn(self, self.controls), Phase.MODEL: ModelPhase(self, self.controls),
            Phase.MID_TURN: MidTurn(self), Phase.POST_TURN: PostTurn(self, self.controls)}
        self.stop: RunStop | None = None
        self._cutting: asyncio.Task[Any] | None = None
        """The run's task while it awaits work a control may cut (a phase, a side call)."""
        self._control_hit = False
        self._control_pending = False
        """A control cut a side call and the middleware that made it went on anyway (it caught the
        signal): no further phase or side call starts until the controls are taken."""
        self._local_interrupt: str | None = None
        """An interrupt raised in this process (a signal): consumed like a queued Interrupt."""
        self._lease_failed: str | None = None
        view._bind(self)

    # -- the host's data --------------------------------------------------------------------------
    @property
    def machine(self) -> MachineState:
        return self.view._machine

    @property
    def session_id(self) -> str:
        return self.view.session_id

    @property
    def ctx(self) -> RunView:
        """The plugin's view (the name older callers use)."""
        return self.view

    # -- the host's verbs -------------------------------------------------------------------------
    def append(self, message: Message) -> None:
        self.view._transcript.append(message)
        if self.journal is not None:
            self.turns.last_message_seq = self.journal.message(message, self.run_state.turn)

    def record(self, type: str, payload: dict[str, Any]) -> None:
        if self.journal is not None:
            self.journal.record(type, payload, self.run_state.turn)

    async def flush_outbox(self) -> None:
        outbox = self.view._outbox
        while outbox:
            event = outbox.pop(0)
            self.record(getattr(event, "TAG", type(event).__name__), unstructure(event))
            await self.bus.emit(event)

    async def take(self, *kinds: ControlKind, wait: float = 0.0) -> list[ControlRecord]:
        taken: list[ControlRecord] = []
        if ControlKind.INTERRUPT in kinds and ControlKind.CANCEL in kinds:
            self._control_pending = False  # the control that cut a side call is taken now
        if self._local_interrupt is not None and ControlKind.INTERRUPT in kinds:
            taken.append(ControlRecord(self.session_id, ControlKind.INTERRUPT, self._local_interrupt,
                                       self.port.new_id(), self.port.now()))
            self._local_interrupt = None
        if self.journal is None:
            return taken
        if wait > 0 and not taken:
            taken.extend(await self.port.wait_controls(self.session_id, kinds, wait))
        else:
            taken.extend(await self.port.store.take_controls(self.session_id, kinds))
        for c in taken:
            self.record("control", {"kind": c.kind.value, "text": c.text, "control_id": c.control_id})
        return taken

    async def interruptible(self, work: Awaitable[T], *, side_call: bool = False) -> T:
        if self._cutting is not None or (self.journal is None and self._local_interrupt is None
                                         and not self._control_pending):
            return await work  # inside Model/MidTurn the phase is cut as a whole
        if self._local_interrupt is not None or self._control_pending:
            # a signal landed between phases, or a control already cut a side call: this does not start
            if asyncio.iscoroutine(work):
                work.close()
            if side_call:
                self._control_pending = True
            raise ControlCut()
        # The cut cancels the run's own task while it awaits ``work`` (as asyncio.timeout does): no
        # task per phase. A cancel from outside at the same time stays a cancel.
        task = asyncio.current_task()
        assert task is not None
        self._cutting = task
        self._control_hit = False
        try:
            result = await work
        except asyncio.CancelledError:
            ours = self._control_hit or self._lease_failed is not None
            if not ours or task.uncancel() > 0:
                raise
            if self._lease_failed is not None:
                raise LeaseLost(self._lease_failed) from None
            self._control_hit = False
            if side_call:
                self._control_pending = True  # honoured even if the middleware catches the signal
            raise ControlCut() from None
        finally:
            self._cutting = None
        if self._control_hit or self._lease_failed is not None:
            # the cut was delivered and something inside swallowed it: the control still wins
            task.uncancel()
            if self._lease_failed is not None:
                raise LeaseLost(self._lease_failed)
            self._control_hit = False
            if side_call:
                self._control_pending = True
            raise ControlCut()
        return result

    async def side_call(self, request: MessageRequest, provider: Provider | None = None, *,
                        account: bool = False) -> MessageResponse:
        """``ctx.call_provider`` (see :meth:`~.model.ModelPhase.side_call`)."""
        model: ModelPhase = self.phases[Phase.MODEL]
        return await model.side_call(request, provider, account=account)

    # -- firing ---------------------------------------------------------------------------------
    def _save_point(self) -> None:
        self.run_state.state = self.machine.state.value
        self.run_state.transcript_len = len(self.view._transcript)

    async def _fire(self, trigger: Trigger, reason: str) -> None:
        await self.flush_outbox()
        run, machine = self.run_state, self.machine
        before = machine.state
        after = machine.fire(trigger)
        j = self.journal
        if j is not None:
            self.turns.transition_seq = j.record("transition", {"from": before.value, "trigger": trigger.value,
                                                                "to": after.value, "reason": reason}, run.turn)
            if after is Phase.PRE_TURN or (after is Phase.MID_TURN and not self.ledger.all_pure(run.pending_calls)):
                # A MidTurn checkpoint pins the model's tool calls before any of them runs; when every
                # call is pure, a crash can only make the model answer again, so it rides the next commit.
                self._save_point()
                await j.flush(checkpoint=j.checkpoint(run, after.value), state=after.value)
            elif isinstance(after, StopReason):
                assert self.stop is not None
                j.record("run_stopped", {"stop": unstructure(self.stop)}, run.turn)
                self._save_point()
                ck = j.checkpoint(run, self.stop.last_safe_point or after.value)
                self.stop = evolve(self.stop, checkpoint_id=ck.checkpoint_id)
                await j.flush(checkpoint=ck, state=after.value, stop=unstructure(self.stop))
        if self.bus.wants(TransitionEvent):  # observers: the wall clock here is theirs, not the run's
            await self.bus.emit(TransitionEvent(self.session_id, run.turn, before.value, trigger.value, after.value,
                                                reason, time.time()))

    async def _end(self, reason: StopReason, detail: str, **payload: Any) -> None:
        """Move to the terminal state ``reason`` from the current phase and record the stop."""
        trigger = STOP_TRIGGERS[reason]
        phase = self.machine.state
        if not self.machine.can_fire(trigger):
            detail = (f"{detail} (a {reason.value} stop was requested in {phase.value}, where the machine "
                      f"does not allow it; the run fails closed)")
            reason, trigger = StopReason.FAILED_TERMINAL, Trigger.FAIL_TERMINAL
            payload = {k: v for k, v in payload.items() if k == "error"}
        safe = payload.pop("last_safe_point", None)
        if safe is None:
            safe = Phase.MID_TURN.value if payload.get("pending_actions") else Phase.PRE_TURN.value
        self.stop = RunStop(reason=reason, detail=detail, resumable=reason.resumable,
                            last_safe_point=safe if reason.resumable else None,
                            evidence_refs=tuple(payload.pop("evidence_refs", ())) or tuple(self.run_state.evidence),
                            **payload)
        self.turns.end(stop_reason=reason.value)
        await self._fire(trigger, detail)

    async def _apply(self, outcome: Outcome) -> None:
        if isinstance(outcome, Move):
            await self._fire(outcome.trigger, outcome.reason)
        else:
            await self._end(outcome.reason, outcome.detail, **outcome.payload)

    # -- the loop --------------------------------------------------------------------------------
    async def run(self, first: Trigger | None = Trigger.START, reason: str = "start") -> RunResult:
        """Drive the session to a terminal state. ``first=None`` continues from the current state
        (crash recovery at a checkpoint)."""
        view, machine = self.view, self.machine
        started = self.port.monotonic()
        watch: Cancellable | None = None
        if self.journal is not None:
            watch = self.port.watch(self.session_id, self.journal.owner, self.lease_ttl, self._on_control,
                                    self._on_lost)
        try:
            try:
                await self.turns.find_input_seq()
                if first is not None:
                    await self._fire(first, reason)
                resumed_tools = machine.state is Phase.MID_TURN
                if resumed_tools:
                    self.turns.resumed()
                hooks_stop = await self._outcome_of(self.chain.run_start(view))
                if hooks_stop is not None:
                    await self._apply(hooks_stop)
                elif resumed_tools and self.journal is not None and await self.port.store.peek_controls(
                        self.session_id, [ControlKind.CANCEL]):
                    # a Cancel queued while the run was stopped (e.g. WAITING_HUMAN with calls pending):
                    # it applies before any pending call is decided again or run
                    await self._apply(await self.controls.after_cut())
                while not machine.is_terminal:
                    if self._lease_failed is not None:  # the watch gave up the session between phases
                        raise LeaseLost(self._lease_failed)
                    await self.flush_outbox()
                    await self._apply(await self._phase(machine.state))
            except asyncio.CancelledError:
                if not machine.is_terminal and machine.can_fire(Trigger.INTERRUPT):
                    await asyncio.shield(self._stopped_from_outside("the run's task was cancelled"))
                raise
        except (StoreError, LeaseLost) as exc:
            if isinstance(exc, LeaseLost) and self._lease_failed is None:
                log.error("session %s: lease lost to another worker; stopping without writing", self.session_id)
                raise
            self.stop = self._unrecorded_stop(exc)
        finally:
            if watch is not None:
                watch.cancel()
        result = self._result(self.port.monotonic() - started)
        try:
            await self.chain.run_end(view, result)
        except ReplayDivergence:
            raise
        except Exception as exc:  # noqa: BLE001 - the run has ended; nothing can change it now
            log.error("on_run_end failed after the run ended: %s", exc)
        await self.flush_outbox()
        return result

    async def _phase(self, state: Any) -> Outcome:
        """Run the phase ``state``; every way out of it becomes an outcome."""
        phase = self.phases.get(state)
        if phase is None:  # pragma: no cover - the table has no other non-terminal states
            raise RuntimeError(f"driver reached unexpected state {state!r}")
        work = phase.run()
        if state is Phase.MODEL or state is Phase.MID_TURN:
            work = self._cuttable(work)
        outcome = await self._outcome_of(work)
        assert outcome is not None
        return outcome

    async def _cuttable(self, work: Awaitable[Outcome]) -> Outcome:
        if self.journal is None and self._local_interrupt is None and not self._control_pending:
            return await work
        return await self.interruptible(work)

    async def _outcome_of(self, work: Awaitable[Outcome | None]) -> Outcome | None:
        """Await ``work`` (a phase, or the run-start hooks); a stop signal, a failing middleware or
        an internal error becomes the outcome that ends the run, with every open tool call closed."""
        try:
            return await work
        except ControlCut:
            self._control_pending = False
            return await self.controls.after_cut()
        except StopRun as sig:
            by = getattr(sig, "middleware", None)  # named by the chain (fsm_agent.chain.stopped_by)
            if by is not None and self.bus.wants(PolicyDecision):
                await self.bus.emit(PolicyDecision(self.session_id, self.run_state.turn, by, self.machine.state.value,
                                                   "stop", sig.detail, stop_reason=str(getattr(sig.reason, "value",
                                                                                               sig.reason))))
            await self.controls.close_open_calls(keep_unstarted=False)
            try:
                reason = StopReason(sig.reason)
            except ValueError:
                return Stop(StopReason.FAILED_TERMINAL, f"a middleware asked to stop with {sig.reason!r}, which is "
                            f"not a StopReason ({', '.join(r.value for r in StopReason)}); the run fails closed",
                            {"error": {"kind": "middleware", "message": f"unknown stop reason {sig.reason!r}"}})
            return Stop(reason, sig.detail or f"stopped by middleware: {sig.reason}", dict(sig.payload))
        except MiddlewareError as exc:
            if isinstance(exc.__cause__, ReplayDivergence):
                raise exc.__cause__ from None
            if self._lease_failed is not None:  # a middleware's side call was stopped because the lease is gone
                raise LeaseLost(self._lease_failed) from exc
            await self.controls.close_open_calls(keep_unstarted=False)
            return Stop(StopReason.FAILED_TERMINAL, str(exc),
                        {"error": {"kind": "middleware", "middleware": exc.middleware, "hook": exc.hook,
                                   "message": str(exc)}})
        except (asyncio.CancelledError, StoreError, LeaseLost, ReplayDivergence):
            raise
        except Exception as exc:  # noqa: BLE001 - a run always ends with a StopReason
            if self._lease_failed is not None:
                raise LeaseLost(self._lease_failed) from exc
            log.exception("internal error in the driver")
            await self.controls.close_open_calls(keep_unstarted=False)
            return Stop(StopReason.FAILED_TERMINAL, f"internal error: {type(exc).__name__}: {exc}",
                        {"error": {"kind": "internal", "message": str(exc)}})

    # -- cuts from outside --------------------------------------------------------------------------
    def interrupt(self, reason: str = "interrupted") -> None:
        """Interrupt this run from this process (a signal handler, another task): the model stream or
        the tools in flight are cut at once, and the run ends INTERRUPTED as an Interrupt control
        event would end it (streamed text kept, every tool call closed or left pending, checkpoint).
        Safe to call from the event loop's thread only; a no-op once the run ended."""
        if self.machine.is_terminal:
            return
        self._local_interrupt = reason
        self._on_control()

    async def _stopped_from_outside(self, text: str) -> None:
        """``Task.cancel()`` on the run: record INTERRUPTED as an Interrupt would."""
        await self._apply(await self.controls.interrupted(text))

    def _on_control(self) -> None:
        """The port saw an Interrupt or a Cancel queued (or a signal came): cut the phase in flight."""
        task = self._cutting
        if task is not None and not task.done() and not self._control_hit:
            self._control_hit = True
            task.cancel()

    def _on_lost(self, reason: str) -> None:
        """The port could not keep the lease: stop driving before another worker may take over."""
        first = self._lease_failed is None
        self._lease_failed = reason
        task = self._cutting
        if first and task is not None and not task.done() and not self._control_hit:
            task.cancel()

    # -- the result --------------------------------------------------------------------------------
    def _unrecorded_stop(self, exc: BaseException) -> RunStop:
        """The stop of a run whose store could not be written (or whose lease ran out): nothing of it
        is recorded after the last commit, so a resume continues from the last checkpoint."""
        kind = "lease" if isinstance(exc, LeaseLost) else "store"
        info: dict[str, Any] = {"kind": kind, "message": str(exc)}
        if isinstance(exc, StoreError):
            info.update(location=exc.location, operation=exc.operation, transient=exc.transient)
        log.error("session %s: %s; the run stops unrecorded at the last checkpoint", self.session_id, exc)
        return RunStop(StopReason.FAILED_RETRYABLE,
                       f"the session store failed, so the run stopped at its last checkpoint: {exc}",
                       resumable=True, checkpoint_id=self.journal.last_checkpoint if self.journal else None,
                       error=info)

    def _result(self, duration: float) -> RunResult:
        run, transcript = self.run_state, self.view._transcript
        stop = self.stop or RunStop(StopReason.FAILED_TERMINAL, "the run ended without a stop reason")
        output = ""
        for m in reversed(transcript):
            if isinstance(m, AssistantMessage) and m.text.strip():
                output = m.text
                break
        return RunResult(session_id=self.session_id, stop=stop, output=output, messages=tuple(transcript),
                         usage=run.usage, turns=run.turn, tool_calls=run.tool_calls_made,
                         model_stop_reason=run.last_response.stop_reason if run.last_response else None,
                         cost_usd=run.cost_usd, duration_s=duration, output_data=run.metadata.get("output_data"))
