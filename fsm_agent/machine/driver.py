"""The loop: one explicit function that runs each phase and fires the trigger its outcome names.

The ``transitions`` machine only checks that each move is a row of the table. Each phase
returns an :data:`~.outcome.Outcome` (a :class:`~.outcome.Move` or a :class:`~.outcome.Stop`);
only :meth:`Driver.run` fires triggers, once per outcome, and does the bookkeeping that goes
with each (checkpoint, stop record, turn record). Phases:

* **PreTurn** — control events (interrupt, cancel, steer) → budgets (seed 000 order: shutdown,
  iterations, wall clock, tokens, cost) → context built from the transcript → PreTurn
  middleware → ``call_model``.
* **Model** — the composed ``wrap_model_call`` chain around one provider call (streamed: every
  event passes ``on_model_event`` and then the observers), bounded by the remaining wall clock →
  usage and cost → route on the response: tool calls → ``tool_use``; end of turn, stop sequence,
  max tokens, pause → ``model_done``; content filtered or refused → FAILED_TERMINAL; a provider
  error → FAILED_RETRYABLE / FAILED_TERMINAL (a failed answer is not history: what streamed is
  the stop's ``partial`` only); tool calls cut by the output limit → ``retry_output`` once; a context-window error → ``retry_context`` once
  (case B20); the wall clock running out → PAUSED_BUDGET with the streamed part kept.
* **MidTurn** — :mod:`.midturn` (the tool calls through the ledger).
* **PostTurn** — the output schema check (one repair turn) → ``post_turn`` decisions
  (verifier) → queued followups → ``complete`` or ``next_turn``.

Model and MidTurn run as tasks that a control watcher (or a signal, through
:meth:`Driver.interrupt`) can cancel, so an Interrupt or Cancel stops a stream or a tool
mid-flight. Middleware ``call_next`` chains stay inside one task (``contextvars`` hold).

**No tool call is left without a result** on any path out of MidTurn (an Interrupt, a Cancel,
``Task.cancel()``, ``StopRun`` from any hook, an exception): a call that ran keeps its real
result, a call in flight gets an honest "outcome unknown" (ledger ``interrupted``), a call that
never started is marked as not run (ledger ``not_run``). Only an Interrupt (or a cancelled task)
that lands before any call started leaves the calls pending, to run on resume.

The result always names a StopReason. The driver lets out only ``asyncio.CancelledError``
(after recording INTERRUPTED) and :class:`~fsm_agent.errors.LeaseLost` (another worker owns
the session now). A store that cannot be written ends the run FAILED_RETRYABLE, unrecorded:
the last checkpoint stands and a resume continues from it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson
from attrs import evolve

from ..chain import MiddlewareChain
from ..errors import (
    ContextLengthExceededError,
    LeaseLost,
    MiddlewareError,
    ProviderError,
    StopRun,
    StoreError,
    WaitForHuman,
)
from ..hooks import HookBus
from ..middleware import Complete, Continue
from ..providers.base import Provider, call_deadline, retry_listener
from ..store.base import ControlKind, ControlRecord, LedgerEntry, LedgerStatus
from ..tools.registry import ToolEffect
from ..types.codec import unstructure
from ..types.content import TextBlock, ThinkingBlock, ToolUseBlock
from ..types.events import ModelRetry, ModelStreamEvent, TransitionEvent
from ..types.messages import AssistantMessage, Message, ModelStopReason, ToolResultMessage, Usage, UserMessage
from ..types.requests import MessageRequest, MessageResponse
from ..types.run import ContextRef, PendingAction, RunResult, RunStop, StopReason, TurnRecord
from ..types.stream import MessageComplete, TextDelta
from ..types.tokens import count_message_tokens, count_tokens
from .context import RunContext
from .journal import Journal
from .midturn import MidTurn
from .outcome import Move, Outcome, Stop
from .phases import Phase, Trigger

__all__ = ["STOP_TRIGGERS", "Driver"]

log = logging.getLogger("fsm_agent.driver")

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

MANY_TOOLS = 25
"""More tools than this offered on the first call draws a warning (seed 000 §5.2.5)."""

_MIDPHASE_CONTROLS = (ControlKind.INTERRUPT, ControlKind.CANCEL)


class _ControlHit(StopRun):
    """Raised inside the driver when the watcher (or a signal) cancelled a phase, or a middleware's
    side call (``ctx.call_provider`` in PreTurn or PostTurn), for a control event. A ``StopRun``, so
    the middleware chain (and a plugin that lets ``StopRun`` through) passes it to the driver, which
    takes the control that caused it (Interrupt or Cancel) to decide the stop."""

    def __init__(self) -> None:
        super().__init__(StopReason.INTERRUPTED, "an Interrupt or a Cancel cut the call")


class Driver:
    """Runs one session from its current state to a terminal state.

    Args:
        ctx: the plugin's view of the run; the driver owns the :class:`~.state.RunState` behind it.
        chain: the middleware chain (frozen here if it is not yet).
        bus: the observer bus.
        cost_of: ``(model, usage) -> USD or None`` (the pricing table).
        journal: writes events, checkpoints and ledger entries to the session's store (``None``:
            nothing is persisted and control events cannot arrive).
        ledger: the session's tool-call ledger by call id, as the store has it (a resume); the
            driver keeps it up to date as it writes entries.
        control_poll: seconds between checks for Interrupt/Cancel while a model call or tools run.
        lease_ttl: seconds a lease lasts; renewed at a third of it while the run goes on.
    """

    def __init__(
        self,
        ctx: RunContext,
        chain: MiddlewareChain,
        bus: HookBus,
        *,
        cost_of: Callable[[str, Usage], float | None] | None = None,
        journal: Journal | None = None,
        control_poll: float = 0.5,
        lease_ttl: float = 30.0,
        ledger: dict[str, LedgerEntry] | None = None,
    ) -> None:
        chain.freeze()
        self.ledger: dict[str, LedgerEntry] = dict(ledger or {})
        """The tool-call ledger by call id (the store's, plus what this run wrote)."""
        self.ctx = ctx
        self.run_state = ctx._run
        self.chain = chain
        self.bus = bus
        self.cost_of = cost_of
        self.journal = journal
        self.control_poll = control_poll
        self.lease_ttl = lease_ttl
        self.stop: RunStop | None = None
        self.midturn = MidTurn(self)
        self._phase_task: asyncio.Task[Any] | None = None
        self._control_hit = False
        self._control_pending = False
        """A control cut a side call and the middleware that made it went on anyway (it caught the
        signal): no further phase or side call starts until the controls are taken."""
        self._local_interrupt: str | None = None
        """An interrupt raised in this process (a signal): consumed like a queued Interrupt."""
        self._lease_failed: str | None = None
        self._request: MessageRequest | None = None
        """The model request in flight (for accounting an interrupted call)."""
        self._streamed: list[str] = []
        """Text deltas of the model call in flight (of its current attempt: a failed attempt's are
        dropped, so that an Interrupt or the wall clock never keeps a failed answer's text)."""
        self._failed_partial = ""
        """The text a failed attempt of the Model phase's call had streamed (the stop's ``partial``)."""
        self._last_message_seq: int | None = None
        self._transition_seq: int | None = None
        """Seq of the last ``transition`` event (the input of a turn resumed in MidTurn)."""
        self._turn: dict[str, Any] | None = None
        """The current turn's record, filled as the turn goes (written as a ``turn`` event at its end)."""
        self._sent_forms: dict[int, tuple[Message, Any]] = {}
        """The last request's messages and their unstructured forms, by ``id`` (for the context hash)."""
        self._tool_forms: tuple[tuple[int, ...], Any, Any] | None = None
        """The offered tool definitions' ids, their unstructured form, and the definitions (kept alive
        so the ids stay theirs)."""
        self._warned_tools = False
        self._verdict: str | None = None
        """PostTurn's verdict, for the record of the turn that ends the run."""
        ctx.call_provider = self._provider_call

    # -- transitions and persistence ---------------------------------------------------
    async def _flush_outbox(self) -> None:
        """Deliver observer events middleware queued with ``ctx.emit`` (and log them in the session)."""
        outbox = self.ctx._outbox
        while outbox:
            event = outbox.pop(0)
            if self.journal is not None:
                self.journal.record(getattr(event, "TAG", type(event).__name__), unstructure(event), self.run_state.turn)
            await self.bus.emit(event)

    def _checkpoint_state(self) -> None:
        run = self.run_state
        run.state = self.ctx.machine.state.value
        run.transcript_len = len(self.ctx.transcript)

    async def _fire(self, trigger: Trigger, reason: str) -> None:
        await self._flush_outbox()
        ctx, run = self.ctx, self.run_state
        before = ctx.machine.state
        after = ctx.machine.fire(trigger)
        j = self.journal
        if j is not None:
            self._transition_seq = j.record("transition", {"from": before.value, "trigger": trigger.value,
                                                           "to": after.value, "reason": reason}, run.turn)
            if after is Phase.PRE_TURN or (after is Phase.MID_TURN and not self.midturn.all_pure(run.pending_calls)):
                # A MidTurn checkpoint pins the model's tool calls before any of them runs; when every
                # call is pure, a crash can only make the model answer again, so it rides the next commit.
                self._checkpoint_state()
                await j.flush(checkpoint=j.checkpoint(run, after.value), state=after.value)
            elif isinstance(after, StopReason):
                assert self.stop is not None
                j.record("run_stopped", {"stop": unstructure(self.stop)}, run.turn)
                safe = self.stop.last_safe_point or after.value
                self._checkpoint_state()
                ck = j.checkpoint(run, safe)
                self.stop = evolve(self.stop, checkpoint_id=ck.checkpoint_id)
                await j.flush(checkpoint=ck, state=after.value, stop=unstructure(self.stop))
        if self.bus.wants(TransitionEvent):
            await self.bus.emit(TransitionEvent(ctx.session_id, run.turn, before.value, trigger.value, after.value,
                                                reason, time.time()))

    def _append(self, message: Message) -> None:
        self.ctx.transcript.append(message)
        if self.journal is not None:
            self._last_message_seq = self.journal.message(message, self.run_state.turn)

    async def _end(self, reason: StopReason, detail: str, **payload: Any) -> None:
        """Move to the terminal state ``reason`` from the current phase and record the stop."""
        trigger = STOP_TRIGGERS[reason]
        phase = self.ctx.machine.state
        if not self.ctx.machine.can_fire(trigger):
            detail = (f"{detail} (a {reason.value} stop was requested in {phase.value}, where the machine "
                      f"does not allow it; the run fails closed)")
            reason, trigger = StopReason.FAILED_TERMINAL, Trigger.FAIL_TERMINAL
            payload = {k: v for k, v in payload.items() if k == "error"}
        safe = payload.pop("last_safe_point", None)
        if safe is None:
            safe = Phase.MID_TURN.value if payload.get("pending_actions") else Phase.PRE_TURN.value
        self.stop = RunStop(
            reason=reason,
            detail=detail,
            resumable=reason.resumable,
            last_safe_point=safe if reason.resumable else None,
            evidence_refs=tuple(payload.pop("evidence_refs", ())) or tuple(self.run_state.evidence),
            **payload,
        )
        self._end_turn(stop_reason=reason.value)
        await self._fire(trigger, detail)

    async def _apply(self, outcome: Outcome) -> None:
        if isinstance(outcome, Move):
            await self._fire(outcome.trigger, outcome.reason)
        else:
            await self._end(outcome.reason, outcome.detail, **outcome.payload)

    # -- turn records ------------------------------------------------------------------------
    def _start_turn(self, request: MessageRequest) -> None:
        j = self.journal
        if j is None:
            self._turn = None
            return
        digest = hashlib.sha256(orjson.dumps(self._request_data(request))).hexdigest()
        self._turn = {"turn": self.run_state.turn, "input_seq": self._last_message_seq,
                      "context": ContextRef(digest, j.next_seq - 1, len(request.messages))}

    def _request_data(self, request: MessageRequest) -> dict[str, Any]:
        """``unstructure(request)``, the messages' forms kept from the turn before: messages are frozen,
        so only the ones new to this request go through the converter (not the whole transcript each
        turn). Same value, so the same context hash."""
        sent = self._sent_forms
        forms: list[Any] = []
        kept: dict[int, tuple[Message, Any]] = {}
        for m in request.messages:
            hit = sent.get(id(m))
            if hit is None or hit[0] is not m:
                hit = (m, unstructure(m, Message))
            kept[id(m)] = hit
            forms.append(hit[1])
        self._sent_forms = kept
        data: dict[str, Any] = unstructure(evolve(request, messages=(), tools=()))
        data["messages"] = forms
        if request.tools:  # the same definitions every turn: converted once
            key = tuple(map(id, request.tools))
            if self._tool_forms is None or self._tool_forms[0] != key:
                self._tool_forms = (key, unstructure(request.tools), request.tools)
            data["tools"] = self._tool_forms[1]
        return data

    def _end_turn(self, *, stop_reason: str | None = None, verification: str | None = None) -> None:
        rec, j = self._turn, self.journal
        if rec is None or j is None:
            return
        self._turn = None
        if verification is None:
            verification, self._verdict = self._verdict, None
        turn = TurnRecord(rec["turn"], rec.get("input_seq"), rec.get("context"), rec.get("model_call"),
                          tuple(rec.get("tool_calls", ())), tuple(rec.get("observations", ())),
                          verification, stop_reason, rec.get("resumed", False))
        j.record("turn", {"turn": unstructure(turn)}, turn.turn)

    async def _find_input_seq(self) -> None:
        """The seq of the session's last message, for the input of this run's first turn: the initial
        messages were journaled before the driver ran, and a resumed run appended none yet."""
        j = self.journal
        if j is None or self._last_message_seq is not None:
            return
        buffered = [e.seq for e in j.buffer if e.type == "message"]
        if buffered:
            self._last_message_seq = buffered[-1]
            return
        try:
            found = await j.store.read_events(self.ctx.session_id, 0, None, types=("message",))
        except StoreError:  # only the turn record's input_seq is lost
            return
        if found:
            self._last_message_seq = found[-1].seq

    def _resume_turn(self) -> None:
        """A run resumed in MidTurn finishes a turn whose record was written when it stopped: the rest
        of that turn (its tool calls, observations, verification) gets a ``resumed`` record."""
        if self.journal is None or not self.run_state.pending_calls:
            return
        self._turn = {"turn": self.run_state.turn, "input_seq": self._transition_seq, "resumed": True,
                      "tool_calls": [c.id for c in self.run_state.pending_calls]}

    def _observe(self, call: ToolUseBlock, status: LedgerStatus, result: ToolResultMessage | None) -> None:
        if self._turn is not None:
            self._turn.setdefault("observations", []).append(
                {"call_id": call.id, "tool": call.name, "status": status.value,
                 "is_error": bool(result.is_error) if result is not None else None})

    # -- the loop ------------------------------------------------------------------------
    async def run(self, first: Trigger | None = Trigger.START, reason: str = "start") -> RunResult:
        """Drive the session to a terminal state. ``first=None`` continues from the current state
        (crash recovery at a checkpoint)."""
        ctx = self.ctx
        started = time.monotonic()
        watcher = asyncio.ensure_future(self._watch()) if self.journal is not None else None
        try:
            try:
                await self._find_input_seq()
                if first is not None:
                    await self._fire(first, reason)
                resumed_tools = ctx.machine.state is Phase.MID_TURN
                if resumed_tools:
                    self._resume_turn()
                hooks_stop = await self._outcome_of(self.chain.run_start(ctx))
                if hooks_stop is not None:
                    await self._apply(hooks_stop)
                elif resumed_tools and self.journal is not None and await self.journal.store.peek_controls(
                        ctx.session_id, [ControlKind.CANCEL]):
                    # a Cancel queued while the run was stopped (e.g. WAITING_HUMAN with calls pending):
                    # it applies before any pending call is decided again or run
                    await self._apply(await self._mid_phase_control())
                while not ctx.machine.is_terminal:
                    if self._lease_failed is not None:  # the watcher gave up the session between phases
                        raise LeaseLost(self._lease_failed)
                    await self._flush_outbox()
                    await self._apply(await self._phase(ctx.machine.state))
            except asyncio.CancelledError:
                if not ctx.machine.is_terminal and ctx.machine.can_fire(Trigger.INTERRUPT):
                    await asyncio.shield(self._stopped_from_outside("the run's task was cancelled"))
                raise
        except (StoreError, LeaseLost) as exc:
            if isinstance(exc, LeaseLost) and self._lease_failed is None:
                log.error("session %s: lease lost to another worker; stopping without writing", ctx.session_id)
                raise
            self.stop = self._unrecorded_stop(exc)
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
        result = self._result(time.monotonic() - started)
        try:
            await self.chain.run_end(ctx, result)
        except Exception as exc:  # noqa: BLE001 - the run has ended; nothing can change it now
            log.error("on_run_end failed after the run ended: %s", exc)
        await self._flush_outbox()
        return result

    async def _phase(self, state: Any) -> Outcome:
        """Run the phase ``state``; every way out of it becomes an outcome."""
        if state is Phase.PRE_TURN:
            work = self._pre_turn()
        elif state is Phase.MODEL:
            work = self._in_task(self._model())
        elif state is Phase.MID_TURN:
            work = self._in_task(self.midturn.run())
        elif state is Phase.POST_TURN:
            work = self._post_turn()
        else:  # pragma: no cover - the table has no other non-terminal states
            raise RuntimeError(f"driver reached unexpected state {state!r}")
        outcome = await self._outcome_of(work)
        assert outcome is not None
        return outcome

    async def _outcome_of(self, work: Any) -> Outcome | None:
        """Await ``work`` (a phase, or the run-start hooks); a stop signal, a failing middleware or
        an internal error becomes the outcome that ends the run, with every open tool call closed."""
        try:
            return await work  # type: ignore[no-any-return]
        except _ControlHit:
            return await self._mid_phase_control()
        except StopRun as sig:
            await self._close_open_calls(keep_unstarted=False)
            try:
                reason = StopReason(sig.reason)
            except ValueError:
                return Stop(StopReason.FAILED_TERMINAL, f"a middleware asked to stop with {sig.reason!r}, which is "
                            f"not a StopReason ({', '.join(r.value for r in StopReason)}); the run fails closed",
                            {"error": {"kind": "middleware", "message": f"unknown stop reason {sig.reason!r}"}})
            return Stop(reason, sig.detail or f"stopped by middleware: {sig.reason}", dict(sig.payload))
        except MiddlewareError as exc:
            if self._lease_failed is not None:  # a middleware's side call was stopped because the lease is gone
                raise LeaseLost(self._lease_failed) from exc
            await self._close_open_calls(keep_unstarted=False)
            return Stop(StopReason.FAILED_TERMINAL, str(exc),
                        {"error": {"kind": "middleware", "middleware": exc.middleware, "hook": exc.hook,
                                   "message": str(exc)}})
        except (asyncio.CancelledError, StoreError, LeaseLost):
            raise
        except Exception as exc:  # noqa: BLE001 - a run always ends with a StopReason
            if self._lease_failed is not None:
                raise LeaseLost(self._lease_failed) from exc
            log.exception("internal error in the driver")
            await self._close_open_calls(keep_unstarted=False)
            return Stop(StopReason.FAILED_TERMINAL, f"internal error: {type(exc).__name__}: {exc}",
                        {"error": {"kind": "internal", "message": str(exc)}})

    async def _in_task(self, coro: Any) -> Any:
        """Run a phase (or a middleware's side call) so that the control watcher can cancel it
        (Interrupt/Cancel mid-phase)."""
        if self.journal is None and self._local_interrupt is None and not self._control_pending:
            return await coro
        task = asyncio.ensure_future(coro)
        self._phase_task = task
        if self._local_interrupt is not None or self._control_pending:
            # a signal landed between phases, or a control already cut a side call: this does not start
            self._control_hit = True
            task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            if self._lease_failed is not None and task.cancelled():
                raise LeaseLost(self._lease_failed) from None
            if self._control_hit and task.cancelled():
                self._control_hit = False
                raise _ControlHit() from None
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            self._phase_task = None

    def interrupt(self, reason: str = "interrupted") -> None:
        """Interrupt this run from this process (a signal handler, another task): the model stream or
        the tools in flight are cut at once, and the run ends INTERRUPTED as an Interrupt control
        event would end it (streamed text kept, every tool call closed or left pending, checkpoint).
        Safe to call from the event loop's thread only; a no-op once the run ended."""
        if self.ctx.machine.is_terminal:
            return
        self._local_interrupt = reason
        task = self._phase_task
        if task is not None and not task.done():
            self._control_hit = True
            task.cancel()

    async def _watch(self) -> None:
        """Renew the lease and look for Interrupt/Cancel while a phase runs.

        A store error does not end the watcher: it retries with backoff (up to 8 control polls).
        When the lease cannot be renewed for two thirds of its time-to-live, this worker stops
        driving (the phase is cancelled and the run ends unrecorded) before another worker may
        take the session over.
        """
        j = self.journal
        assert j is not None
        store, sid = j.store, self.ctx.session_id
        last_renew = last_ok = time.monotonic()
        delay = self.control_poll
        while True:
            await asyncio.sleep(delay)
            now = time.monotonic()
            try:
                if j.owner is not None and now - last_renew > self.lease_ttl / 3:
                    last_renew = now
                    if not await store.acquire_lease(sid, j.owner, self.lease_ttl):
                        self._lease_failed = f"session {sid}: another worker took the lease"
                        self._stop_phase()
                        return
                    last_ok = now
                task = self._phase_task
                if task is not None and not task.done() and await store.peek_controls(sid, _MIDPHASE_CONTROLS):
                    self._control_hit = True
                    task.cancel()
                delay = self.control_poll
            except Exception as exc:  # noqa: BLE001 - transient store trouble must not end the watcher
                log.warning("session %s: control watcher: %s; retrying", sid, exc)
                delay = min(delay * 2, self.control_poll * 8)
                if j.owner is not None and now - last_ok > self.lease_ttl * 2 / 3:
                    self._lease_failed = (f"session {sid}: could not renew the lease for {now - last_ok:.1f} s "
                                          f"({exc}); stopped driving before it expires")
                    log.error("%s", self._lease_failed)
                    self._stop_phase()
                    return

    def _stop_phase(self) -> None:
        task = self._phase_task
        if task is not None and not task.done():
            task.cancel()

    def _unrecorded_stop(self, exc: BaseException) -> RunStop:
        """The stop of a run whose store could not be written (or whose lease ran out): nothing of it
        is recorded after the last commit, so a resume continues from the last checkpoint."""
        kind = "lease" if isinstance(exc, LeaseLost) else "store"
        info: dict[str, Any] = {"kind": kind, "message": str(exc)}
        if isinstance(exc, StoreError):
            info.update(location=exc.location, operation=exc.operation, transient=exc.transient)
        log.error("session %s: %s; the run stops unrecorded at the last checkpoint", self.ctx.session_id, exc)
        return RunStop(StopReason.FAILED_RETRYABLE,
                       f"the session store failed, so the run stopped at its last checkpoint: {exc}",
                       resumable=True, checkpoint_id=self.journal.last_checkpoint if self.journal else None,
                       error=info)

    def _result(self, duration: float) -> RunResult:
        ctx, run = self.ctx, self.run_state
        stop = self.stop or RunStop(StopReason.FAILED_TERMINAL, "the run ended without a stop reason")
        output = ""
        for m in reversed(ctx.transcript):
            if isinstance(m, AssistantMessage) and m.text.strip():
                output = m.text
                break
        return RunResult(
            session_id=ctx.session_id,
            stop=stop,
            output=output,
            messages=tuple(ctx.transcript),
            usage=run.usage,
            turns=run.turn,
            tool_calls=run.tool_calls_made,
            model_stop_reason=run.last_response.stop_reason if run.last_response else None,
            cost_usd=run.cost_usd,
            duration_s=duration,
            output_data=run.metadata.get("output_data"),
        )

    # -- control events ----------------------------------------------------------------------
    async def take(self, *kinds: ControlKind) -> list[ControlRecord]:
        """Take queued control events of ``kinds`` (each once), recording them in the log."""
        taken: list[ControlRecord] = []
        if ControlKind.INTERRUPT in kinds and ControlKind.CANCEL in kinds:
            self._control_pending = False  # the control that cut a side call is taken now
        if self._local_interrupt is not None and ControlKind.INTERRUPT in kinds:
            taken.append(ControlRecord(self.ctx.session_id, ControlKind.INTERRUPT, self._local_interrupt))
            self._local_interrupt = None
        if self.journal is None:
            return taken
        taken.extend(await self.journal.store.take_controls(self.ctx.session_id, kinds))
        for c in taken:
            self.journal.record("control", {"kind": c.kind.value, "text": c.text, "control_id": c.control_id},
                                self.run_state.turn)
        return taken

    async def _mid_phase_control(self) -> Outcome:
        """An Interrupt or Cancel arrived while the model or tools ran, or while a middleware's side
        call ran (the phase, or the call, was cancelled)."""
        self._control_pending = False
        controls = await self.take(*_MIDPHASE_CONTROLS)
        cancel = next((c for c in controls if c.kind is ControlKind.CANCEL), None)
        interrupt = next((c for c in controls if c.kind is ControlKind.INTERRUPT), None)
        if cancel is not None:
            kept = self._keep_interrupted_answer() if self.ctx.machine.state is Phase.MODEL else ""
            await self._close_open_calls(keep_unstarted=False)
            return await self._cancel(cancel.text or "cancelled by the user", kept)
        text = (interrupt.text if interrupt is not None else "") or "interrupted by the user"
        return await self._interrupted(text)

    async def _interrupted(self, text: str) -> Stop:
        """The INTERRUPTED stop of an interrupted Model or MidTurn phase (streamed text kept; calls
        closed, or left pending when none had started)."""
        during = self.ctx.machine.state
        if during is Phase.MODEL and not self._answered_with_calls():
            kept = self._keep_interrupted_answer()
            return Stop(StopReason.INTERRUPTED, f"{text} (during Model{kept})")
        mt = self.midturn
        cut = {c.id for c in self.run_state.pending_calls if c.id in mt.started_ids and c.id not in mt.settled}
        pending = await self._close_open_calls(keep_unstarted=True)
        if pending:
            resumed = [c.name for c in pending if c.id in cut]
            closed = [c.name for c in self.run_state.pending_calls if c.id in cut and c not in pending]
            how = (f"{', '.join(resumed)} left open, to continue on resume" if resumed
                   else "before the tool calls started")
            if closed:
                how += f"; {', '.join(closed)} closed, outcome unknown"
            return Stop(StopReason.INTERRUPTED, f"{text} ({how})",
                        {"pending_actions": tuple(PendingAction(c, "interrupted") for c in pending),
                         "last_safe_point": Phase.MID_TURN.value})
        return Stop(StopReason.INTERRUPTED, f"{text} (during {during.value})")

    def _answered_with_calls(self) -> bool:
        """In Model: the call completed and its answer with tool calls is recorded (a stop landed just
        as it returned); those calls are open like MidTurn's before any started."""
        run, transcript = self.run_state, self.ctx.transcript
        return (self._request is None and bool(run.pending_calls) and run.last_response is not None
                and bool(transcript) and transcript[-1] is run.last_response.message)

    async def _stopped_from_outside(self, text: str) -> None:
        """``Task.cancel()`` on the run: record INTERRUPTED as an Interrupt would."""
        await self._apply(await self._interrupted(text))

    def _keep_interrupted_answer(self) -> str:
        """A model call was cut: keep the text that had streamed (as an assistant message marked
        ``interrupted``) and count the call's tokens as an estimate. Returns a note for the stop detail."""
        run = self.run_state
        partial = "".join(self._streamed)
        self._streamed = []
        request = self._request
        if request is None:  # no call in flight: it completed (its answer is recorded) or never began
            return ""
        run.usage = run.usage + Usage(count_message_tokens(request.messages), count_tokens(partial), estimated=True)
        self._request = None
        if self.journal is not None:
            self.journal.record("model_call_interrupted", {"streamed_chars": len(partial)}, run.turn)
        if not partial:
            return ""
        self._append(AssistantMessage((TextBlock(partial),), {"interrupted": True}))
        return f"; the {len(partial)} characters that had streamed are kept in the transcript"

    async def _close_open_calls(self, *, keep_unstarted: bool) -> list[ToolUseBlock]:
        """After MidTurn stopped early, give every open tool call its result: what it returned if it
        ran, "outcome unknown" if it was in flight (or left open in flight by an earlier interrupt),
        "not run" if it never started.

        With ``keep_unstarted`` (an interrupt), calls may stay open instead, to run on resume: every
        call when none had started; else each call cut in flight whose tool is ``resumable`` (it runs
        again with the same idempotency key), while the other calls cut in flight are closed
        "outcome unknown" and the finished ones keep their results, for the resumed turn. Returns
        the calls left open (the turn stays pending), or ``[]`` when every call was closed."""
        run = self.run_state
        if not run.pending_calls or (self.ctx.machine.state is not Phase.MID_TURN and not self._answered_with_calls()):
            return []
        answered: set[str] = set()
        for m in reversed(self.ctx.transcript):
            if isinstance(m, ToolResultMessage):
                answered.add(m.tool_call_id)
            elif isinstance(m, AssistantMessage):
                break
        open_calls = [c for c in run.pending_calls if c.id not in answered]
        mt = self.midturn
        if keep_unstarted and not any(c.id in mt.started_ids or c.id in mt.settled for c in open_calls):
            return open_calls
        cut = [c for c in open_calls if c.id in mt.started_ids and c.id not in mt.settled]
        resumable = {c.id for c in cut if getattr(self.ctx.tools.get(c.name), "resumable", False)}
        keep = keep_unstarted and bool(resumable)
        # each call cut in flight of a resumable tool continues on resume; the rest get their results
        results: dict[str, ToolResultMessage] = {}
        for c in open_calls:
            if keep and c.id in resumable:
                continue
            res = mt.settled.get(c.id)
            if res is None:
                entry = self.ledger.get(c.id)
                if c.id in mt.started_ids or (entry is not None and entry.status is LedgerStatus.STARTED):
                    res = ToolResultMessage(c.id, "The run stopped while this tool call was running; its outcome is "
                                            "unknown: it may or may not have taken effect.", is_error=True,
                                            name=c.name, metadata={"synthetic": "interrupted"})
                    await mt.ledger(c, LedgerStatus.INTERRUPTED, res, durable=True)
                else:
                    res = ToolResultMessage(c.id, "The run stopped before this tool call started; it did not run.",
                                            is_error=True, name=c.name, metadata={"synthetic": "not_run"})
                    await mt.ledger(c, LedgerStatus.NOT_RUN, res, durable=False)
            results[c.id] = res
        if keep:
            # the turn stays open: the closed calls keep their results for the resumed MidTurn
            run.decided_results = {**run.decided_results, **results}
            return [c for c in open_calls if c.id in resumable]
        for c in open_calls:
            self._append(results[c.id])
        run.pending_calls = []
        run.decided_results = {}
        return []

    async def _cancel(self, reason: str, note: str = "") -> Outcome:
        """Cancel: compensate side effects that happened (or may have: calls cut in flight), or ask a
        person to confirm them first. A compensation hook may ask for that confirmation too (it
        raises :class:`WaitForHuman`: a sub-agent whose own cancel waits for a person); once the
        person confirmed, each hook runs again with ``ToolContext.decision`` ``approve``."""
        run = self.run_state
        unconfirmed: list[tuple[LedgerEntry, str]] = []
        for entry in list(self.ledger.values()):
            if entry.status not in (LedgerStatus.COMPLETED, LedgerStatus.INTERRUPTED, LedgerStatus.STARTED):
                continue
            side_effect = entry.effect == ToolEffect.SIDE_EFFECT.value
            if not side_effect and not self.midturn.compensable(entry):
                continue
            try:
                if await self.midturn.compensate(entry, confirmed=run.cancel_confirmed):
                    continue
            except WaitForHuman as wait:
                unconfirmed.append((entry, wait.detail))
                continue
            if side_effect and not run.cancel_confirmed:
                unconfirmed.append((entry, "" if entry.status is LedgerStatus.COMPLETED else
                                    "outcome unknown: it was cut while running"))
        if unconfirmed and self.ctx.machine.can_fire(Trigger.WAIT_HUMAN) and self.journal is not None:
            names = ", ".join(f"{e.tool}({e.call_id})" + (f", {why}" if why else "") for e, why in unconfirmed)
            await self.journal.store.push_control(ControlRecord(self.ctx.session_id, ControlKind.CANCEL, reason))
            return Stop(StopReason.WAITING_HUMAN,
                        f"cancel requested, but these side effects happened (or may have) and have no "
                        f"compensation: {names}; confirm to finish cancelling", {"required_decision": "confirm_cancel"})
        return Stop(StopReason.CANCELLED, reason + note)

    # -- PreTurn -------------------------------------------------------------------------
    def budget_exceeded(self) -> tuple[str, str] | None:
        """(budget, detail) of the first exhausted budget in seed 000's order, or ``None``."""
        ctx, run, cfg = self.ctx, self.run_state, self.run_state.config
        if run.turn >= cfg.max_iterations:
            return "iterations", f"iterations budget exhausted: {run.turn} of {cfg.max_iterations} model calls used"
        if cfg.max_wall_clock is not None and ctx.elapsed > cfg.max_wall_clock:
            return "wall_clock", (f"wall-clock budget exhausted: {ctx.elapsed:.1f} s of "
                                  f"{cfg.max_wall_clock:g} s used")
        if cfg.max_tokens is not None and run.usage.total_tokens >= cfg.max_tokens:
            est = " (partly estimated)" if run.usage.estimated else ""
            return "tokens", f"token budget exhausted: {run.usage.total_tokens} of {cfg.max_tokens} tokens used{est}"
        if cfg.max_cost_usd is not None and run.cost_usd is not None and run.cost_usd >= cfg.max_cost_usd:
            return "cost", f"cost budget exhausted: ${run.cost_usd:.4f} of ${cfg.max_cost_usd:.4f} used"
        return None

    async def _pre_turn(self) -> Outcome:
        ctx, run = self.ctx, self.run_state
        controls = await self.take(ControlKind.CANCEL, ControlKind.INTERRUPT, ControlKind.STEER)
        for c in controls:
            if c.kind is ControlKind.CANCEL:
                return await self._cancel(c.text or "cancelled by the user")
        for c in controls:
            if c.kind is ControlKind.INTERRUPT:
                return Stop(StopReason.INTERRUPTED, c.text or "interrupted by the user")
        steers = [c for c in controls if c.kind is ControlKind.STEER]
        for c in steers:  # steer: new direction, verified facts kept, re-plan
            self._append(UserMessage(
                f"New direction from the user: {c.text}\nKeep what has already been verified, "
                "drop what no longer applies, and re-plan the remaining steps."))
            run.goal_version += 1
        if steers and self.journal is not None:
            self.journal.record("goal_changed", {"goal_version": run.goal_version}, run.turn)
            self._checkpoint_state()
            await self.journal.flush(checkpoint=self.journal.checkpoint(run, Phase.PRE_TURN.value))
            await self.journal.store.update_metadata(ctx.session_id, {}, run.goal_version)
        hit = self.budget_exceeded()
        if hit is not None:
            return Stop(StopReason.PAUSED_BUDGET, hit[1], {"budget": hit[0]})
        self._no_prefill()
        ctx.messages = list(ctx.transcript)
        ctx.settings.active_tools = None
        ctx.settings.tools_enabled = True
        ctx.settings.max_output_tokens = run.max_output_override
        await self.chain.pre_turn(ctx)
        return Move(Trigger.CALL_MODEL, f"turn {run.turn + 1}: context of {len(ctx.messages)} messages built")

    def _no_prefill(self) -> None:
        """A history that ends with a plain assistant answer (one cut by an interrupt or the wall
        clock, or a turn continued without a message) would be sent as a prefill, which OpenAI-style
        APIs refuse with HTTP 400: ask the model to go on in a user message instead. A paused turn
        (``pause_turn``) is continued as it is. A turn that holds only reasoning (thinking, encrypted
        reasoning, a summary; no text, no calls) is no answer to continue: nothing is added, and each
        protocol sends such a turn as its rules allow (Chat and Anthropic leave it out, Responses
        drops a reasoning item with no output after it), so the model is asked again."""
        last = self.ctx.transcript[-1] if self.ctx.transcript else None
        if not isinstance(last, AssistantMessage) or last.tool_calls or not _has_answer(last):
            return
        resp = self.run_state.last_response
        cut = bool((last.provider_data or {}).get("interrupted"))
        if not cut and resp is not None and resp.stop_reason is ModelStopReason.PAUSE_TURN:
            return
        self._append(UserMessage("Your previous answer was cut off before it finished; continue from where it "
                                 "stopped." if cut else "Continue."))

    # -- Model ---------------------------------------------------------------------------
    def build_request(self) -> MessageRequest:
        """The next model request from the context and the turn settings."""
        ctx, run, cfg = self.ctx, self.run_state, self.run_state.config
        s = ctx.settings
        tools: tuple[Any, ...] = ()
        if s.tools_enabled and len(ctx.tools):
            tools = ctx.tools.definitions(s.active_tools)
            if len(tools) > MANY_TOOLS and not self._warned_tools:
                self._warned_tools = True
                note = (f"{len(tools)} tools are offered to the model (more than {MANY_TOOLS}); most models "
                        "choose worse from long tool lists: offer fewer (tool_activation, a deny policy)")
                log.warning("session %s: %s", ctx.session_id, note)
                if self.journal is not None:
                    self.journal.record("warning", {"kind": "many_tools", "tools": len(tools), "message": note},
                                        run.turn)
        kw: dict[str, Any] = {}
        if cfg.output_schema is not None:
            kw["output_schema"] = cfg.output_schema
        return MessageRequest(
            model=ctx.provider.model or "",
            messages=tuple(ctx.messages),
            tools=tools,
            tool_choice=cfg.tool_choice if tools else None,
            max_tokens=s.max_output_tokens or cfg.max_output_tokens,
            temperature=cfg.temperature,
            thinking=cfg.thinking,
            **kw,
        )

    async def _provider_call(self, request: MessageRequest, provider: Provider | None = None, *,
                             account: bool = False) -> MessageResponse:
        """One call to ``provider`` (default: the run's), streamed when configured; deltas go to observers.

        ``account``: add the call's usage and cost to the run (for calls made outside the Model phase,
        such as a model-graded verifier's; the Model phase accounts its own call).

        A side call made outside the Model and MidTurn phases (a planner's or a grader's, in PreTurn
        or PostTurn) runs as a task the control watcher cancels, as it cancels the Model phase's call:
        an Interrupt or a Cancel cuts it within one ``control_poll`` and ends the run (INTERRUPTED or
        CANCELLED, from the phase the call was made in), and no further model call starts. The cut
        call's tokens count as estimated (with ``account``), and a ``model_call_interrupted`` event
        with ``side_call: true`` is logged. Inside the Model or MidTurn phase, the phase's own task
        carries the cancellation."""
        provider = provider or self.ctx.provider
        streamed: list[str] = []
        if self._phase_task is not None:
            # in the Model phase a side call (a fallback provider's) streams the answer in flight:
            # its text is what an Interrupt keeps, and a failure of it drops it
            in_model = self.ctx.machine.state is Phase.MODEL
            response = await self._call(request, provider, None if in_model else streamed)
        else:
            try:
                response = await self._in_task(self._call(request, provider, streamed))
            except _ControlHit:
                self._control_pending = True  # honoured even if the middleware catches the signal
                run = self.run_state
                if account:
                    run.usage = run.usage + Usage(count_message_tokens(request.messages),
                                                  count_tokens("".join(streamed)), estimated=True)
                if self.journal is not None:
                    self.journal.record("model_call_interrupted",
                                        {"streamed_chars": sum(len(t) for t in streamed), "side_call": True,
                                         "phase": self.ctx.state_name}, run.turn)
                raise
        if account:
            self._account(request, response)
        return response

    async def _call(self, request: MessageRequest, provider: Provider,
                    streamed: list[str] | None = None) -> MessageResponse:
        """One provider call, streamed when configured. Text deltas are collected in ``streamed``
        (default: :attr:`_streamed`, the Model phase's call in flight). A call that fails takes its
        streamed text with it: it is not an answer (kept only as :attr:`_failed_partial`, for the stop)."""
        if not (self.run_state.config.stream and provider.capabilities.streaming):
            return await provider.chat(request)
        if streamed is None:
            streamed = self._streamed = []
        try:
            return await self._stream(request, provider, streamed)
        except Exception:
            if streamed is self._streamed:
                self._failed_partial = "".join(streamed)
                streamed.clear()
            raise

    async def _stream(self, request: MessageRequest, provider: Provider, streamed: list[str]) -> MessageResponse:
        ctx = self.ctx
        final: MessageResponse | None = None
        wants = self.bus.wants(ModelStreamEvent)
        chain = self.chain
        has_filters = chain.filters_model_events
        stream = provider.chat_stream(request)
        try:
            async for event in stream:
                if type(event) is TextDelta:
                    streamed.append(event.text)
                elif isinstance(event, MessageComplete):
                    final = event.full_response
                if has_filters:
                    out = chain.model_event(event, ctx)
                    if out is None:
                        continue
                    event = out
                if wants:
                    await self.bus.emit(ModelStreamEvent(ctx.session_id, self.run_state.turn, event,
                                                         ctx.state_name))
        finally:
            if isinstance(stream, AsyncGenerator):  # typed AsyncIterator; providers are generators
                await stream.aclose()
        if final is None:  # pragma: no cover - providers always end with MessageComplete or raise
            raise ProviderError("the stream ended without a complete message", provider=getattr(provider, "name", None))
        return final

    def _inner_call(self, request: MessageRequest) -> Any:
        return self._call(request, self.ctx.provider)

    async def _model(self) -> Outcome:
        ctx, run = self.ctx, self.run_state
        run.turn += 1
        request = self._request = self.build_request()
        self._start_turn(request)
        self._streamed = []
        self._failed_partial = ""
        run.max_output_override = None
        remaining = ctx.remaining_wall_clock
        token = call_deadline.set(time.monotonic() + remaining) if remaining is not None else None
        listening = retry_listener.set(self._on_retry)
        clock: asyncio.Timeout | None = None
        try:
            if remaining is None:
                response = await self.chain.model_call(request, ctx, self._inner_call)
            else:
                async with asyncio.timeout(remaining) as clock:
                    response = await self.chain.model_call(request, ctx, self._inner_call)
        except TimeoutError as exc:
            if clock is None or not clock.expired():
                if isinstance(exc, ProviderError):
                    return self._provider_failed(exc)
                raise
            kept = self._keep_interrupted_answer()
            cfg = run.config
            return Stop(StopReason.PAUSED_BUDGET, f"wall-clock budget exhausted during the model call: "
                        f"{ctx.elapsed:.1f} s of {cfg.max_wall_clock:g} s used{kept}", {"budget": "wall_clock"})
        except ContextLengthExceededError as exc:
            if not run.context_retry:
                run.context_retry = True
                if exc.max_tokens_requested is not None and exc.limit and exc.input_tokens:
                    run.max_output_override = max(1, exc.limit - exc.input_tokens)
                self._end_turn()
                return Move(Trigger.RETRY_CONTEXT, f"context length exceeded; re-trimming and retrying once ({exc})")
            return Stop(StopReason.FAILED_TERMINAL, f"context length exceeded even after re-trimming: {exc}",
                        {"error": exc.to_info()})
        except ProviderError as exc:
            return self._provider_failed(exc)
        finally:
            retry_listener.reset(listening)
            if token is not None:
                call_deadline.reset(token)
        self._request = None
        run.context_retry = False
        response = _unique_call_ids(response, ctx.transcript)
        cost = self._account(request, response)
        if response.tool_calls and response.stop_reason is ModelStopReason.MAX_TOKENS:
            return self._cut_off(request, response, cost)
        run.output_retry = False
        run.last_response = response
        self._append(response.message)
        info = {"model": response.model, "provider": response.provider, "stop_reason": response.stop_reason.value,
                "raw_stop_reason": response.raw_stop_reason,
                "usage": unstructure(response.usage) if response.usage else None, "cost_usd": cost}
        if self.journal is not None:
            ref = self._turn.get("context") if self._turn else None
            self.journal.record("model_call", {**info, "context": unstructure(ref) if ref else None}, run.turn)
        if self._turn is not None:
            self._turn["model_call"] = info
            self._turn["tool_calls"] = [c.id for c in response.tool_calls]
        stop = response.stop_reason
        if response.tool_calls:
            run.pending_calls = list(response.tool_calls)
            return Move(Trigger.TOOL_USE, f"model stop reason {stop.value}: {len(response.tool_calls)} tool call(s)")
        if stop is ModelStopReason.CONTENT_FILTERED:
            return Stop(StopReason.FAILED_TERMINAL, "the provider's content filter blocked the answer",
                        {"error": {"kind": "content_filtered", "message": response.refusal or ""}})
        if stop is ModelStopReason.REFUSAL or (response.refusal and not response.text.strip()):
            return Stop(StopReason.FAILED_TERMINAL, f"the model refused: {response.refusal or 'no reason given'}",
                        {"error": {"kind": "refusal", "message": response.refusal or ""}})
        return Move(Trigger.MODEL_DONE, f"model stop reason {stop.value}")

    def _cut_off(self, request: MessageRequest, response: MessageResponse, cost: float | None) -> Outcome:
        """The output-token limit cut the answer while it was writing tool calls: the last call's
        arguments are incomplete. No call of this turn runs and the model is never shown the cut
        call. The turn is discarded (its usage still counts) and the call is made once more with
        twice the limit, bounded by the token budget; when that is used up (or cannot grow), the run
        stops FAILED_RETRYABLE with error code ``tool_call_truncated``."""
        run, cfg = self.run_state, self.run_state.config
        cap = self.ctx.provider.capabilities.max_output_tokens
        # the limit the answer met: the request's; without one, what the profile sends in its place,
        # else the server's default, which the cut answer's reported output shows (else the model's
        # maximum, else a guess)
        sent = getattr(getattr(self.ctx.provider, "profile", None), "default_max_tokens", None)
        reported = response.usage.output_tokens if response.usage is not None and not response.usage.estimated else 0
        used = request.max_tokens or sent or reported or cap or 4096
        larger = used * 2
        if cfg.max_tokens is not None:
            larger = min(larger, cfg.max_tokens - run.usage.total_tokens)
        if cap is not None:
            larger = min(larger, cap)
        names = ", ".join(c.name for c in response.tool_calls)
        if self.journal is not None:
            self.journal.record("model_call", {
                "model": response.model, "provider": response.provider, "stop_reason": response.stop_reason.value,
                "raw_stop_reason": response.raw_stop_reason, "cost_usd": cost, "discarded": "tool_call_truncated",
                "usage": unstructure(response.usage) if response.usage else None, "max_tokens": request.max_tokens},
                run.turn)
        if not run.output_retry and larger > used:
            run.output_retry = True
            run.max_output_override = larger
            self._end_turn(verification=f"tool call(s) {names} cut off at {used} output tokens; discarded")
            return Move(Trigger.RETRY_OUTPUT, f"the output limit ({used} tokens) cut off tool call(s) {names}; "
                        f"retrying once with {larger}")
        if run.output_retry:
            why, step = ("even after one retry with a larger limit",
                         "raise max_output_tokens (or the token budget) and resume")
        elif cap is not None and used >= cap:
            why, step = (f"and that is the model's own maximum ({cap})",
                         "the call does not fit one answer of this model: resume with a Steer asking for smaller "
                         "steps, or use a model with a larger output limit")
        else:
            why, step = ("and the limit cannot grow within the budget",
                         "raise the token budget (max_tokens) or max_output_tokens and resume")
        run.output_retry = False
        return Stop(StopReason.FAILED_RETRYABLE,
                    f"the output-token limit ({used}) cut off tool call(s) {names} {why}; none of them ran — {step}",
                    {"error": {"kind": "output_truncated", "code": "tool_call_truncated", "max_tokens": used,
                               "message": f"tool call(s) {names} cut off by the output-token limit"}})

    def _provider_failed(self, exc: ProviderError) -> Stop:
        """The stop of a model call the provider failed (after every retry). A failure is not an
        answer, on any protocol and whatever cut it (an ``error`` event after some text, an
        ``{"error": ...}`` chunk, a dropped connection): nothing that streamed enters the
        conversation and nothing of the call is counted as an answer's usage, so a resume (or an
        in-run retry) asks again from the same history. The streamed text rides the stop as
        ``partial``, for the user; a ``model_call_failed`` event records the call."""
        reason = StopReason.FAILED_RETRYABLE if exc.retryable else StopReason.FAILED_TERMINAL
        partial = self._failed_partial or "".join(self._streamed)
        self._streamed = []
        self._failed_partial = ""
        self._request = None
        if self.journal is not None:
            self.journal.record("model_call_failed", {"kind": exc.kind, "status": exc.status,
                                                      "streamed_chars": len(partial)}, self.run_state.turn)
        note = (f"; the {len(partial)} characters that had streamed are not part of the conversation (stop.partial "
                "has them): a resume asks again" if partial else "")
        payload: dict[str, Any] = {"error": exc.to_info()}
        if partial:
            payload["partial"] = partial
        return Stop(reason, f"model call failed: {exc}{note}", payload)

    async def _on_retry(self, exc: ProviderError, attempt: int, delay_s: float) -> None:
        """The provider is about to retry an HTTP attempt of the model call (its ``retry_listener``):
        a ``model_retry`` event for the session log and the observers, delivered before the wait. The
        failed attempt's streamed text is dropped (a stream retried after content restarts the answer)."""
        self._streamed.clear()
        self.ctx.emit(ModelRetry(self.ctx.session_id, self.run_state.turn, attempt, exc.status, exc.kind,
                                 exc.message[:2000], delay_s, server_hint=exc.retry_after is not None,
                                 provider=exc.provider))
        await self._flush_outbox()

    def _account(self, request: MessageRequest, response: MessageResponse) -> float | None:
        """Add the call's usage and cost to the run; returns the call's cost (USD, ``None`` if unknown)."""
        run = self.run_state
        usage = response.usage
        if usage is None:  # case B12: unknown usage is estimated and flagged, never zero
            out_text = response.text + response.thinking + "".join(
                c.name + str(c.input) for c in response.tool_calls)
            usage = Usage(count_message_tokens(request.messages), count_tokens(out_text), estimated=True)
        run.usage = run.usage + usage
        model = response.model or request.model
        cost = self.cost_of(model, usage) if self.cost_of is not None else None
        if self.cost_of is not None and run.cost_usd is not None:
            run.cost_usd = None if cost is None else run.cost_usd + cost
            if cost is None and run.config.max_cost_usd is not None:
                note = (f"the cost budget (${run.config.max_cost_usd:g}) cannot be enforced: model {model!r} has no "
                        "known price (fsm_agent.pricing.register_price adds one); the other budgets still apply")
                log.warning("session %s: %s", self.ctx.session_id, note)
                if self.journal is not None:
                    self.journal.record("warning", {"kind": "cost_unknown", "model": model, "message": note}, run.turn)
        return cost

    # -- PostTurn ------------------------------------------------------------------------
    async def _post_turn(self) -> Outcome:
        ctx, run = self.ctx, self.run_state
        resp = run.last_response
        schema = run.config.output_schema
        if schema is not None and resp is not None and not resp.tool_calls \
                and resp.stop_reason is not ModelStopReason.PAUSE_TURN:
            checked = self._check_output(resp, schema)
            if checked is not None:
                return checked
        decision = await self.chain.turn_decision(ctx)
        if decision is not None:
            name, d = decision
            if isinstance(d, Complete):
                followed = await self._followup()
                if followed is not None:
                    return followed
                run.evidence.extend(d.evidence)
                verdict = f"{d.detail} (decided by {name})"
                self._verdict = verdict
                return Stop(StopReason.COMPLETED, verdict, {"evidence_refs": d.evidence})
            if isinstance(d, Continue):
                if d.message is not None:
                    self._append(d.message)
                self._end_turn(verification=f"continue: {d.reason} (decided by {name})")
                return Move(Trigger.NEXT_TURN, f"{d.reason} (decided by {name})")
        if resp is None or resp.tool_calls or resp.stop_reason is ModelStopReason.PAUSE_TURN:
            self._end_turn()
            return Move(Trigger.NEXT_TURN, "tool results are in; continue" if resp and resp.tool_calls
                        else "model paused its turn; continue")
        followed = await self._followup()
        if followed is not None:
            return followed
        if resp.stop_reason is ModelStopReason.MAX_TOKENS:
            return Stop(StopReason.COMPLETED, "the answer was cut at the output token limit (max_tokens); "
                        "it is partial — raise max_output_tokens for a full answer")
        return Stop(StopReason.COMPLETED, f"the model ended its turn ({resp.stop_reason.value}) with no tool calls")

    def _check_output(self, resp: MessageResponse, schema: Any) -> Outcome | None:
        """Check the answer against the output schema: ``None`` when it holds (the value is kept for
        the result); one repair turn on the first mismatch; a typed stop on the second."""
        from ..structured import parse_output, repair_message

        run = self.run_state
        parsed = parse_output(resp, schema)
        if parsed.error is None:
            run.metadata["output_data"] = parsed.value
            run.structured_repair = False
            return None
        if self.journal is not None:
            self.journal.record("output_invalid", {"error": parsed.error, "repair": not run.structured_repair},
                                run.turn)
        if not run.structured_repair:
            run.structured_repair = True
            self._append(UserMessage(repair_message(parsed)))
            self._end_turn(verification=f"output schema {schema.name!r} not met: {parsed.error}; one repair turn")
            return Move(Trigger.NEXT_TURN, "the answer does not match the output schema; asking once for a repair")
        return Stop(StopReason.FAILED_TERMINAL, f"the answer does not match the output schema {schema.name!r} "
                    f"after one repair turn: {parsed.error}",
                    {"error": {"kind": "structured_output_invalid", "message": parsed.error}})

    async def _followup(self) -> Outcome | None:
        """Queued followups run after the current task would complete: append and continue."""
        followups = await self.take(ControlKind.FOLLOWUP)
        if not followups:
            return None
        for f in followups:
            self._append(UserMessage(f.text))
        self._end_turn(verification="followup queued by the user")
        return Move(Trigger.NEXT_TURN, f"{len(followups)} followup request(s) queued by the user")


def _has_answer(message: AssistantMessage) -> bool:
    """Whether an assistant message holds anything but reasoning (non-blank text, a call, a server
    tool block ...): reasoning alone is not an answer."""
    return any(not isinstance(b, (TextBlock, ThinkingBlock)) or (isinstance(b, TextBlock) and b.text.strip())
               for b in message.content)


def _unique_call_ids(response: MessageResponse, transcript: list[Message]) -> MessageResponse:
    """Give every tool call of ``response`` an id unused so far in the session.

    Some servers number calls ``call_0`` in every turn, or send empty or repeated ids; the ledger
    and the transcript key results by id, so a reused id would make a new call look already done.
    Renaming happens before anything is recorded, so resumes see the same ids.
    """
    calls = response.tool_calls
    if not calls:
        return response
    used = {b.id for m in transcript if isinstance(m, AssistantMessage) for b in m.tool_calls}
    seen: set[str] = set()
    renamed = False
    blocks = []
    for b in response.message.content:
        if isinstance(b, ToolUseBlock):
            if not b.id or b.id in used or b.id in seen:
                b = evolve(b, id=f"call_{uuid.uuid4().hex[:24]}")
                renamed = True
            seen.add(b.id)
        blocks.append(b)
    if not renamed:
        return response
    return evolve(response, message=evolve(response.message, content=tuple(blocks)))

