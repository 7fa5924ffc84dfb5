"""The instrumentation itself (imported only once tracing is turned on).

Three parts, one per concern:

* :class:`Instrumentation`: the tracer, the metric instruments and the content switch, built once
  from :class:`~fsm_agent.otel.settings.OtelSettings`;
* :class:`Segment`: one run segment (a start or a resume, up to its stop): its ``invoke_agent``
  span, opened and closed around the driver's run; :class:`SegmentObserver` puts the FSM's own view
  on it as events (transitions, decisions, approvals, retries, compactions, plan changes);
* :class:`InstrumentedPort`: the run's :class:`~fsm_agent.machine.port.EffectPort` with a ``chat``
  span around each model call (plugins' side calls take the same path) and an ``execute_tool`` span
  around each tool call; every other effect goes straight to the port it wraps.

The rules follow ``opentelemetry-util-genai``'s ``TelemetryHandler`` (span names ``chat {model}``,
``execute_tool {tool}``, ``invoke_agent {agent}``; kinds CLIENT, INTERNAL, INTERNAL; on failure the
status ERROR and ``error.type``; content off unless ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``
says otherwise, serialized by its own helpers), with the schema URL it emits. The spans are built on
the tracer directly: the handler's invocation objects cost about twice as much per model call
(measured: 98 µs against 48 µs, span and metrics), and this is on every call of every run.

Nothing here changes a run: the spans and metrics are written beside it, the port passes every
effect through unchanged, and an exception in the instrumentation is never the run's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import attach, detach
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as G
from opentelemetry.semconv._incubating.metrics import gen_ai_metrics as GM
from opentelemetry.semconv.attributes import error_attributes as E
from opentelemetry.semconv.attributes import server_attributes as S
from opentelemetry.semconv.schemas import Schemas
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.genai.types import ContentCapturingMode
from opentelemetry.util.genai.utils import get_content_capturing_mode

from .._version import __version__
from ..errors import ProviderError, SuspendCall, WaitForHuman
from ..hooks import HookBus
from ..types.events import (ApprovalRequested, BudgetWarning, ModelRetry, PlanUpdated, PolicyDecision, ToolFinished,
                            TransitionEvent)
from ..types.run import StopReason
from . import names as N
from .content import FINISH_REASONS, chat_content, tool_content
from .settings import OtelSettings

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from ..control import Decision
    from ..machine.port import EffectPort, ModelTrace, OnRetry, ToolReport
    from ..providers.base import Provider
    from ..tools.registry import ToolRegistry
    from ..types.content import ToolUseBlock
    from ..types.messages import ToolResultMessage
    from ..types.requests import MessageRequest, MessageResponse
    from ..types.run import RunResult
    from ..types.stream import StreamEvent

__all__ = ["SCHEMA_URL", "InstrumentedPort", "Instrumentation", "Segment", "SegmentObserver", "provider_name"]

log = logging.getLogger("fsm_agent.otel")

SCHEMA_URL = Schemas.V1_37_0.value
"""The semantic-conventions schema the spans follow (the one ``opentelemetry-util-genai`` 1.3b0 emits)."""

_DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
"""``gen_ai.client.operation.duration``: the conventions' advisory bucket boundaries (seconds)."""
_TOKEN_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864]
"""``gen_ai.client.token.usage``: the conventions' advisory bucket boundaries (tokens)."""

_PROVIDERS = {"openai": "openai", "openai-responses": "openai", "anthropic": "anthropic", "deepseek": "deepseek",
              "mistral": "mistral_ai", "gemini": "gcp.gemini", "groq": "groq", "xai": "x_ai", "cohere": "cohere",
              "perplexity": "perplexity"}
"""Profile names whose vendor has a well-known ``gen_ai.provider.name``; others keep their profile name."""

_PROPAGATOR = TraceContextTextMapPropagator()
_INPUT, _OUTPUT = G.GenAiTokenTypeValues.INPUT.value, G.GenAiTokenTypeValues.OUTPUT.value
_CHAT, _TOOL, _AGENT = (G.GenAiOperationNameValues.CHAT.value, G.GenAiOperationNameValues.EXECUTE_TOOL.value,
                        G.GenAiOperationNameValues.INVOKE_AGENT.value)
