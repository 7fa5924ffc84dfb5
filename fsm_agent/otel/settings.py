"""What instrumentation does, as a value: :class:`OtelSettings` (imports nothing of OpenTelemetry)."""

from __future__ import annotations

from typing import Any

from attrs import field, frozen

from ..errors import ConfigurationError

__all__ = ["CAPTURE_ENV", "CONTENT_MODES", "OtelSettings"]

CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
"""The standard switch for message content (``opentelemetry-util-genai``'s): ``NO_CONTENT`` (the
default), ``SPAN_ONLY``, ``EVENT_ONLY`` or ``SPAN_AND_EVENT``."""

CONTENT_MODES = ("NO_CONTENT", "SPAN_ONLY", "EVENT_ONLY", "SPAN_AND_EVENT")
"""The values of :data:`CAPTURE_ENV` (``ContentCapturingMode`` of ``opentelemetry-util-genai``)."""


def _capture(value: Any) -> bool | str | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().upper() in CONTENT_MODES:
        return value.strip().upper()
    raise ConfigurationError(f"capture_content must be None (read {CAPTURE_ENV}), True, False or one of "
                             f"{', '.join(CONTENT_MODES)}; got {value!r}")


@frozen
class OtelSettings:
    """How an agent's runs are traced (``Agent(instrument=OtelSettings(...))`` or
    :func:`fsm_agent.instrument`).

    Args:
        tracer_provider: where spans go (default ``None``: the global tracer provider, looked up at
            each span, so one configured later is used).
        meter_provider: where metrics go (default ``None``: the global meter provider).
        capture_content: message content (inputs, outputs, system instructions, tool arguments and
            results) on spans: ``None`` (default) reads :data:`CAPTURE_ENV`, whose default is off;
            ``True`` is ``SPAN_ONLY``; ``False`` is off whatever the environment says; or a mode
            name of :data:`CONTENT_MODES`. Content passes through every middleware's
            ``mask_for_telemetry`` first (the ``redaction`` plugin has one), so a configured secret
            never reaches a span.
        agent_name: ``gen_ai.agent.name`` and the ``invoke_agent {name}`` span name (default
            ``fsm_agent``).
        metrics: record the metrics (``gen_ai.client.token.usage``, ``gen_ai.client.operation.duration``,
            cost, tool calls by outcome, stops by reason); default ``True``.

    Raises:
        ConfigurationError: a ``capture_content`` that is none of the above, an empty ``agent_name``.
    """

    tracer_provider: Any = None
    meter_provider: Any = None
    capture_content: bool | str | None = field(default=None, converter=_capture)
    agent_name: str = "fsm_agent"
    metrics: bool = True

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.agent_name, str) or not self.agent_name.strip():
            raise ConfigurationError(f"agent_name must be a non-empty string, not {self.agent_name!r}")
