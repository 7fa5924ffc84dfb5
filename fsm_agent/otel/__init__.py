"""OpenTelemetry GenAI traces and metrics of fsm_agent runs (the extra ``fsm-agent[otel]``).

Turn it on for the process with :func:`instrument` (``fsm_agent.instrument()``), or per agent with
``Agent(instrument=True)`` / ``Agent(instrument=OtelSettings(...))``; ``Agent(instrument=False)``
keeps an agent dark. Both use the global tracer and meter providers unless given their own. The
command line's ``--otel`` exports over OTLP/HTTP as the standard ``OTEL_*`` variables say
(:func:`configure_otlp`).

This package imports nothing of OpenTelemetry until instrumentation is turned on: ``import
fsm_agent`` costs nothing, and a run of an agent without instrumentation pays one ``if``.

What a run shows (``docs/observability.md`` has a real run's tree):

* one ``invoke_agent {agent}`` span per run segment (a start or a resume, up to its stop), with
  ``gen_ai.conversation.id`` = the session id, the stop reason and whether it can be resumed; a
  resumed segment links to the segment it continues; the FSM's own view as its events
  (transitions, middleware decisions naming the plugin, approvals, budget warnings, retries,
  compactions, plan changes);
* one ``chat {model}`` span per model call (plugins' side calls included), one ``execute_tool
  {tool}`` span per tool call with its call id, its effect kind and the ledger outcome;
* the metrics ``gen_ai.client.token.usage``, ``gen_ai.client.operation.duration``,
  ``fsm_agent.run.cost`` (USD), ``fsm_agent.tool.calls`` (by outcome), ``fsm_agent.run.stops``
  (by reason).

Hosts that run a segment's effects elsewhere (Temporal activities) wrap their port with
:func:`activity_port`: its spans continue the trace current there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from .settings import CAPTURE_ENV, CONTENT_MODES, OtelSettings

if TYPE_CHECKING:
    from ..machine.port import EffectPort
    from .instrumentation import Instrumentation

__all__ = ["CAPTURE_ENV", "CONTENT_MODES", "OtelSettings", "activity_port", "active", "build", "caller_context",
           "configure_otlp", "instrument", "tracing_muted", "uninstrument"]

tracing_muted: ContextVar[bool] = ContextVar("fsm_agent_tracing_muted", default=False)
"""True where runs must not make spans of their own: inside a durable host's workflow code, which
is replayed (its effects are traced where they run, see :func:`activity_port`)."""

_process: list[Any] = [None]
"""The process-wide :class:`~fsm_agent.otel.instrumentation.Instrumentation` (``[None]``: off)."""


def _load() -> Any:
    try:
        from . import instrumentation
    except ImportError as exc:
        raise ConfigurationError(f"OpenTelemetry is not installed ({exc}); install the extra: "
                                 "pip install 'fsm-agent[otel]'") from exc
    return instrumentation


def build(settings: OtelSettings | bool | None = None) -> Instrumentation:
    """An :class:`~fsm_agent.otel.instrumentation.Instrumentation` for ``settings`` (``None`` or
    ``True``: the defaults), not turned on anywhere.

    Raises:
        ConfigurationError: OpenTelemetry is not installed; ``settings`` is not an :class:`OtelSettings`.
    """
    if settings is None or settings is True:
        settings = OtelSettings()
    if not isinstance(settings, OtelSettings):
        raise ConfigurationError(f"instrument takes True, False, None or an OtelSettings, not {settings!r}")
    return _load().Instrumentation(settings)  # type: ignore[no-any-return]


def instrument(settings: OtelSettings | None = None, *, tracer_provider: Any = None, meter_provider: Any = None,
               capture_content: bool | str | None = None, agent_name: str | None = None) -> Instrumentation:
    """Trace every run of every :class:`~fsm_agent.Agent` of this process (an agent's own
    ``instrument=`` wins). Calling it again replaces the settings. Returns the instrumentation.

    Args:
        settings: all the settings at once; or give the ones below (see :class:`OtelSettings`).

    Raises:
        ConfigurationError: OpenTelemetry is not installed (``pip install 'fsm-agent[otel]'``), or a
            bad setting.
    """
    if settings is None:
        kw: dict[str, Any] = {"tracer_provider": tracer_provider, "meter_provider": meter_provider,
                              "capture_content": capture_content}
        if agent_name is not None:
            kw["agent_name"] = agent_name
        settings = OtelSettings(**kw)
    inst = build(settings)
    _process[0] = inst
    return inst


def uninstrument() -> None:
    """Stop tracing the runs of this process (agents with their own ``instrument=`` go on)."""
    _process[0] = None


def active() -> Instrumentation | None:
    """The process-wide instrumentation, or ``None``."""
    return _process[0]  # type: ignore[no-any-return]


def activity_port(port: EffectPort, *, session_id: str, turn: int = 0, agent_name: str | None = None,
                  instrumentation: Instrumentation | None = None) -> EffectPort:
    """``port`` traced as in a run segment, for a host that runs a segment's effects on other workers
    (Temporal activities): its ``call_model`` and ``run_tool`` make ``chat`` and ``execute_tool``
    spans, children of the span current where they run (the activity's span, with Temporal's
    OpenTelemetry interceptor), with ``gen_ai.conversation.id`` = ``session_id``. Returns ``port``
    itself when no instrumentation is on (``instrumentation`` or the process-wide one)."""
    inst = instrumentation or _process[0]
    if inst is None:
        return port
    return inst.activity_port(port, session_id=session_id, turn=turn,  # type: ignore[no-any-return]
                              agent_name=agent_name)


@contextlib.contextmanager
def caller_context(metadata: Mapping[str, Any] | None) -> Iterator[None]:
    """Make the caller's trace that a session's ``metadata`` carries (``otel_parent``, a W3C
    ``traceparent``/``tracestate`` the HTTP server stored) the current context for the block, so
    that what starts there (a durable host's workflow, through Temporal's interceptor) continues it.
    Does nothing when the metadata carries none or OpenTelemetry is not installed."""
    value = (metadata or {}).get("otel_parent")
    if not (isinstance(value, dict) and isinstance(value.get("traceparent"), str)):
        yield
        return
    try:
        from opentelemetry import context as otel_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        yield
        return
    token = otel_context.attach(TraceContextTextMapPropagator().extract(
        {k: v for k, v in value.items() if isinstance(v, str)}))
    try:
        yield
    finally:
        otel_context.detach(token)


def configure_otlp(*, service_name: str = "fsm-agent") -> Any:
    """Export over OTLP/HTTP (protobuf) as the standard ``OTEL_*`` variables say
    (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``..._HEADERS``,
    ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES`` ...): installs a global tracer provider with
    a batch span processor and a global meter provider with a periodic reader, then
    :func:`instrument`. ``service_name`` is used when the environment names none. Returns a
    ``shutdown()`` callable that flushes and stops both (call it before the process exits).

    Raises:
        ConfigurationError: the exporter is not installed (``pip install 'fsm-agent[otel]'``).
    """
    try:
        from .export import configure
    except ImportError as exc:
        raise ConfigurationError(f"the OTLP exporter is not installed ({exc}); install the extra: "
                                 "pip install 'fsm-agent[otel]'") from exc
    tracer_provider, meter_provider, shutdown = configure(service_name=service_name)
    instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    return shutdown