_SPAN_MODES = (ContentCapturingMode.SPAN_ONLY, ContentCapturingMode.SPAN_AND_EVENT)
_FAILED = (StopReason.FAILED_RETRYABLE, StopReason.FAILED_TERMINAL)


def provider_name(provider: Any) -> str:
    """``gen_ai.provider.name`` of a provider: the vendor's well-known name where the conventions
    have one (``openai``, ``anthropic``, ``deepseek``, ``mistral_ai`` ...), else its profile's name."""
    profile = getattr(provider, "profile", None)
    name = str(getattr(profile, "name", None) or getattr(provider, "name", None) or type(provider).__name__)
    return _PROVIDERS.get(name, name)


def _error_type(exc: BaseException) -> str:
    """``error.type``: the error taxonomy's kind for a provider error, ``cancelled`` for a cut, else the
    exception's fully qualified type (util-genai's rule)."""
    if isinstance(exc, ProviderError):
        return exc.kind
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    t = type(exc)
    return t.__qualname__ if t.__module__ in ("builtins", None) else f"{t.__module__}.{t.__qualname__}"


def _carrier(value: Any) -> dict[str, str] | None:
    if isinstance(value, dict) and isinstance(value.get("traceparent"), str):
        return {k: v for k, v in value.items() if isinstance(v, str)}
    return None


class Instrumentation:
    """The tracer, the metric instruments and the content switch of one :class:`OtelSettings`."""

    def __init__(self, settings: OtelSettings) -> None:
        self.settings = settings
        self.tracer = trace.get_tracer("fsm_agent", __version__, settings.tracer_provider, schema_url=SCHEMA_URL)
        cc = settings.capture_content
        if cc is None:
            mode = get_content_capturing_mode()
        elif isinstance(cc, bool):
            mode = ContentCapturingMode.SPAN_ONLY if cc else ContentCapturingMode.NO_CONTENT
        else:
            mode = ContentCapturingMode[cc]
        self.content_mode = mode
        self.content = mode in _SPAN_MODES
        """Message content goes on spans (``SPAN_ONLY``, ``SPAN_AND_EVENT``)."""
        self.content_events = mode in (ContentCapturingMode.EVENT_ONLY, ContentCapturingMode.SPAN_AND_EVENT)
        """Message content goes into ``gen_ai.client.inference.operation.details`` log events."""
        self._logger: Any = None
        if self.content_events:
            from opentelemetry._logs import get_logger

            self._logger = get_logger("fsm_agent", __version__, schema_url=SCHEMA_URL)
        self.metrics = settings.metrics
        if self.metrics:
            from opentelemetry import metrics

            meter = metrics.get_meter("fsm_agent", __version__, settings.meter_provider, schema_url=SCHEMA_URL)
            self.duration = meter.create_histogram(GM.GEN_AI_CLIENT_OPERATION_DURATION, unit="s",
                                                   description="GenAI operation duration.",
                                                   explicit_bucket_boundaries_advisory=_DURATION_BUCKETS)
            self.tokens = meter.create_histogram(GM.GEN_AI_CLIENT_TOKEN_USAGE, unit="{token}",
                                                 description="Number of input and output tokens used.",
                                                 explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS)
            self.cost = meter.create_counter(N.METRIC_COST, unit="USD",
                                             description="What run segments cost, in US dollars.")
            self.tool_calls = meter.create_counter(N.METRIC_TOOL_CALLS, unit="{call}",
                                                   description="Tool calls, by tool and ledger outcome.")
            self.stops = meter.create_counter(N.METRIC_STOPS, unit="{stop}",
                                              description="Run segments, by how they stopped.")
        self._servers: dict[int, tuple[Any, tuple[str, str | None, int | None]]] = {}

    def __repr__(self) -> str:
        return f"Instrumentation({self.settings!r}, content={self.content_mode.name})"

    def server(self, provider: Any) -> tuple[str, str | None, int | None]:
        """(``gen_ai.provider.name``, ``server.address``, ``server.port``) of ``provider``, cached."""
        hit = self._servers.get(id(provider))
        if hit is not None and hit[0] is provider:
            return hit[1]
        address = port = None
        base = getattr(provider, "base_url", None)
        if isinstance(base, str) and base:
            parts = urlsplit(base)
            address = parts.hostname
            try:
                port = parts.port or (443 if parts.scheme == "https" else 80)
            except ValueError:
                port = None
        info = (provider_name(provider), address, port)
        if len(self._servers) > 256:
            self._servers.clear()
        self._servers[id(provider)] = (provider, info)
        return info

    def segment(self, view: Any, chain: Any, reason: str, *, agent_name: str | None = None,
                parent: Context | None = None) -> Segment:
        """Open the ``invoke_agent`` span of a run segment over the plugin view ``view`` (see :class:`Segment`)."""
        return Segment(self, view, chain, reason, agent_name=agent_name, parent=parent)

    def activity_port(self, port: EffectPort, *, session_id: str, turn: int = 0,
                      agent_name: str | None = None) -> InstrumentedPort:
        """``port`` traced, its spans children of the current span (see :func:`fsm_agent.otel.activity_port`)."""
        seg = Segment.detached(self, session_id, turn, agent_name or self.settings.agent_name)
        return InstrumentedPort(port, seg)


