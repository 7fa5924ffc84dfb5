"""The loop: one explicit function that runs each phase's work and fires the triggers.

The ``transitions`` machine only checks that each move is a row of the table;
everything else happens here, between triggers, in one task (so middleware
``call_next`` stays in the caller's task and ``contextvars`` hold). Phases:

* **PreTurn** — control flags → budgets (seed 000 order: shutdown, iterations,
  wall clock, tokens, cost) → context built from the transcript → PreTurn
  middleware → ``call_model``.
* **Model** — the ``wrap_model_call`` chain around one provider call (streamed:
  every event passes ``on_model_event`` and then the observers) → usage and
  cost → route on the response: tool calls → ``tool_use``; end of turn, stop
  sequence, max tokens, pause → ``model_done``; content filtered or refused →
  ``fail_terminal``; a provider error → ``fail_retryable`` / ``fail_terminal``;
  a context-window error → ``retry_context`` once (case B20).
* **MidTurn** — per call: policy decisions (``on_tool_call``) → execution of
  the allowed calls in parallel inside the ``wrap_tool_call`` chain → results
  appended in call order → ``tools_done``; or ``wait_human`` when a call needs
  approval.
* **PostTurn** — ``post_turn`` decisions (verifier) → ``complete`` or ``next_turn``.

A middleware raising :class:`~fsm_agent.errors.StopRun` ends the run with its
StopReason; a fail-closed middleware failure ends it FAILED_TERMINAL. The
result always names a StopReason: the driver never lets an exception out,
except ``asyncio.CancelledError`` (after recording INTERRUPTED).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from attrs import evolve

from ..chain import MiddlewareChain
from ..errors import ContextLengthExceededError, MiddlewareError, ProviderError, StopRun
from ..hooks import HookBus
from ..middleware import AskApproval, Complete, Continue, Deny, Edit, Respond
from ..providers.base import call_deadline
from ..tools.execution import execute_tool_call
from ..types.content import ToolUseBlock
from ..types.events import ModelStreamEvent, ToolFinished, ToolStarted, TransitionEvent
from ..types.messages import AssistantMessage, ModelStopReason, ToolResultMessage, Usage
from ..types.requests import MessageRequest, MessageResponse
from ..types.run import PendingAction, RunResult, RunStop, StopReason
from ..types.stream import MessageComplete
from ..types.tokens import count_message_tokens, count_tokens
from .context import RunContext
from .phases import Phase, Trigger

__all__ = ["Driver", "STOP_TRIGGERS"]

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


class Driver:
    """Runs one session from its current state to a terminal state.

    Args:
        ctx: the run context (transcript, budgets, provider, tools).
        chain: the middleware chain (frozen by the agent before the run).
        bus: the observer bus.
        cost_of: ``(model, usage) -> USD or None`` (the pricing table).
        persist: called after every transition with the context (the store hook).
    """

    def __init__(
        self,
        ctx: RunContext,
        chain: MiddlewareChain,
        bus: HookBus,
        *,
        cost_of: Callable[[str, Usage], float | None] | None = None,
        persist: Callable[[RunContext, TransitionEvent], Any] | None = None,
    ) -> None:
        self.ctx = ctx
        self.chain = chain
        self.bus = bus
        self.cost_of = cost_of
        self.persist = persist
        self.stop: RunStop | None = None
        self._stop_payload: dict[str, Any] = {}
        self.interrupt_requested: str | None = None
        self.cancel_requested: str | None = None
        ctx.call_provider = self._provider_call

    async def _flush(self) -> None:
        """Deliver observer events middleware queued with ``ctx.emit``."""
        while self.ctx.outbox:
            await self.bus.emit(self.ctx.outbox.pop(0))

    # -- transitions ----------------------------------------------------------------
    async def _fire(self, trigger: Trigger, reason: str) -> None:
        ctx = self.ctx
        before = ctx.machine.state
        after = ctx.machine.fire(trigger)
        event = TransitionEvent(ctx.session_id, ctx.turn, before.value, trigger.value, after.value, reason, time.time())
        if self.persist is not None:
            result = self.persist(ctx, event)
            if asyncio.iscoroutine(result):
                await result
        await self.bus.emit(event)

    async def _end(self, reason: StopReason, detail: str, **payload: Any) -> None:
        """Move to the terminal state ``reason`` from the current phase and record the stop."""
        trigger = STOP_TRIGGERS[reason]
        phase = self.ctx.machine.state
        if not self.ctx.machine.can_fire(trigger):
            detail = (f"{detail} (a {reason.value} stop was requested in {phase.value}, where the machine "
                      f"does not allow it; the run fails closed)")
            reason, trigger = StopReason.FAILED_TERMINAL, Trigger.FAIL_TERMINAL
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
    async def run(self, first: Trigger = Trigger.START, reason: str = "start") -> RunResult:
        ctx = self.ctx
        started = time.monotonic()
        try:
            await self.chain.run_lifecycle("on_run_start", ctx)
            await self._fire(first, reason)
            while not ctx.machine.is_terminal:
                state = ctx.machine.state
                await self._flush()
                try:
                    if state is Phase.PRE_TURN:
                        await self._pre_turn()
                    elif state is Phase.MODEL:
                        await self._model()
                    elif state is Phase.MID_TURN:
                        await self._mid_turn()
                    elif state is Phase.POST_TURN:
                        await self._post_turn()
                    else:  # pragma: no cover - the table has no other non-terminal states
                        raise RuntimeError(f"driver reached unexpected state {state!r}")
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
        except Exception as exc:  # noqa: BLE001 - a run always ends with a StopReason
            log.exception("internal error in the driver")
            if not ctx.machine.is_terminal:
                if ctx.machine.can_fire(Trigger.FAIL_TERMINAL):
                    await self._end(StopReason.FAILED_TERMINAL, f"internal error: {type(exc).__name__}: {exc}",
                                    error={"kind": "internal", "message": str(exc)})
                else:
                    self.stop = RunStop(StopReason.FAILED_TERMINAL, f"internal error: {type(exc).__name__}: {exc}")
        result = self._result(time.monotonic() - started)
        try:
            await self.chain.run_lifecycle("on_run_end", ctx, result)
        except (MiddlewareError, StopRun) as exc:
            log.error("on_run_end failed after the run ended: %s", exc)
        await self._flush()
        return result

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
        if self.cancel_requested is not None:
            await self._end(StopReason.CANCELLED, self.cancel_requested)
            return
        if self.interrupt_requested is not None:
            await self._end(StopReason.INTERRUPTED, self.interrupt_requested)
            return
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
        tools = ()
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

    async def _provider_call(self, request: MessageRequest, provider: Any = None) -> MessageResponse:
        """One call to ``provider`` (default: the run's), streamed when configured; deltas go to observers."""
        ctx = self.ctx
        provider = provider or ctx.provider
        if not (ctx.config.stream and provider.capabilities.streaming):
            return await provider.chat(request)
        final: MessageResponse | None = None
        wants = self.bus.wants(ModelStreamEvent)
        has_filters = bool(self.chain.hooks("on_model_event"))
        stream = provider.chat_stream(request)
        try:
            async for event in stream:
                if isinstance(event, MessageComplete):
                    final = event.full_response
                if has_filters:
                    event = self.chain.model_event(event, ctx)
                    if event is None:
                        continue
                if wants:
                    await self.bus.emit(ModelStreamEvent(ctx.session_id, ctx.turn, event))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        if final is None:  # pragma: no cover - providers always end with MessageComplete or raise
            raise ProviderError("the stream ended without a complete message", provider=provider.name)
        return final

    async def _model(self) -> None:
        ctx = self.ctx
        ctx.turn += 1
        request = self.build_request()
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
            partial = exc.partial
            if partial is not None and partial.message.content:
                ctx.extra_stop["partial_response"] = partial
            await self._end(reason, f"model call failed: {exc}", error=exc.to_info())
            return
        finally:
            if token is not None:
                call_deadline.reset(token)
        ctx.context_retry = False
        self._account(request, response)
        ctx.last_response = response
        ctx.transcript.append(response.message)
        stop = response.stop_reason
        if response.tool_calls:
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
    async def _mid_turn(self) -> None:
        ctx = self.ctx
        calls = list(ctx.pending_calls) or (list(ctx.last_response.tool_calls) if ctx.last_response else [])
        ctx.pending_calls = []
        results: dict[str, ToolResultMessage] = {}
        to_run: list[ToolUseBlock] = []
        pending: list[PendingAction] = []
        for call in calls:
            decided = call
            final = None
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
                    pending.append(PendingAction(decided, d.reason, d.allowed_decisions))
                    final = None
                    break
            else:
                if final is None:
                    to_run.append(decided)
                else:
                    results[call.id] = final
                continue
            if final is not None:
                results[call.id] = final
        if pending:
            ctx.pending_calls = calls
            ctx.extra_stop["decided_results"] = results
            await self._end(
                StopReason.WAITING_HUMAN,
                f"{len(pending)} tool call(s) need approval: " + ", ".join(p.call.name for p in pending),
                pending_actions=tuple(pending),
                required_decision="approve, edit, reject or respond to each pending tool call",
            )
            return
        if to_run:
            for r in await asyncio.gather(*(self._run_tool(c) for c in to_run)):
                results[r.tool_call_id] = r
        for call in calls:
            res = results.get(call.id)
            if res is None:  # pragma: no cover - every call got a result above
                res = ToolResultMessage(call.id, "no result", is_error=True, name=call.name)
            ctx.transcript.append(res)
        await self._fire(Trigger.TOOLS_DONE, f"{len(calls)} tool result(s) recorded")

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
        if self.bus.wants(ToolFinished):
            await self.bus.emit(ToolFinished(ctx.session_id, ctx.turn, call, result, time.monotonic() - started))
        return result

    # -- PostTurn ------------------------------------------------------------------------
    async def _post_turn(self) -> None:
        ctx = self.ctx
        decision = await self.chain.turn_decision(ctx)
        if decision is not None:
            name, d = decision
            if isinstance(d, Complete):
                ctx.evidence.extend(d.evidence)
                await self._end(StopReason.COMPLETED, f"{d.detail} (decided by {name})", evidence_refs=d.evidence)
                return
            if isinstance(d, Continue):
                if d.message is not None:
                    ctx.transcript.append(d.message)
                await self._fire(Trigger.NEXT_TURN, f"{d.reason} (decided by {name})")
                return
        resp = ctx.last_response
        if resp is None or resp.tool_calls or resp.stop_reason is ModelStopReason.PAUSE_TURN:
            await self._fire(Trigger.NEXT_TURN, "tool results are in; continue" if resp and resp.tool_calls
                             else "model paused its turn; continue")
            return
        if resp.stop_reason is ModelStopReason.MAX_TOKENS:
            await self._end(StopReason.COMPLETED, "the answer was cut at the output token limit (max_tokens); "
                            "it is partial — raise max_output_tokens for a full answer")
            return
        await self._end(StopReason.COMPLETED, f"the model ended its turn ({resp.stop_reason.value}) with no tool calls")

