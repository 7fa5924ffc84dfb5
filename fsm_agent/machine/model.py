"""The Model phase as a phase object: one model call through the ``wrap_model_call`` chain, and
the side calls plugins make through ``ctx.call_provider``.

The call goes through the port (:meth:`~fsm_agent.machine.port.EffectPort.call_model`), streamed
when configured: every event passes the chain's ``on_model_event`` filters and then the observers.
It is bounded by the remaining wall clock (a deadline on the port's timers). Then usage and cost,
and the route on the response: tool calls → ``tool_use``; end of turn, stop sequence, max tokens,
pause → ``model_done``; content filtered or refused → FAILED_TERMINAL; a provider error →
FAILED_RETRYABLE / FAILED_TERMINAL (a failed answer is not history: what streamed is only the stop's
``partial``); a context-window error → ``retry_context`` once (case B20); an
answer cut by the output limit inside a tool call → ``retry_output`` once with a larger limit; the
wall clock running out → PAUSED_BUDGET with the streamed part kept.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from attrs import evolve

from ..errors import ContentFilteredError, ContextLengthExceededError, ProviderError
from ..providers.base import Provider
from ..types.codec import unstructure
from ..types.content import TextBlock, ToolUseBlock
from ..structured import PartialOutput, deliver_output, output_listener
from ..types.events import ModelRetry, ModelStreamEvent, OutputPartial
from ..types.messages import AssistantMessage, Message, ModelStopReason
from ..types.requests import MessageRequest, MessageResponse
from ..types.run import StopReason
from ..types.stream import ErrorEvent, MessageComplete, StreamEvent, TextDelta
from .controls import Controls
from .host import ControlCut, Host
from .outcome import Move, Outcome, Stop
from .phases import Phase, Trigger
from .port import ModelTrace
from .timing import PortDeadline

__all__ = ["MANY_TOOLS", "ModelPhase", "content_filtered"]

log = logging.getLogger("fsm_agent.driver")

MANY_TOOLS = 25
"""More tools than this offered on the first call draws a warning (seed 000 §5.2.5)."""


class ModelPhase:
    """The Model phase, and the one path every model call of a run takes (see the module doc)."""

    __slots__ = ("h", "controls", "_warned_tools", "_task", "_partial")

    def __init__(self, host: Host, controls: Controls) -> None:
        self.h = host
        self.controls = controls
        self._warned_tools = False
        self._task: asyncio.Task[Any] | None = None
        """The task running the Model phase (its side calls are the answer's; others run beside it)."""
        self._partial: PartialOutput | None = None
        """The structured answer of the call streaming, read as it streams (when someone listens)."""

    # -- one call ------------------------------------------------------------------------------
    async def call(self, request: MessageRequest, provider: Provider, trace: ModelTrace,
                   deadline_s: float | None = None, *, quiet: bool = False) -> MessageResponse:
        """One model call through the port: streamed when configured and the provider can, its events
        to the chain's filters and the observers (none when ``quiet``), its provider retries logged
        (``model_retry``)."""
        h = self.h
        stream = h.run_state.config.stream
        on_event: Callable[[StreamEvent], Awaitable[None]] | None
        on_event = self._on_event if stream and not quiet and (h.chain.filters_model_events
                                                               or h.bus.wants(ModelStreamEvent)) else None
        if not quiet:
            self._partial = self._output_partial() if stream else None
            if self._partial is not None and on_event is None:
                on_event = self._on_event
        ended = True  # the last stream event seen ended its stream (MessageComplete, ErrorEvent), or none came
        shown: list[str] | None = None
        if on_event is not None and h.chain.filters_model_events:
            # the filters decide what of the stream is shown, and so what of it the run records
            shown = trace.shown = []

            async def on_event(event: StreamEvent) -> None:
                nonlocal ended
                ended = type(event) in (MessageComplete, ErrorEvent)
                await self._on_event(event, shown)
        try:
            return await h.port.call_model(provider, request, stream=stream, on_event=on_event,
                                           on_retry=self._on_retry, trace=trace, deadline_s=deadline_s)
        except Exception as exc:
            if not ended:
                await self._stream_failed(exc, shown)
            fl = h.inflight
            if trace is fl.trace:  # a failed call takes its streamed text with it: it is not an answer
                fl.failed_partial = trace.kept
                trace.text.clear()
                trace.shown = None
            raise

    async def _stream_failed(self, exc: Exception, shown: list[str] | None = None) -> None:
        """A stream that raised without an ``ErrorEvent`` of its own (a provider other than the HTTP ones,
        a deadline, a broken parser): the chain's filters get one, as every HTTP provider sends before it
        raises, so that a filter holding text back (the ``redaction`` plugin) releases it, masked, to the
        observers before the call fails. The error being raised stays the call's error: a filter that
        fails here is logged, never raised in its place."""
        try:
            await self._on_event(ErrorEvent(getattr(exc, "kind", None) or "error", str(exc)), shown)
        except Exception:  # noqa: BLE001 - the provider's error is the one to raise
            log.exception("a stream filter failed on the error event of a failed model call")

    async def _on_event(self, event: StreamEvent, shown: list[str] | None = None) -> None:
        """One stream event through the chain's filters to the observers; ``shown`` (the call's
        :attr:`ModelTrace.shown <fsm_agent.machine.port.ModelTrace.shown>`) collects the text deltas
        the filters passed on."""
        h = self.h
        ctx = h.view
        events = h.chain.model_event(event, ctx) if h.chain.filters_model_events else (event,)
        if shown is not None:
            shown.extend(ev.text for ev in events if type(ev) is TextDelta)
        if events and h.bus.wants(ModelStreamEvent):
            for ev in events:  # a filter may hide an event or put several in its place
                await h.bus.emit(ModelStreamEvent(ctx.session_id, h.run_state.turn, ev, ctx.state_name))
        if self._partial is not None and events:
            for ev in events:  # the answer as the observers see it (after the filters)
                await deliver_output(h.bus, self._partial.feed(ev))

    def _output_partial(self) -> PartialOutput | None:
        """A reader of the structured answer as it streams, for the Model phase's own call when the
        run has an output schema and someone listens (``on_output_partial``, ``Agent.stream_output``)."""
        h = self.h
        schema = h.run_state.config.output_schema
        if schema is None or h.machine.state is not Phase.MODEL:
            return None
        if not h.bus.wants(OutputPartial) and output_listener(h.session_id) is None:
            return None
        return PartialOutput(schema, h.session_id, h.run_state.turn)

    async def _on_retry(self, exc: ProviderError, attempt: int, delay_s: float) -> None:
        """The provider is about to retry an HTTP attempt: a ``model_retry`` event for the session log
        and the observers, delivered before the wait. The failed attempt's streamed text is dropped (a
        stream retried after content restarts the answer)."""
        h = self.h
        trace = h.inflight.trace
        trace.text.clear()
        if trace.shown is not None:
            trace.shown.clear()
        if self._partial is not None:
            self._partial.reset()
        h.view.emit(ModelRetry(h.session_id, h.run_state.turn, attempt, exc.status, exc.kind, exc.message[:2000], delay_s,
                               server_hint=exc.retry_after is not None, provider=exc.provider))
        await h.flush_outbox()

    async def side_call(self, request: MessageRequest, provider: Provider | None = None, *,
                        account: bool = False) -> MessageResponse:
        """``ctx.call_provider``: one call to ``provider`` (default: the run's), outside the
        ``wrap_model_call`` layers; ``account`` adds its usage and cost to the run.

        A side call made outside the Model and MidTurn phases (a planner's or a grader's, in PreTurn
        or PostTurn) is interruptible like the Model phase's call: an Interrupt or a Cancel cuts it
        and ends the run from the phase the call was made in. The cut call's tokens count as estimated
        (with ``account``), and a ``model_call_interrupted`` event with ``side_call: true`` is logged.

        A side call made in the Model phase from another task than the phase's own (beside the model
        call, such as a guardrail's) is not the answer: its events reach neither the ``on_model_event``
        filters nor the observers, and its text is not the answer in flight."""
        h = self.h
        provider = provider or h.view.provider
        in_model = h.machine.state is Phase.MODEL
        beside = in_model and asyncio.current_task() is not self._task
        # in the Model phase a side call of the phase's own task (a fallback provider's) streams the
        # answer in flight: its text is what an Interrupt keeps, and a failure of it drops it
        trace = h.inflight.trace if in_model and not beside else ModelTrace()
        try:
            response = await h.interruptible(self.call(request, provider, trace, quiet=beside), side_call=True)
        except ControlCut:
            if account:
                h.accounting.cut(request, trace.streamed)
            h.record("model_call_interrupted", {"streamed_chars": len(trace.streamed), "side_call": True,
                                                "phase": h.view.state_name})
            raise
        if account:
            h.accounting.call(request, response)
        return response

    # -- the phase -------------------------------------------------------------------------------
    def build_request(self) -> MessageRequest:
        """The next model request from the context and the turn settings."""
        h = self.h
        ctx, run, cfg = h.view, h.run_state, h.run_state.config
        s = ctx.settings
        tools: tuple[Any, ...] = ()
        if s.tools_enabled and len(ctx._tools):
            tools = ctx._tools.definitions(s.active_tools)
            if len(tools) > MANY_TOOLS and not self._warned_tools:
                self._warned_tools = True
                note = (f"{len(tools)} tools are offered to the model (more than {MANY_TOOLS}); most models "
                        "choose worse from long tool lists: offer fewer (tool_activation, a deny policy)")
                log.warning("session %s: %s", ctx.session_id, note)
                h.record("warning", {"kind": "many_tools", "tools": len(tools), "message": note})
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

    async def run(self) -> Outcome:
        h = self.h
        ctx, run, fl = h.view, h.run_state, h.inflight
        self._task = asyncio.current_task()
        run.turn += 1
        request = fl.request = self.build_request()
        h.turns.start(request)
        fl.trace = ModelTrace()
        fl.failed_partial = ""
        run.max_output_override = None
        deadline = PortDeadline(h.port, ctx.remaining_wall_clock)

        async def inner(req: MessageRequest) -> MessageResponse:
            # each attempt (a retrying middleware calls this again) gets what is left of the wall clock
            return await self.call(req, ctx.provider, fl.trace, ctx.remaining_wall_clock)

        try:
            async with deadline:
                response = await h.chain.model_call(request, ctx, inner)
        except TimeoutError as exc:
            if not deadline.expired():
                if isinstance(exc, ProviderError):
                    return self._provider_failed(exc)
                raise
            kept = self.controls.keep_cut_answer()
            return Stop(StopReason.PAUSED_BUDGET, f"wall-clock budget exhausted during the model call: "
                        f"{ctx.elapsed:.1f} s of {run.config.max_wall_clock:g} s used{kept}", {"budget": "wall_clock"})
        except ContextLengthExceededError as exc:
            if not run.context_retry:
                run.context_retry = True
                if exc.max_tokens_requested is not None and exc.limit and exc.input_tokens:
                    run.max_output_override = max(1, exc.limit - exc.input_tokens)
                h.turns.end()
                return Move(Trigger.RETRY_CONTEXT, f"context length exceeded; re-trimming and retrying once ({exc})")
            return Stop(StopReason.FAILED_TERMINAL, f"context length exceeded even after re-trimming: {exc}",
                        {"error": exc.to_info()})
        except ProviderError as exc:
            return self._provider_failed(exc)
        fl.request = None
        run.context_retry = False
        if content_filtered(response):  # before the tool calls: a blocked answer's calls are blocked too
            return self._content_filtered(request, response=response)
        response = self._unique_call_ids(response)
        cost = h.accounting.call(request, response)
        if response.tool_calls and response.stop_reason is ModelStopReason.MAX_TOKENS:
            return self._cut_off(request, response, cost)
        run.output_retry = False
        run.last_response = response
        h.append(response.message)
        info = {"model": response.model, "provider": response.provider, "stop_reason": response.stop_reason.value,
                "raw_stop_reason": response.raw_stop_reason,
                "usage": unstructure(response.usage) if response.usage else None, "cost_usd": cost}
        if h.journal is not None:
            ref = h.turns.context
            h.record("model_call", {**info, "context": unstructure(ref) if ref else None})
        h.turns.model_call(info, response.tool_calls)
        stop = response.stop_reason
        if response.tool_calls:
            run.pending_calls = list(response.tool_calls)
            return Move(Trigger.TOOL_USE, f"model stop reason {stop.value}: {len(response.tool_calls)} tool call(s)")
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
        h = self.h
        run, cfg = h.run_state, h.run_state.config
        provider = h.view.provider
        cap = provider.capabilities.max_output_tokens
        # the limit the answer met: the request's; without one, what the profile sends in its place,
        # else the server's default, which the cut answer's reported output shows (else the model's
        # maximum, else a guess)
        sent = getattr(getattr(provider, "profile", None), "default_max_tokens", None)
        reported = response.usage.output_tokens if response.usage is not None and not response.usage.estimated else 0
        used = request.max_tokens or sent or reported or cap or 4096
        larger = used * 2
        if cfg.max_tokens is not None:
            larger = min(larger, cfg.max_tokens - run.usage.total_tokens)
        if cap is not None:
            larger = min(larger, cap)
        names = ", ".join(c.name for c in response.tool_calls)
        h.record("model_call", {
            "model": response.model, "provider": response.provider, "stop_reason": response.stop_reason.value,
            "raw_stop_reason": response.raw_stop_reason, "cost_usd": cost, "discarded": "tool_call_truncated",
            "usage": unstructure(response.usage) if response.usage else None, "max_tokens": request.max_tokens})
        if not run.output_retry and larger > used:
            run.output_retry = True
            run.max_output_override = larger
            h.turns.end(verification=f"tool call(s) {names} cut off at {used} output tokens; discarded")
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
        ``partial``, for the user, as the stream's filters showed it (:attr:`ModelTrace.kept
        <fsm_agent.machine.port.ModelTrace.kept>`: masked by the ``redaction`` plugin); a
        ``model_call_failed`` event records the call."""
        if isinstance(exc, ContentFilteredError):
            return self._content_filtered(None, error=exc)
        h = self.h
        fl = h.inflight
        reason = StopReason.FAILED_RETRYABLE if exc.retryable else StopReason.FAILED_TERMINAL
        partial = fl.failed_partial or fl.trace.kept
        fl.trace.text.clear()
        fl.trace.shown = None
        fl.failed_partial = ""
        fl.request = None
        h.record("model_call_failed", {"kind": exc.kind, "status": exc.status, "streamed_chars": len(partial)})
        note = (f"; the {len(partial)} characters that had streamed are not part of the conversation (stop.partial "
                "has them): a resume asks again" if partial else "")
        payload: dict[str, Any] = {"error": exc.to_info()}
        if partial:
            payload["partial"] = partial
        return Stop(reason, f"model call failed: {exc}{note}", payload)

    def _content_filtered(self, request: MessageRequest | None, *, response: MessageResponse | None = None,
                          error: ContentFilteredError | None = None) -> Stop:
        """The provider's content filter blocked the answer or the request (seed 000 §5.3.4): the run
        ends with the safety message as its answer, whichever way the provider said it.

        ``response``: an answer whose finish reason says so (:func:`content_filtered`); ``error``: a
        :class:`~fsm_agent.errors.ContentFilteredError` (an HTTP 400 with a content-filter code, an
        error event inside the stream). Either way nothing the model wrote enters the conversation
        (and none of it is the stop's ``partial``: the filter blocked it); the run's last assistant
        message, and so ``RunResult.output``, is ``RunConfig.content_filter_message``; the stop is
        FAILED_TERMINAL with error kind ``content_filtered``; a ``content_filtered`` event records the
        provider's details (see :func:`filter_details`)."""
        h = self.h
        run, fl = h.run_state, h.inflight
        streamed = fl.failed_partial or fl.trace.streamed
        fl.trace.text.clear()
        fl.failed_partial = ""
        fl.request = None
        safety = AssistantMessage((TextBlock(run.config.content_filter_message),))
        event: dict[str, Any]
        if response is not None:
            assert request is not None
            cost = h.accounting.call(request, response)  # the blocked call was made: its tokens count
            info = {"model": response.model, "provider": response.provider,
                    "stop_reason": response.stop_reason.value, "raw_stop_reason": response.raw_stop_reason,
                    "usage": unstructure(response.usage) if response.usage else None, "cost_usd": cost,
                    "discarded": "content_filtered"}
            if h.journal is not None:
                ref = h.turns.context
                h.record("model_call", {**info, "context": unstructure(ref) if ref else None})
            h.turns.model_call(info, ())
            run.output_retry = False
            run.last_response = evolve(response, message=safety)  # the answer is the safety message
            said = f"finish reason {response.raw_stop_reason!r}" if response.raw_stop_reason else "its stop reason"
            why = response.refusal or ""
            info_error: dict[str, Any] = {"kind": "content_filtered", "message": why, "provider": response.provider,
                                          "raw_stop_reason": response.raw_stop_reason}
            event = {"via": "finish_reason", "provider": response.provider, "model": response.model,
                     "raw_stop_reason": response.raw_stop_reason, "message": why,
                     "details": filter_details(response)}
        else:
            assert error is not None
            h.record("model_call_failed", {"kind": error.kind, "status": error.status, "streamed_chars": len(streamed)})
            said = f"HTTP {error.status}" if error.status is not None else "an error"
            said += f" with code {error.code!r}" if error.code else ""
            info_error = error.to_info()
            event = {"via": "error", "provider": error.provider, "model": None, "status": error.status,
                     "code": error.code, "message": error.message, "details": error_details(error)}
        h.append(safety)
        h.record("content_filtered", {**event, "streamed_chars": len(streamed), "answer": safety.text})
        where = info_error.get("provider") or "the provider"
        dropped = (f"; the {len(streamed)} characters that had streamed were dropped (not part of the conversation)"
                   if streamed else "")
        return Stop(StopReason.FAILED_TERMINAL,
                    f"the provider's content filter blocked the answer ({where}: {said}); the answer is the "
                    f"safety message (RunConfig.content_filter_message){dropped}", {"error": info_error})

    def _unique_call_ids(self, response: MessageResponse) -> MessageResponse:
        """Give every tool call of ``response`` an id unused so far in the session.

        Some servers number calls ``call_0`` in every turn, or send empty or repeated ids; the ledger
        and the transcript key results by id, so a reused id would make a new call look already done.
        Renaming happens before anything is recorded, so resumes see the same ids; new ids come from
        the port, so a replay renames alike.
        """
        calls = response.tool_calls
        if not calls:
            return response
        transcript: list[Message] = self.h.view._transcript
        used = {b.id for m in transcript if isinstance(m, AssistantMessage) for b in m.tool_calls}
        seen: set[str] = set()
        renamed = False
        blocks = []
        for b in response.message.content:
            if isinstance(b, ToolUseBlock):
                if not b.id or b.id in used or b.id in seen:
                    b = evolve(b, id=f"call_{self.h.port.new_id()[:24]}")
                    renamed = True
                seen.add(b.id)
            blocks.append(b)
        if not renamed:
            return response
        return evolve(response, message=evolve(response.message, content=tuple(blocks)))


_FILTER_EXTRA = ("content_filter_results", "prompt_filter_results", "stop_details", "incomplete_details")
"""The keys of ``MessageResponse.extra`` where the protocols keep a content filter's details: Azure's
``content_filter_results`` and ``prompt_filter_results`` (Chat Completions), Anthropic's
``stop_details`` (``type``, ``category``, ``explanation``), Responses' ``incomplete_details``."""


def content_filtered(response: MessageResponse) -> bool:
    """Whether the provider's content filter blocked ``response``: a content-filter finish reason
    (OpenAI Chat ``finish_reason: content_filter``, Responses ``incomplete_details.reason:
    content_filter``: ``ModelStopReason.CONTENT_FILTERED``), or Anthropic's ``stop_reason: refusal``
    (its safety classifiers stopped the answer; the message carries ``stop_details``, and no refusal
    text of the model's own). A refusal the model wrote itself (OpenAI ``message.refusal``) is not a
    filter: it stays a ``refusal`` stop."""
    stop = response.stop_reason
    if stop is ModelStopReason.CONTENT_FILTERED:
        return True
    return (stop is ModelStopReason.REFUSAL and response.raw_stop_reason == "refusal"
            and (isinstance(response.extra.get("stop_details"), dict) or response.refusal is None))


def filter_details(response: MessageResponse) -> dict[str, Any]:
    """The provider's details of a blocked answer (see :data:`_FILTER_EXTRA`)."""
    return {k: response.extra[k] for k in _FILTER_EXTRA if k in response.extra}


def error_details(error: ProviderError) -> Any:
    """The provider's error body of a blocked request (its JSON when it is JSON; at most 2 KiB of text
    otherwise), or ``None``."""
    if not error.body:
        return None
    try:
        return orjson.loads(error.body)
    except orjson.JSONDecodeError:
        return error.body[:2048]
