"""The loop: one explicit function that runs each phase's work and fires the triggers.

The ``transitions`` machine only checks that each move is a row of the table;
everything else happens here, between triggers. Phases:

* **PreTurn** — control events (interrupt, cancel, steer) → budgets (seed 000
  order: shutdown, iterations, wall clock, tokens, cost) → context built from
  the transcript → PreTurn middleware → ``call_model``.
* **Model** — the ``wrap_model_call`` chain around one provider call (streamed:
  every event passes ``on_model_event`` and then the observers) → usage and
  cost → route on the response: tool calls → ``tool_use``; end of turn, stop
  sequence, max tokens, pause → ``model_done``; content filtered or refused →
  ``fail_terminal``; a provider error → ``fail_retryable`` / ``fail_terminal``;
  a context-window error → ``retry_context`` once (case B20).
* **MidTurn** — per call, through the tool-call ledger: a call already
  completed (a resume) is never run again; a side-effect call found started but
  unfinished (a crash) is reconciled by its tool or put to a person; the others
  get policy decisions (``on_tool_call``) or a person's decision (a resume) and
  run in parallel inside the ``wrap_tool_call`` chain, each ledger state written
  before the step it names → results in call order → ``tools_done``; or
  ``wait_human`` when a call needs a decision.
* **PostTurn** — ``post_turn`` decisions (verifier) → queued followups →
  ``complete`` or ``next_turn``.

Model and MidTurn run as tasks a control watcher can cancel, so an Interrupt or
Cancel from another process stops a stream or a tool mid-flight. Middleware
``call_next`` chains stay inside one task (``contextvars`` hold).

A middleware raising :class:`~fsm_agent.errors.StopRun` ends the run with its
StopReason; a fail-closed middleware failure ends it FAILED_TERMINAL. The
result always names a StopReason: the driver never lets an exception out,
except ``asyncio.CancelledError`` (after recording INTERRUPTED) and
:class:`~fsm_agent.errors.LeaseLost` (another worker owns the session now).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from attrs import evolve

from ..chain import MiddlewareChain
from ..errors import ContextLengthExceededError, LeaseLost, MiddlewareError, ProviderError, StopRun, ToolArgumentsError
from ..hooks import HookBus
from ..middleware import AskApproval, Complete, Continue, Deny, Edit, Respond
from ..providers.base import call_deadline
from ..store.base import ControlKind, LedgerStatus
from ..tools.execution import execute_tool_call, idempotency_key
from ..tools.registry import RUN_AGAIN, ToolContext, ToolEffect
from ..types.codec import structure, unstructure
from ..types.content import ToolUseBlock
from ..types.events import ApprovalRequested, ModelStreamEvent, ToolFinished, ToolStarted, TransitionEvent
from ..types.messages import AssistantMessage, Message, ModelStopReason, ToolResultMessage, Usage, UserMessage
from ..types.requests import MessageRequest, MessageResponse
from ..types.run import PendingAction, RunResult, RunStop, StopReason
from ..types.content import TextBlock
from ..types.stream import MessageComplete, TextDelta
from ..types.tokens import count_message_tokens, count_tokens
from .context import RunContext
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

_MIDPHASE_CONTROLS = (ControlKind.INTERRUPT, ControlKind.CANCEL)


class _ControlHit(Exception):
    """Raised inside the driver when the watcher cancelled a phase for a control event."""


class Driver:
    """Runs one session from its current state to a terminal state.

    Args:
        ctx: the run context (transcript, budgets, provider, tools).
        chain: the middleware chain (frozen by the agent before the run).
        bus: the observer bus.
        cost_of: ``(model, usage) -> USD or None`` (the pricing table).
        journal: writes events, checkpoints and ledger entries to the session's store.
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
        journal: Any = None,
        control_poll: float = 0.5,
        lease_ttl: float = 30.0,
    ) -> None:
        self.ctx = ctx
        self.chain = chain
        self.bus = bus
        self.cost_of = cost_of
        self.journal = journal
        self.control_poll = control_poll
        self.lease_ttl = lease_ttl
        self.stop: RunStop | None = None
        self._phase_task: asyncio.Task[Any] | None = None
        self._control_hit = False
        self._request: MessageRequest | None = None
        """The model request in flight (for accounting an interrupted call)."""
        self._streamed: list[str] = []
        """Text deltas of the model call in flight."""
        self._started_ids: set[str] = set()
        """Tool calls of the current MidTurn that started executing."""
        self._done_results: dict[str, ToolResultMessage] = {}
        """Results of the current MidTurn's executed calls, by call id."""
        ctx.call_provider = self._provider_call

    # -- transitions and persistence ---------------------------------------------------
    async def _flush_outbox(self) -> None:
        """Deliver observer events middleware queued with ``ctx.emit`` (and log them in the session)."""
        while self.ctx.outbox:
            event = self.ctx.outbox.pop(0)
            if self.journal is not None:
                self.journal.record(getattr(event, "TAG", type(event).__name__), unstructure(event), self.ctx.turn)
            await self.bus.emit(event)

    async def _fire(self, trigger: Trigger, reason: str) -> None:
        await self._flush_outbox()
        ctx = self.ctx
        before = ctx.machine.state
        after = ctx.machine.fire(trigger)
        event = TransitionEvent(ctx.session_id, ctx.turn, before.value, trigger.value, after.value, reason, time.time())
        j = self.journal
        if j is not None:
            j.record("transition", {"from": before.value, "trigger": trigger.value, "to": after.value,
                                    "reason": reason}, ctx.turn)
            if after is Phase.PRE_TURN or (after is Phase.MID_TURN and not self._all_pure(ctx.pending_calls)):
                # A MidTurn checkpoint pins the model's tool calls before any of them runs; when every
                # call is pure, a crash can only make the model answer again, so it rides the next commit.
                await j.flush(checkpoint=j.checkpoint(ctx, after.value), state=after.value)
            elif isinstance(after, StopReason):
                assert self.stop is not None
                stop = unstructure(self.stop)
                j.record("run_stopped", {"stop": stop}, ctx.turn)
                safe = self.stop.last_safe_point or after.value
                ck = j.checkpoint(ctx, safe)
                self.stop = evolve(self.stop, checkpoint_id=ck.checkpoint_id)
                await j.flush(checkpoint=ck, state=after.value, stop=unstructure(self.stop))
        await self.bus.emit(event)

    def _append(self, message: Message) -> None:
        self.ctx.transcript.append(message)
        if self.journal is not None:
            self.journal.message(message, self.ctx.turn)

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
            evidence_refs=tuple(payload.pop("evidence_refs", ())) or tuple(self.ctx.evidence),
            **payload,
        )
        await self._fire(trigger, detail)

    # -- the loop ------------------------------------------------------------------------
    async def run(self, first: Trigger | None = Trigger.START, reason: str = "start") -> RunResult:
        """Drive the session to a terminal state. ``first=None`` continues from the current state
        (crash recovery at a checkpoint)."""
        ctx = self.ctx
        started = time.monotonic()
        watcher = asyncio.ensure_future(self._watch()) if self.journal is not None else None
        try:
            await self.chain.run_lifecycle("on_run_start", ctx)
            if first is not None:
                await self._fire(first, reason)
            while not ctx.machine.is_terminal:
                state = ctx.machine.state
                await self._flush_outbox()
                try:
                    if state is Phase.PRE_TURN:
                        await self._pre_turn()
                    elif state is Phase.MODEL:
                        await self._in_task(self._model())
                    elif state is Phase.MID_TURN:
                        await self._in_task(self._mid_turn())
                    elif state is Phase.POST_TURN:
                        await self._post_turn()
                    else:  # pragma: no cover - the table has no other non-terminal states
                        raise RuntimeError(f"driver reached unexpected state {state!r}")
                except _ControlHit:
                    await self._mid_phase_control()
                except StopRun as sig:
                    await self._end(StopReason(sig.reason), sig.detail or f"stopped by middleware: {sig.reason}",
                                    **sig.payload)
                except MiddlewareError as exc:
                    await self._end(StopReason.FAILED_TERMINAL, str(exc),
                                    error={"kind": "middleware", "middleware": exc.middleware, "hook": exc.hook,
                                           "message": str(exc)})
        except asyncio.CancelledError:
            if not ctx.machine.is_terminal and ctx.machine.can_fire(Trigger.INTERRUPT):
                await asyncio.shield(self._end(StopReason.INTERRUPTED, "the run's task was cancelled"))
            raise
        except LeaseLost:
            log.error("session %s: lease lost to another worker; stopping without writing", ctx.session_id)
            raise
        except Exception as exc:  # noqa: BLE001 - a run always ends with a StopReason
            log.exception("internal error in the driver")
            if not ctx.machine.is_terminal:
                if ctx.machine.can_fire(Trigger.FAIL_TERMINAL):
                    await self._end(StopReason.FAILED_TERMINAL, f"internal error: {type(exc).__name__}: {exc}",
                                    error={"kind": "internal", "message": str(exc)})
                else:
                    self.stop = RunStop(StopReason.FAILED_TERMINAL, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
        result = self._result(time.monotonic() - started)
        try:
            await self.chain.run_lifecycle("on_run_end", ctx, result)
        except (MiddlewareError, StopRun) as exc:
            log.error("on_run_end failed after the run ended: %s", exc)
        await self._flush_outbox()
        return result

    async def _in_task(self, coro: Any) -> None:
        """Run a phase so that the control watcher can cancel it (Interrupt/Cancel mid-phase)."""
        if self.journal is None:
            await coro
            return
        task = asyncio.ensure_future(coro)
        self._phase_task = task
        try:
            await task
        except asyncio.CancelledError:
            if self._control_hit:
                self._control_hit = False
                raise _ControlHit() from None
            raise
        finally:
            self._phase_task = None

    async def _watch(self) -> None:
        """Renew the lease and look for Interrupt/Cancel while a phase runs."""
        j = self.journal
        store = j.store
        ctx = self.ctx
        last_renew = time.monotonic()
        while True:
            await asyncio.sleep(self.control_poll)
            if j.owner is not None and time.monotonic() - last_renew > self.lease_ttl / 3:
                if not await store.acquire_lease(ctx.session_id, j.owner, self.lease_ttl):
                    log.error("session %s: could not renew the lease", ctx.session_id)
                last_renew = time.monotonic()
            task = self._phase_task
            if task is not None and not task.done() and await store.peek_controls(ctx.session_id, _MIDPHASE_CONTROLS):
                self._control_hit = True
                task.cancel()

    def _result(self, duration: float) -> RunResult:
        ctx = self.ctx
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
            usage=ctx.usage,
            turns=ctx.turn,
            tool_calls=ctx.tool_calls_made,
            model_stop_reason=ctx.last_response.stop_reason if ctx.last_response else None,
            cost_usd=ctx.cost_usd,
            duration_s=duration,
        )

    # -- control events ----------------------------------------------------------------------
    async def _take(self, *kinds: ControlKind) -> list[Any]:
        if self.journal is None:
            return []
        taken = await self.journal.store.take_controls(self.ctx.session_id, kinds)
        for c in taken:
            self.journal.record("control", {"kind": c.kind.value, "text": c.text, "control_id": c.control_id},
                                self.ctx.turn)
        return list(taken)

    async def _mid_phase_control(self) -> None:
        """An Interrupt or Cancel arrived while the model or tools ran (the phase was cancelled)."""
        ctx = self.ctx
        controls = await self._take(*_MIDPHASE_CONTROLS)
        cancel = next((c for c in controls if c.kind is ControlKind.CANCEL), None)
        interrupt = next((c for c in controls if c.kind is ControlKind.INTERRUPT), None)
        during = ctx.machine.state
        kept = self._keep_interrupted_answer() if during is Phase.MODEL else ""
        pending = self._close_open_calls(keep_unstarted=cancel is None)
        if cancel is not None:
            await self._cancel(cancel.text or "cancelled by the user")
            return
        text = (interrupt.text if interrupt is not None else "") or "interrupted by the user"
        if during is Phase.MODEL:
            await self._end(StopReason.INTERRUPTED, f"{text} (during Model{kept})")
            return
        if pending:
            await self._end(StopReason.INTERRUPTED, f"{text} (before the tool calls started)",
                            pending_actions=tuple(PendingAction(c, "interrupted") for c in pending),
                            last_safe_point=Phase.MID_TURN.value)
        else:
            await self._end(StopReason.INTERRUPTED, f"{text} (during {ctx.machine.state.value})")

    def _keep_interrupted_answer(self) -> str:
        """A model call was interrupted: keep the text that had streamed (as an assistant message marked
        ``interrupted``) and count the call's tokens as an estimate. Returns a note for the stop detail."""
        ctx = self.ctx
        partial = "".join(self._streamed)
        request = self._request
        if request is not None:
            ctx.usage = ctx.usage + Usage(count_message_tokens(request.messages), count_tokens(partial), estimated=True)
        if self.journal is not None:
            self.journal.record("model_call_interrupted", {"streamed_chars": len(partial)}, ctx.turn)
        if not partial:
            return ""
        self._append(AssistantMessage((TextBlock(partial),), {"interrupted": True}))
        return f"; the {len(partial)} characters that had streamed are kept in the transcript"

    def _close_open_calls(self, *, keep_unstarted: bool) -> list[ToolUseBlock]:
        """After an interrupted MidTurn: calls with no result get a synthetic one, except (when
        ``keep_unstarted`` and nothing started) calls that can simply run on resume."""
        ctx = self.ctx
        if ctx.machine.state is not Phase.MID_TURN:
            return []
        calls = list(ctx.pending_calls)
        answered = {m.tool_call_id for m in ctx.transcript if isinstance(m, ToolResultMessage)}
        open_calls = [c for c in calls if c.id not in answered]
        started = self._started_ids
        if keep_unstarted and not any(c.id in started for c in open_calls):
            return open_calls
        done = self._done_results
        for c in calls:
            if c.id in answered:
                continue
            res = done.get(c.id) or ToolResultMessage(
                c.id, "The tool call was interrupted before it finished; its outcome is unknown.",
                is_error=True, name=c.name, metadata={"synthetic": "interrupted"})
            self._append(res)
        ctx.pending_calls = []
        return []

    async def _cancel(self, reason: str) -> None:
        """Cancel: compensate completed side effects, or ask a person to confirm them first."""
        ctx = self.ctx
        unconfirmed = []
        if self.journal is not None:
            ledger = await self.journal.store.ledger(ctx.session_id)
            for entry in ledger.values():
                if entry.effect != ToolEffect.SIDE_EFFECT.value or entry.status is not LedgerStatus.COMPLETED:
                    continue
                tool = ctx.tools.get(entry.tool)
                if tool is not None and tool.compensate is not None:
                    tctx = ToolContext(entry.call_id, entry.idempotency_key, ctx.session_id, entry.turn, entry.tool)
                    out = tool.compensate(entry.arguments, entry.result, tctx)
                    if inspect.isawaitable(out):
                        await out
                    self.journal.record("compensated", {"call_id": entry.call_id, "tool": entry.tool}, ctx.turn)
                    await self.journal.ledger(evolve(entry, status=LedgerStatus.REJECTED, updated_at=time.time()))
                elif not ctx.cancel_confirmed:
                    unconfirmed.append(entry)
        if unconfirmed and ctx.machine.can_fire(Trigger.WAIT_HUMAN):
            names = ", ".join(f"{e.tool}({e.call_id})" for e in unconfirmed)
            await self.journal.store.push_control(_control(ctx.session_id, ControlKind.CANCEL, reason))
            await self._end(StopReason.WAITING_HUMAN,
                            f"cancel requested, but these side effects already happened and have no compensation: "
                            f"{names}; confirm to finish cancelling",
                            required_decision="confirm_cancel")
            return
        await self._end(StopReason.CANCELLED, reason)

    # -- PreTurn -------------------------------------------------------------------------
    def budget_exceeded(self) -> tuple[str, str] | None:
        """(budget, detail) of the first exhausted budget in seed 000's order, or ``None``."""
        ctx, cfg = self.ctx, self.ctx.config
        if ctx.turn >= cfg.max_iterations:
            return "iterations", f"iterations budget exhausted: {ctx.turn} of {cfg.max_iterations} model calls used"
        if cfg.max_wall_clock is not None and ctx.elapsed > cfg.max_wall_clock:
            return "wall_clock", (f"wall-clock budget exhausted: {ctx.elapsed:.1f} s of "
                                  f"{cfg.max_wall_clock:g} s used")
        if cfg.max_tokens is not None and ctx.usage.total_tokens >= cfg.max_tokens:
            est = " (partly estimated)" if ctx.usage.estimated else ""
            return "tokens", f"token budget exhausted: {ctx.usage.total_tokens} of {cfg.max_tokens} tokens used{est}"
        if cfg.max_cost_usd is not None and ctx.cost_usd is not None and ctx.cost_usd >= cfg.max_cost_usd:
            return "cost", f"cost budget exhausted: ${ctx.cost_usd:.4f} of ${cfg.max_cost_usd:.4f} used"
        return None

    async def _pre_turn(self) -> None:
        ctx = self.ctx
        controls = await self._take(ControlKind.CANCEL, ControlKind.INTERRUPT, ControlKind.STEER)
        for c in controls:
            if c.kind is ControlKind.CANCEL:
                await self._cancel(c.text or "cancelled by the user")
                return
        for c in controls:
            if c.kind is ControlKind.INTERRUPT:
                await self._end(StopReason.INTERRUPTED, c.text or "interrupted by the user")
                return
        for c in controls:  # steer: new direction, verified facts kept, re-plan
            self._append(UserMessage(
                f"New direction from the user: {c.text}\nKeep what has already been verified, "
                "drop what no longer applies, and re-plan the remaining steps."))
            ctx.goal_version += 1
        hit = self.budget_exceeded()
        if hit is not None:
            await self._end(StopReason.PAUSED_BUDGET, hit[1], budget=hit[0])
            return
        ctx.messages = list(ctx.transcript)
        await self.chain.run_pre_turn(ctx)
        await self._fire(Trigger.CALL_MODEL, f"turn {ctx.turn + 1}: context of {len(ctx.messages)} messages built")

    # -- Model ---------------------------------------------------------------------------
    def build_request(self) -> MessageRequest:
        ctx, cfg = self.ctx, self.ctx.config
        tools: tuple[Any, ...] = ()
        if ctx.tools_enabled and len(ctx.tools):
            tools = ctx.tools.definitions(ctx.active_tools)
        return MessageRequest(
            model=ctx.provider.model or "",
            messages=tuple(ctx.messages),
            tools=tools,
            tool_choice=cfg.tool_choice if tools else None,
            max_tokens=ctx.max_output_override or cfg.max_output_tokens,
            temperature=cfg.temperature,
            thinking=cfg.thinking,
        )

    async def _provider_call(self, request: MessageRequest, provider: Any = None, *,
                             account: bool = False) -> MessageResponse:
        """One call to ``provider`` (default: the run's), streamed when configured; deltas go to observers.

        ``account``: add the call's usage and cost to the run (for calls made outside the Model phase,
        such as a model-graded verifier's; the Model phase accounts its own call)."""
        response = await self._call(request, provider or self.ctx.provider)
        if account:
            self._account(request, response)
        return response

    async def _call(self, request: MessageRequest, provider: Any) -> MessageResponse:
        ctx = self.ctx
        if not (ctx.config.stream and provider.capabilities.streaming):
            response: MessageResponse = await provider.chat(request)
            return response
        final: MessageResponse | None = None
        streamed = self._streamed = []
        wants = self.bus.wants(ModelStreamEvent)
        has_filters = bool(self.chain.hooks("on_model_event"))
        stream = provider.chat_stream(request)
        try:
            async for event in stream:
                if type(event) is TextDelta:
                    streamed.append(event.text)
                elif isinstance(event, MessageComplete):
                    final = event.full_response
                if has_filters:
                    event = self.chain.model_event(event, ctx)
                    if event is None:
                        continue
                if wants:
                    await self.bus.emit(ModelStreamEvent(ctx.session_id, ctx.turn, event))
        finally:
            await stream.aclose()
        if final is None:  # pragma: no cover - providers always end with MessageComplete or raise
            raise ProviderError("the stream ended without a complete message", provider=getattr(provider, "name", None))
        return final

    async def _model(self) -> None:
        ctx = self.ctx
        ctx.turn += 1
        request = self._request = self.build_request()
        self._streamed = []
        ctx.max_output_override = None
        call = self.chain.wrap("wrap_model_call", lambda req: self._provider_call(req), ctx)
        token = None
        if ctx.config.max_wall_clock is not None:
            token = call_deadline.set(time.monotonic() + max(0.0, ctx.config.max_wall_clock - ctx.elapsed))
        try:
            response: MessageResponse = await call(request)
        except ContextLengthExceededError as exc:
            if not ctx.context_retry:
                ctx.context_retry = True
                if exc.max_tokens_requested is not None and exc.limit and exc.input_tokens:
                    ctx.max_output_override = max(1, exc.limit - exc.input_tokens)
                await self._fire(Trigger.RETRY_CONTEXT, f"context length exceeded; re-trimming and retrying once ({exc})")
                return
            await self._end(StopReason.FAILED_TERMINAL, f"context length exceeded even after re-trimming: {exc}",
                            error=exc.to_info())
            return
        except ProviderError as exc:
            reason = StopReason.FAILED_RETRYABLE if exc.retryable else StopReason.FAILED_TERMINAL
            if exc.partial is not None and exc.partial.message.content:
                ctx.extra_stop["partial_response"] = exc.partial
            await self._end(reason, f"model call failed: {exc}", error=exc.to_info())
            return
        finally:
            if token is not None:
                call_deadline.reset(token)
        ctx.context_retry = False
        response = _unique_call_ids(response, ctx.transcript)
        self._account(request, response)
        ctx.last_response = response
        self._append(response.message)
        if self.journal is not None:
            self.journal.record("model_call", {
                "model": response.model, "provider": response.provider, "stop_reason": response.stop_reason.value,
                "raw_stop_reason": response.raw_stop_reason,
                "usage": unstructure(response.usage) if response.usage else None}, ctx.turn)
        stop = response.stop_reason
        if response.tool_calls:
            ctx.pending_calls = list(response.tool_calls)
            await self._fire(Trigger.TOOL_USE, f"model stop reason {stop.value}: {len(response.tool_calls)} tool call(s)")
        elif stop is ModelStopReason.CONTENT_FILTERED:
            await self._end(StopReason.FAILED_TERMINAL, "the provider's content filter blocked the answer",
                            error={"kind": "content_filtered", "message": response.refusal or ""})
        elif stop is ModelStopReason.REFUSAL or (response.refusal and not response.text.strip()):
            await self._end(StopReason.FAILED_TERMINAL, f"the model refused: {response.refusal or 'no reason given'}",
                            error={"kind": "refusal", "message": response.refusal or ""})
        else:
            await self._fire(Trigger.MODEL_DONE, f"model stop reason {stop.value}")

    def _account(self, request: MessageRequest, response: MessageResponse) -> None:
        ctx = self.ctx
        usage = response.usage
        if usage is None:  # case B12: unknown usage is estimated and flagged, never zero
            out_text = response.text + response.thinking + "".join(
                c.name + str(c.input) for c in response.tool_calls)
            usage = Usage(count_message_tokens(request.messages), count_tokens(out_text), estimated=True)
        ctx.usage = ctx.usage + usage
        if self.cost_of is not None and ctx.cost_usd is not None:
            cost = self.cost_of(response.model or request.model, usage)
            ctx.cost_usd = None if cost is None else ctx.cost_usd + cost

    # -- MidTurn -------------------------------------------------------------------------
    def _all_pure(self, calls: list[ToolUseBlock]) -> bool:
        return all(self._effect(c) is ToolEffect.PURE for c in calls)

    def _effect(self, call: ToolUseBlock) -> ToolEffect:
        tool = self.ctx.tools.get(call.name)
        return tool.effect if tool is not None else ToolEffect.PURE

    async def _ledger(self, call: ToolUseBlock, status: LedgerStatus, result: ToolResultMessage | None = None,
                      *, durable: bool | None = None) -> None:
        """Record a ledger state. By default it is written at once for calls with effects (``idempotent``,
        ``side_effect``) and with the next commit for ``pure`` ones, which a crash can only make run again."""
        j = self.journal
        if j is None:
            return
        from ..session import ledger_entry

        effect = self._effect(call)
        entry = ledger_entry(self.ctx, call, status, effect=effect.value, result=result)
        self.ctx.ledger[call.id] = entry
        j.record("tool_call", {"call_id": call.id, "tool": call.name, "status": status.value}, self.ctx.turn)
        await j.ledger(entry, durable=effect is not ToolEffect.PURE if durable is None else durable)

    async def _reconcile(self, call: ToolUseBlock) -> Any:
        """A side-effect call found started but unfinished after a crash: ask its tool what happened."""
        tool = self.ctx.tools.get(call.name)
        if tool is None or tool.reconcile is None:
            return None
        tctx = ToolContext(call.id, idempotency_key(self.ctx.session_id, call.id), self.ctx.session_id,
                           self.ctx.turn, call.name)
        outcome = tool.reconcile(dict(call.input), tctx)
        if inspect.isawaitable(outcome):
            outcome = await outcome
        if outcome is None or outcome is RUN_AGAIN:
            return outcome
        from ..tools.execution import result_blocks

        return ToolResultMessage(call.id, result_blocks(outcome), name=call.name, metadata={"reconciled": True})

    def _decided(self, call: ToolUseBlock, decision: Any) -> tuple[ToolUseBlock | None, ToolResultMessage | None]:
        """Apply a person's decision: (call to run, or None) and (result, or None)."""
        kind = decision.kind
        if kind == "approve":
            return call, None
        if kind == "edit":
            edited = evolve(call, input=dict(decision.arguments or {}), raw_input=None)
            tool = self.ctx.tools.get(call.name)
            if tool is not None:
                try:
                    tool.validate(edited.input)
                except ToolArgumentsError as exc:
                    return None, ToolResultMessage(call.id, f"The edited arguments were invalid: {exc}", is_error=True,
                                                   name=call.name, metadata={"decision": "edit"})
            return edited, None
        if kind == "reject":
            return None, ToolResultMessage(call.id, f"A person rejected this tool call: {decision.message}",
                                           is_error=True, name=call.name, metadata={"decision": "reject"})
        return None, ToolResultMessage(call.id, decision.message, is_error=decision.is_error, name=call.name,
                                       metadata={"decision": "respond"})

    async def _mid_turn(self) -> None:
        ctx = self.ctx
        calls = list(ctx.pending_calls)
        if not calls and ctx.last_response is not None:
            calls = list(ctx.last_response.tool_calls)
            ctx.pending_calls = list(calls)
        results: dict[str, ToolResultMessage] = dict(ctx.extra_stop.pop("decided_results", {}))
        self._started_ids = set()
        self._done_results = {}
        to_run: list[ToolUseBlock] = []
        pending: list[PendingAction] = []
        approved: dict[str, Any] = {}  # a person's decisions whose calls have not run yet
        ledger = ctx.ledger
        for call in calls:
            if call.id in results:
                continue
            entry = ledger.get(call.id)
            if entry is not None and (entry.status.final or entry.status is LedgerStatus.INTERRUPTED) and entry.result:
                results[call.id] = structure(entry.result, ToolResultMessage)  # never run twice
                continue
            decision = ctx.decisions.pop(call.id, None)
            if entry is not None and entry.status is LedgerStatus.STARTED and decision is None:
                tool = ctx.tools.get(call.name)
                if tool is not None and tool.effect is ToolEffect.SIDE_EFFECT:
                    outcome = await self._reconcile(call)
                    if outcome is RUN_AGAIN:
                        to_run.append(call)
                        continue
                    if outcome is None:
                        pending.append(PendingAction(
                            call, "unknown_outcome", ("approve", "reject", "respond")))
                        continue
                    await self._ledger(call, LedgerStatus.COMPLETED, outcome)
                    results[call.id] = outcome
                    continue
                to_run.append(call)  # pure / idempotent: running again is safe (same idempotency key)
                continue
            if decision is not None:  # a person's decision is written at once, whatever the tool
                run_call, res = self._decided(call, decision)
                if res is not None:
                    await self._ledger(call, LedgerStatus.REJECTED, res, durable=True)
                    results[call.id] = res
                elif run_call is not None:
                    await self._ledger(run_call, LedgerStatus.APPROVED, durable=True)
                    to_run.append(run_call)
                    approved[call.id] = decision
                continue
            decided: ToolUseBlock = call
            final: ToolResultMessage | None = None
            ask: AskApproval | None = None
            for name, d in await self.chain.tool_decisions(call, ctx):
                if isinstance(d, Edit):
                    decided = evolve(decided, input=dict(d.arguments), raw_input=None)
                elif isinstance(d, Deny):
                    final = ToolResultMessage(call.id, f"Tool call denied by policy ({name}): {d.reason}",
                                              is_error=True, name=call.name, metadata={"denied_by": name})
                elif isinstance(d, Respond):
                    final = ToolResultMessage(call.id, d.result, is_error=d.is_error, name=call.name,
                                              metadata={"responded_by": name})
                elif isinstance(d, AskApproval):
                    ask = d
            if ask is not None:
                pending.append(PendingAction(decided, ask.reason, ask.allowed_decisions))
            elif final is not None:
                await self._ledger(call, LedgerStatus.REJECTED, final, durable=False)
                results[call.id] = final
            else:
                await self._ledger(decided, LedgerStatus.APPROVED, durable=False)
                to_run.append(decided)
        if pending and self.bus.wants(ApprovalRequested):
            await self.bus.emit(ApprovalRequested(ctx.session_id, ctx.turn, tuple(pending)))
        if pending and ctx.config.approval_timeout and self.journal is not None:
            pending, more = await self._hang_wait(pending)
            for call, run_call, res in more:
                if res is not None:
                    await self._ledger(call, LedgerStatus.REJECTED, res)
                    results[call.id] = res
                elif run_call is not None:
                    await self._ledger(run_call, LedgerStatus.APPROVED)
                    to_run.append(run_call)
        if pending:
            ctx.extra_stop["decided_results"] = results
            ctx.decisions.update(approved)  # nothing of this turn runs now: keep them for the next resume
            unknown = [p for p in pending if p.reason == "unknown_outcome"]
            what = ("the outcome of side-effect call(s) is unknown after a crash: "
                    + ", ".join(f"{p.call.name}({p.call.id})" for p in unknown) + "; "
                    "respond with its result, approve to run it again, or reject") if unknown else (
                f"{len(pending)} tool call(s) need approval: " + ", ".join(p.call.name for p in pending))
            await self._end(StopReason.WAITING_HUMAN, what, pending_actions=tuple(pending),
                            required_decision="approve, edit, reject or respond to each pending tool call",
                            last_safe_point=Phase.MID_TURN.value)
            return
        if to_run:
            # STARTED for every call with effects, in one transaction, before any of them starts
            for c in to_run:
                await self._ledger(c, LedgerStatus.STARTED, durable=False)
                self._started_ids.add(c.id)
            if self.journal is not None and any(self._effect(c) is not ToolEffect.PURE for c in to_run):
                await self.journal.flush()
            for r in await asyncio.gather(*(self._run_tool(c) for c in to_run)):
                results[r.tool_call_id] = r
        announce = self.bus.wants(ToolFinished)
        for call in calls:
            res = results.get(call.id)
            if res is None:  # pragma: no cover - every call got a result above
                res = ToolResultMessage(call.id, "no result", is_error=True, name=call.name)
            if announce and call.id not in self._done_results:  # denied, answered by policy or a person
                await self.bus.emit(ToolFinished(ctx.session_id, ctx.turn, call, res, 0.0))
            self._append(res)
        ctx.pending_calls = []
        await self._fire(Trigger.TOOLS_DONE, f"{len(calls)} tool result(s) recorded")

    async def _hang_wait(self, pending: list[PendingAction]) -> tuple[list[PendingAction], list[Any]]:
        """Hang-Wait: wait in process (up to ``approval_timeout`` seconds) for decisions on the pending calls."""
        ctx = self.ctx
        deadline = time.monotonic() + (ctx.config.approval_timeout or 0)
        waiting = {p.call.id: p for p in pending}
        decided: list[Any] = []
        while waiting and time.monotonic() < deadline:
            for c in await self._take(ControlKind.DECISION):
                data = _decision_of(c.text)
                if data is None or data[0] not in waiting:
                    continue
                p = waiting.pop(data[0])
                run_call, res = self._decided(p.call, data[1])
                decided.append((p.call, run_call, res))
            if waiting:
                await asyncio.sleep(min(self.control_poll, max(0.0, deadline - time.monotonic())))
        return list(waiting.values()), decided

    async def _run_tool(self, call: ToolUseBlock) -> ToolResultMessage:
        ctx = self.ctx
        ctx.tool_calls_made += 1
        ctx.tool_call_counts[call.name] = ctx.tool_call_counts.get(call.name, 0) + 1
        if self.bus.wants(ToolStarted):
            await self.bus.emit(ToolStarted(ctx.session_id, ctx.turn, call))
        started = time.monotonic()

        async def inner(c: ToolUseBlock) -> ToolResultMessage:
            return await execute_tool_call(c, ctx.tools, session_id=ctx.session_id, turn=ctx.turn,
                                           timeout=ctx.config.tool_timeout)

        result = await self.chain.wrap("wrap_tool_call", inner, ctx)(call)
        await self._ledger(call, LedgerStatus.FAILED if result.is_error else LedgerStatus.COMPLETED, result)
        self._done_results[call.id] = result
        if self.bus.wants(ToolFinished):
            await self.bus.emit(ToolFinished(ctx.session_id, ctx.turn, call, result, time.monotonic() - started))
        return result  # type: ignore[no-any-return]

    # -- PostTurn ------------------------------------------------------------------------
    async def _post_turn(self) -> None:
        ctx = self.ctx
        decision = await self.chain.turn_decision(ctx)
        if decision is not None:
            name, d = decision
            if isinstance(d, Complete):
                if await self._followup():
                    return
                ctx.evidence.extend(d.evidence)
                await self._end(StopReason.COMPLETED, f"{d.detail} (decided by {name})", evidence_refs=d.evidence)
                return
            if isinstance(d, Continue):
                if d.message is not None:
                    self._append(d.message)
                await self._fire(Trigger.NEXT_TURN, f"{d.reason} (decided by {name})")
                return
        resp = ctx.last_response
        if resp is None or resp.tool_calls or resp.stop_reason is ModelStopReason.PAUSE_TURN:
            await self._fire(Trigger.NEXT_TURN, "tool results are in; continue" if resp and resp.tool_calls
                             else "model paused its turn; continue")
            return
        if await self._followup():
            return
        if resp.stop_reason is ModelStopReason.MAX_TOKENS:
            await self._end(StopReason.COMPLETED, "the answer was cut at the output token limit (max_tokens); "
                            "it is partial — raise max_output_tokens for a full answer")
            return
        await self._end(StopReason.COMPLETED, f"the model ended its turn ({resp.stop_reason.value}) with no tool calls")

    async def _followup(self) -> bool:
        """Queued followups run after the current task would complete: append and continue."""
        followups = await self._take(ControlKind.FOLLOWUP)
        if not followups:
            return False
        for f in followups:
            self._append(UserMessage(f.text))
        await self._fire(Trigger.NEXT_TURN, f"{len(followups)} followup request(s) queued by the user")
        return True


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


def _control(session_id: str, kind: ControlKind, text: str) -> Any:
    from ..store.base import ControlRecord

    return ControlRecord(session_id, kind, text)


def _decision_of(text: str) -> tuple[str, Any] | None:
    import orjson

    from ..control import Decision

    try:
        data = orjson.loads(text)
        return data["call_id"], structure(data["decision"], Decision)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