class Segment:
    """One run segment: its ``invoke_agent`` span and what its model and tool spans need.

    The span's parent is the caller's trace when the session's metadata carries one
    (:data:`~fsm_agent.otel.names.META_PARENT`, put there by the HTTP server), else the span current
    where the run was started (a parent run's ``execute_tool`` span for a sub-agent). A segment that
    continues a stopped one links to it (:data:`~fsm_agent.otel.names.META_LINK`).
    """

    def __init__(self, inst: Instrumentation, view: Any, chain: Any, reason: str, *, agent_name: str | None = None,
                 parent: Context | None = None) -> None:
        self.inst = inst
        self.view = view
        self.session_id: str = view.session_id
        self.agent_name = agent_name or inst.settings.agent_name
        self.turn: int = view.turn
        self.state: str = view.state_name
        self.ran: set[str] = set()
        """Call ids whose tool ran through this segment's port (the others were decided without running)."""
        masks = tuple(m.mask_for_telemetry for m in getattr(chain, "middleware", ())
                      if callable(getattr(m, "mask_for_telemetry", None)))
        self._masks = masks
        meta = getattr(view, "metadata", None) or {}
        carrier = _carrier(meta.get(N.META_PARENT))
        if carrier is not None:
            parent = _PROPAGATOR.extract(carrier)
        self.parented_by_caller = carrier is not None
        links: list[Link] = []
        link = _carrier(meta.get(N.META_LINK))
        if link is not None:
            sc = trace.get_current_span(_PROPAGATOR.extract(link)).get_span_context()
            if sc.is_valid:
                links.append(Link(sc, {N.SEGMENT: "continues"}))
        kind = "resume" if reason.startswith("resume") else "recovered" if "recovered" in reason else "start"
        self._usage0 = view.usage
        self._cost0 = view.cost_usd
        attrs: dict[str, Any] = {G.GEN_AI_OPERATION_NAME: _AGENT, G.GEN_AI_AGENT_NAME: self.agent_name,
                                 G.GEN_AI_CONVERSATION_ID: self.session_id, N.SEGMENT: kind}
        provider = getattr(view, "provider", None)
        if provider is not None:
            attrs[G.GEN_AI_PROVIDER_NAME] = inst.server(provider)[0]
            if getattr(provider, "model", None):
                attrs[G.GEN_AI_REQUEST_MODEL] = provider.model
        self.span: Span = inst.tracer.start_span(f"{_AGENT} {self.agent_name}", parent, SpanKind.INTERNAL, attrs,
                                                 links)
        self.context: Context = set_span_in_context(self.span, parent)
        """The context the segment's spans are children of."""

    @classmethod
    def detached(cls, inst: Instrumentation, session_id: str, turn: int, agent_name: str) -> Segment:
        """A segment without an ``invoke_agent`` span of its own (a Temporal activity: the workflow's
        spans play that part): its spans are children of the span current when each starts."""
        seg = cls.__new__(cls)
        seg.inst, seg.view, seg.session_id, seg.agent_name = inst, None, session_id, agent_name
        seg.turn, seg.state, seg.ran, seg._masks = turn, "", set(), ()
        seg.parented_by_caller = False
        seg.span = trace.INVALID_SPAN
        seg.context = None  # type: ignore[assignment]
        return seg

    # -- content ---------------------------------------------------------------------------------
    def mask(self, text: str) -> str:
        """``text`` through every middleware's ``mask_for_telemetry`` (the redaction plugin's)."""
        for m in self._masks:
            text = m(text, self.view)
        return text

    # -- the segment's span ------------------------------------------------------------------------
    def port(self, inner: EffectPort) -> InstrumentedPort:
        return InstrumentedPort(inner, self)

    def bus(self, hooks: HookBus) -> HookBus:
        """The run's observers and this segment's :class:`SegmentObserver`."""
        return HookBus([*hooks.observers, SegmentObserver(self)])

    async def run(self, work: Awaitable[RunResult], store: Any) -> RunResult:
        """Await the driver's run with this segment's span current, then close the span with the stop
        and remember it in the session (``store``: the agent's own, outside the run's effects)."""
        token = attach(self.context)
        try:
            result = await work
        except BaseException as exc:
            detach(token)
            self._fail(exc)
            raise
        detach(token)
        try:
            self.finish(result)
        except Exception:  # noqa: BLE001 - the instrumentation's trouble is never the run's
            log.exception("session %s: could not close the invoke_agent span", self.session_id)
        await self._remember(store, result)
        return result

    def finish(self, result: RunResult) -> None:
        stop = result.stop
        span = self.span
        attrs: dict[str, Any] = {N.STOP_REASON: stop.reason.value, N.STOP_RESUMABLE: bool(stop.resumable),
                                 N.TURN: result.turns}
        u0, u = self._usage0, result.usage
        attrs[G.GEN_AI_USAGE_INPUT_TOKENS] = max(0, u.input_tokens - u0.input_tokens)
        attrs[G.GEN_AI_USAGE_OUTPUT_TOKENS] = max(0, u.output_tokens - u0.output_tokens)
        if result.cost_usd is not None:
            attrs[N.COST_USD] = result.cost_usd
        kind = (stop.error or {}).get("kind") if isinstance(stop.error, dict) else None
        if kind:
            attrs[N.STOP_ERROR] = str(kind)
        if self.inst.content and stop.detail:
            attrs[N.STOP_DETAIL] = self.mask(stop.detail)
        if stop.reason in _FAILED:
            attrs[E.ERROR_TYPE] = str(kind or stop.reason.value)
            span.set_status(Status(StatusCode.ERROR, f"the run stopped {stop.reason.value}"))
        span.set_attributes(attrs)
        span.end()
        inst = self.inst
        if inst.metrics:
            m = {G.GEN_AI_AGENT_NAME: self.agent_name, N.STOP_REASON: stop.reason.value,
                 N.STOP_RESUMABLE: bool(stop.resumable)}
            inst.stops.add(1, m)
            if result.cost_usd is not None:
                spent = result.cost_usd - (self._cost0 or 0.0)
                if spent > 0:
                    inst.cost.add(spent, {G.GEN_AI_AGENT_NAME: self.agent_name, N.STOP_REASON: stop.reason.value})

    def _fail(self, exc: BaseException) -> None:
        """The run left with an exception (cancelled, its lease lost): the span ends with an error."""
        try:
            self.span.set_attribute(E.ERROR_TYPE, _error_type(exc))
            self.span.set_status(Status(StatusCode.ERROR, f"the run left with {type(exc).__name__}"))
            self.span.end()
        except Exception:  # noqa: BLE001
            log.exception("session %s: could not close the invoke_agent span", self.session_id)

    async def _remember(self, store: Any, result: RunResult) -> None:
        """A resumable stop: keep this segment's span context in the session (the next segment links
        to it, in any process), and drop the caller's trace context it used."""
        if not result.stop.resumable and not self.parented_by_caller:
            return
        update: dict[str, Any] = {N.META_PARENT: None} if self.parented_by_caller else {}
        if result.stop.resumable:
            carrier: dict[str, str] = {}
            _PROPAGATOR.inject(carrier, self.context)
            update[N.META_LINK] = carrier
        try:
            await store.update_metadata(self.session_id, update)
        except Exception as exc:  # noqa: BLE001 - a missing link is the only loss
            log.debug("session %s: could not keep the span context: %s", self.session_id, exc)

    # -- model calls -----------------------------------------------------------------------------
    def chat_start(self, provider: Any, request: MessageRequest, stream: bool) -> tuple[Span, dict[str, Any]]:
        """The call's ``chat`` span, started, and the attributes its metrics carry."""
        model = request.model or getattr(provider, "model", None) or ""
        pname, address, port = self.inst.server(provider)
        m: dict[str, Any] = {G.GEN_AI_OPERATION_NAME: _CHAT, G.GEN_AI_PROVIDER_NAME: pname,
                             G.GEN_AI_REQUEST_MODEL: model}
        if address is not None:
            m[S.SERVER_ADDRESS] = address
            if port is not None:
                m[S.SERVER_PORT] = port
        view = self.view
        attrs: dict[str, Any] = {**m, N.TURN: self.turn if view is None else view.turn}
        phase = self.state if view is None else view.state_name
        if phase != "Model":  # a plugin's side call (a summarizer, a planner, a grader)
            attrs[N.PHASE] = phase
        if view is None:  # a detached segment (an activity): no invoke_agent parent names the conversation
            attrs[G.GEN_AI_CONVERSATION_ID] = self.session_id
        if request.max_tokens is not None:
            attrs[G.GEN_AI_REQUEST_MAX_TOKENS] = request.max_tokens
        if request.temperature is not None:
            attrs[G.GEN_AI_REQUEST_TEMPERATURE] = request.temperature
        if request.top_p is not None:
            attrs[G.GEN_AI_REQUEST_TOP_P] = request.top_p
        if request.stop:
            attrs[G.GEN_AI_REQUEST_STOP_SEQUENCES] = list(request.stop)
        if request.extra:
            seed = request.extra.get("seed")
            if isinstance(seed, int) and not isinstance(seed, bool):
                attrs[G.GEN_AI_REQUEST_SEED] = seed
        if stream:
            attrs[G.GEN_AI_REQUEST_STREAM] = True
        span = self.inst.tracer.start_span(f"{_CHAT} {model}" if model else _CHAT, self.context, SpanKind.CLIENT,
                                           attrs)
        return span, m

    def chat_done(self, span: Span, m: dict[str, Any], started: float, request: MessageRequest,
                  response: MessageResponse) -> None:
        inst = self.inst
        attrs: dict[str, Any] = {
            G.GEN_AI_RESPONSE_MODEL: response.model, G.GEN_AI_RESPONSE_ID: response.id,
            G.GEN_AI_RESPONSE_FINISH_REASONS: (response.raw_stop_reason or
                                               FINISH_REASONS.get(response.stop_reason, response.stop_reason.value),)}
        usage = response.usage
        if usage is not None:
            attrs[G.GEN_AI_USAGE_INPUT_TOKENS] = usage.input_tokens
            attrs[G.GEN_AI_USAGE_OUTPUT_TOKENS] = usage.output_tokens
            if usage.cache_read_tokens:
                attrs[G.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = usage.cache_read_tokens
            if usage.reasoning_tokens:
                attrs[G.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS] = usage.reasoning_tokens
        if inst.content:
            attrs.update(chat_content(request, response, self.mask, inst.content_mode))
        span.set_attributes(attrs)
        if inst.content_events:
            self._content_event(span, {**m, **attrs}, request, response)
        span.end()
        if inst.metrics:
            if response.model:
                m[G.GEN_AI_RESPONSE_MODEL] = response.model
            inst.duration.record(time.perf_counter() - started, m)
            if usage is not None:
                m[G.GEN_AI_TOKEN_TYPE] = _INPUT
                inst.tokens.record(usage.input_tokens, m)
                m = {**m, G.GEN_AI_TOKEN_TYPE: _OUTPUT}
                inst.tokens.record(usage.output_tokens, m)

    def chat_failed(self, span: Span, m: dict[str, Any], started: float, request: MessageRequest,
                    exc: BaseException) -> None:
        etype = _error_type(exc)
        attrs: dict[str, Any] = {E.ERROR_TYPE: etype}
        status = getattr(exc, "status", None)
        if isinstance(status, int):
            attrs["http.response.status_code"] = status
        if isinstance(exc, ProviderError):
            why = self.mask(str(exc.message))[:500]
        else:
            why = "the run cut the call" if etype == "cancelled" else type(exc).__name__
        span.set_attributes(attrs)
        span.set_status(Status(StatusCode.ERROR, why))
        if self.inst.content:
            span.set_attributes(chat_content(request, None, self.mask, self.inst.content_mode))
        span.end()
        if self.inst.metrics:
            m[E.ERROR_TYPE] = etype
            self.inst.duration.record(time.perf_counter() - started, m)

    def _content_event(self, span: Span, attrs: dict[str, Any], request: MessageRequest,
                       response: MessageResponse) -> None:
        """``gen_ai.client.inference.operation.details``, the conventions' content event (EVENT modes)."""
        from opentelemetry._logs import LogRecord

        attrs = {k: v for k, v in attrs.items() if not k.startswith("gen_ai.input") and
                 not k.startswith("gen_ai.output") and k != G.GEN_AI_SYSTEM_INSTRUCTIONS}
        attrs.update(chat_content(request, response, self.mask, self.inst.content_mode, for_span=False))
        self.inst._logger.emit(LogRecord(event_name="gen_ai.client.inference.operation.details", attributes=attrs,
                                         context=set_span_in_context(span, self.context)))

    def retry_hook(self, span: Span, on_retry: OnRetry) -> OnRetry:
        """``on_retry`` that first puts the provider's retry on ``span`` (the wait it uses)."""

        async def hooked(exc: ProviderError, attempt: int, delay_s: float) -> None:
            attrs: dict[str, Any] = {"fsm_agent.retry.attempt": attempt, E.ERROR_TYPE: exc.kind,
                                     "fsm_agent.retry.delay_s": float(delay_s),
                                     "fsm_agent.retry.server_hint": exc.retry_after is not None,
                                     "fsm_agent.retry.layer": "provider"}
            if exc.status is not None:
                attrs["http.response.status_code"] = exc.status
            span.add_event(N.EV_RETRY, attrs)
            await on_retry(exc, attempt, delay_s)

        return hooked

    # -- tool calls ------------------------------------------------------------------------------
    def tool_start(self, call: ToolUseBlock, tools: Any, turn: int, decision: Decision | None) -> Span:
        tool = tools.get(call.name)
        attrs: dict[str, Any] = {G.GEN_AI_OPERATION_NAME: _TOOL, G.GEN_AI_TOOL_NAME: call.name,
                                 G.GEN_AI_TOOL_CALL_ID: call.id, N.TURN: turn,
                                 N.TOOL_EFFECT: tool.effect.value if tool is not None else "unknown"}
        if decision is not None:
            attrs[N.TOOL_DECISION] = decision.kind
        if self.view is None:  # a detached segment (an activity): no invoke_agent parent names the conversation
            attrs[G.GEN_AI_CONVERSATION_ID] = self.session_id
        self.ran.add(call.id)
        return self.inst.tracer.start_span(f"{_TOOL} {call.name}", self.context, SpanKind.INTERNAL, attrs)

    def tool_end(self, span: Span, call: ToolUseBlock, outcome: str, result: ToolResultMessage | None = None,
                 error: str | None = None) -> None:
        attrs: dict[str, Any] = {N.TOOL_OUTCOME: outcome}
        if error is not None:
            attrs[E.ERROR_TYPE] = error
            span.set_status(Status(StatusCode.ERROR, f"{outcome}: {error}"))
        if self.inst.content:
            attrs.update(tool_content(call, result, self.mask))
        span.set_attributes(attrs)
        span.end()
        if self.inst.metrics:
            self.inst.tool_calls.add(1, {G.GEN_AI_TOOL_NAME: call.name, N.TOOL_OUTCOME: outcome})

    def decided_tool(self, call: ToolUseBlock, result: ToolResultMessage) -> None:
        """A call settled without running (denied, rejected, answered): its ``execute_tool`` span,
        with no duration. A result from the ledger (the call ran in an earlier segment) is left out."""
        meta = result.metadata or {}
        decision = meta.get("decision")
        if "denied_by" in meta:
            outcome = "denied"
        elif decision in ("reject", "edit"):  # an edit whose arguments broke the schema is rejected
            outcome = "rejected"
        elif "responded_by" in meta or decision == "respond":
            outcome = "responded"
        else:
            return
        span = self.inst.tracer.start_span(
            f"{_TOOL} {call.name}", self.context, SpanKind.INTERNAL,
            {G.GEN_AI_OPERATION_NAME: _TOOL, G.GEN_AI_TOOL_NAME: call.name, G.GEN_AI_TOOL_CALL_ID: call.id,
             N.TURN: self.turn})
        self.tool_end(span, call, outcome, result)


class InstrumentedPort:
    """A run's port with its model and tool calls traced (see the module doc). Every other effect
    (clocks, ids, timers, the store, controls, plugins' own I/O, what a later port adds) is the
    wrapped port's own, called directly."""

    def __init__(self, inner: EffectPort, segment: Segment) -> None:
        self._inner = inner
        self._seg = segment
        self.store = inner.store
        # the hot untraced effects: the inner port's bound methods themselves (no call in between)
        self.now = inner.now
        self.monotonic = inner.monotonic
        self.random = inner.random
        self.new_id = inner.new_id
        self.call_later = inner.call_later

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"InstrumentedPort({self._inner!r})"

    async def call_model(self, provider: Provider, request: MessageRequest, *, stream: bool,
                         on_event: Callable[[StreamEvent], Awaitable[None]] | None, on_retry: OnRetry | None,
                         trace: ModelTrace, deadline_s: float | None) -> MessageResponse:
        seg = self._seg
        span, m = seg.chat_start(provider, request, stream)
        started = time.perf_counter()
        if on_retry is not None:
            on_retry = seg.retry_hook(span, on_retry)
        try:
            response = await self._inner.call_model(provider, request, stream=stream, on_event=on_event,
                                                    on_retry=on_retry, trace=trace, deadline_s=deadline_s)
        except BaseException as exc:
            seg.chat_failed(span, m, started, request, exc)
            raise
        seg.chat_done(span, m, started, request, response)
        return response

    async def run_tool(self, call: ToolUseBlock, tools: ToolRegistry, *, session_id: str, turn: int,
                       timeout: float | None, decision: Decision | None, report: ToolReport,
                       budget_left: Callable[[], dict[str, float]]) -> ToolResultMessage:
        seg = self._seg
        span = seg.tool_start(call, tools, turn, decision)
        token = attach(set_span_in_context(span, seg.context))
        try:
            result = await self._inner.run_tool(call, tools, session_id=session_id, turn=turn, timeout=timeout,
                                                decision=decision, report=report, budget_left=budget_left)
        except SuspendCall as wait:
            detach(token)
            if type(wait).__name__ == "OutcomeUnknown":  # its worker was lost (a durable host)
                seg.tool_end(span, call, "outcome_unknown", error="worker_lost")
            else:
                seg.tool_end(span, call, "waiting_human" if isinstance(wait, WaitForHuman) else "suspended")
            raise
        except asyncio.CancelledError:
            detach(token)
            seg.tool_end(span, call, "outcome_unknown", error="interrupted")
            raise
        except BaseException as exc:
            detach(token)
            seg.tool_end(span, call, "failed", error=_error_type(exc))
            raise
        detach(token)
        if result.is_error:
            seg.tool_end(span, call, "failed", result, str((result.metadata or {}).get("error") or "tool_error"))
        else:
            seg.tool_end(span, call, "completed", result)
        return result


class SegmentObserver:
    """The FSM's own view on the segment's ``invoke_agent`` span, as events (observer methods only:
    it never changes the run; it takes no stream deltas, so a run it watches streams no more than it
    would without it)."""

    __slots__ = ("seg",)

    def __init__(self, segment: Segment) -> None:
        self.seg = segment

    def on_transition(self, ev: TransitionEvent) -> None:
        seg = self.seg
        seg.turn, seg.state = ev.turn, ev.to_state
        attrs: dict[str, Any] = {"fsm_agent.transition.from": ev.from_state, "fsm_agent.transition.trigger": ev.trigger,
                                 "fsm_agent.transition.to": ev.to_state}
        if seg.inst.content:
            attrs["fsm_agent.transition.reason"] = seg.mask(ev.reason)
        seg.span.add_event(N.EV_TRANSITION, attrs)

    def on_policy_decision(self, ev: PolicyDecision) -> None:
        seg = self.seg
        attrs: dict[str, Any] = {"fsm_agent.middleware": ev.middleware, "fsm_agent.decision": ev.decision,
                                 "fsm_agent.decision.hook": ev.hook, N.TURN: ev.turn}
        if ev.call is not None:
            attrs[G.GEN_AI_TOOL_NAME] = ev.call.name
            attrs[G.GEN_AI_TOOL_CALL_ID] = ev.call.id
        if ev.stop_reason is not None:
            attrs[N.STOP_REASON] = ev.stop_reason
        if seg.inst.content and ev.reason:
            attrs["fsm_agent.decision.reason"] = seg.mask(ev.reason)
        seg.span.add_event(N.EV_DECISION, attrs)

    def on_approval_requested(self, ev: ApprovalRequested) -> None:
        self.seg.span.add_event(N.EV_APPROVAL, {
            "fsm_agent.pending.count": len(ev.pending), "fsm_agent.pending.tools": [p.call.name for p in ev.pending],
            "fsm_agent.pending.call_ids": [p.call.id for p in ev.pending],
            "fsm_agent.pending.reasons": [str(p.reason) for p in ev.pending], N.TURN: ev.turn})

    def on_budget_warning(self, ev: BudgetWarning) -> None:
        self.seg.span.add_event(N.EV_BUDGET, {"fsm_agent.budget": ev.budget, "fsm_agent.budget.used": float(ev.used),
                                              "fsm_agent.budget.limit": float(ev.limit), N.TURN: ev.turn})

    def on_model_retry(self, ev: ModelRetry) -> None:
        if ev.layer == "provider":
            return  # an HTTP attempt retried inside one call: an event of that call's chat span
        attrs: dict[str, Any] = {"fsm_agent.retry.attempt": ev.attempt, E.ERROR_TYPE: ev.kind,
                                 "fsm_agent.retry.delay_s": float(ev.delay_s),
                                 "fsm_agent.retry.server_hint": ev.server_hint, "fsm_agent.retry.layer": ev.layer,
                                 N.TURN: ev.turn}
        if ev.status is not None:
            attrs["http.response.status_code"] = ev.status
        self.seg.span.add_event(N.EV_RETRY, attrs)

    def on_plan_updated(self, ev: PlanUpdated) -> None:
        plan = ev.plan
        done = sum(1 for n in plan.nodes if getattr(getattr(n, "status", None), "value", None) == "passed")
        attrs: dict[str, Any] = {"fsm_agent.plan.version": plan.version, "fsm_agent.plan.nodes": len(plan.nodes),
                                 "fsm_agent.plan.done": done, N.TURN: ev.turn}
        if self.seg.inst.content:
            attrs["fsm_agent.plan.reason"] = self.seg.mask(ev.reason)
        self.seg.span.add_event(N.EV_PLAN, attrs)

    def on_tool_finished(self, ev: ToolFinished) -> None:
        if ev.call.id not in self.seg.ran:
            self.seg.decided_tool(ev.call, ev.result)

    def on_plugin_event(self, ev: Any) -> None:
        tag = getattr(ev, "TAG", type(ev).__name__)
        seg = self.seg
        if tag == "compaction":
            rec = ev.record
            seg.span.add_event(N.EV_COMPACTION, {
                "fsm_agent.compaction.level": str(rec.level), "fsm_agent.compaction.trigger": str(ev.trigger),
                "fsm_agent.compaction.tokens_before": int(ev.tokens_before),
                "fsm_agent.compaction.tokens_after": int(ev.tokens_after), "fsm_agent.compaction.first": int(rec.first),
                "fsm_agent.compaction.last": int(rec.last), "fsm_agent.compaction.edits": len(rec.edits),
                N.TURN: ev.turn})
        elif tag == "compaction.failed":
            seg.span.add_event(N.EV_COMPACTION_FAILED, {
                "fsm_agent.compaction.level": str(ev.level), "fsm_agent.compaction.trigger": str(ev.trigger),
                "fsm_agent.compaction.reason": str(ev.reason), "fsm_agent.compaction.tokens": int(ev.tokens),
                N.TURN: ev.turn})
        else:
            seg.span.add_event(N.EV_PLUGIN, {"fsm_agent.event.type": str(tag)})

