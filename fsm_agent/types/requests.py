"""Provider-neutral request and response (seed 003: MessageRequest, MessageResponse)."""

from __future__ import annotations

from typing import Any, TypeVar, overload

from attrs import evolve, field, frozen

from ..errors import ExtraTypeError
from .content import _tuple, ContentBlock, TextBlock, ThinkingBlock, ToolUseBlock
from .messages import AssistantMessage, Message, ModelStopReason, Usage
from .structured import OutputSchema

__all__ = [
    "MessageRequest",
    "MessageResponse",
    "ThinkingConfig",
    "ToolDefinition",
]

T = TypeVar("T")
_MISSING = object()


@frozen
class ToolDefinition:
    """A tool as the model sees it: name, description and a JSON Schema for its arguments."""

    name: str
    """Unique within a request; ``^[a-zA-Z0-9_-]{1,64}$`` (the strictest provider rule, OpenAI's)."""
    description: str = ""
    parameters: dict[str, Any] = field(factory=lambda: {"type": "object", "properties": {}})
    """JSON Schema (draft 2020-12) of the argument object."""
    strict: bool | None = None
    """OpenAI strict mode, or ``None`` to leave it to the provider."""


@frozen
class ThinkingConfig:
    """Ask for model reasoning. Each protocol maps what it supports and ignores the rest."""

    enabled: bool = True
    budget_tokens: int | None = None
    """Anthropic ``budget_tokens`` (tokens), or ``None`` for the provider default."""
    effort: str | None = None
    """OpenAI ``reasoning.effort`` (``minimal``/``low``/``medium``/``high``), or ``None``."""
    summary: str | None = None
    """OpenAI Responses ``reasoning.summary`` (``auto``/``concise``/``detailed``), or ``None``."""


@frozen
class MessageRequest:
    """One model call, independent of the wire protocol.

    ``extra`` carries protocol features the neutral request does not model
    (Responses built-in tools, ``previous_response_id``, vendor switches such as
    Qwen ``enable_thinking``); read it with :meth:`get_extra`, which checks the type.
    """

    model: str
    """Model name as the provider knows it."""
    messages: tuple[Message, ...] = field(converter=_tuple)
    """The conversation, system messages included."""
    tools: tuple[ToolDefinition, ...] = field(default=(), converter=_tuple)
    tool_choice: str | dict[str, Any] | None = None
    """``auto``, ``none``, ``required``, ``{"name": ...}``, or ``None`` for the provider default."""
    max_tokens: int | None = None
    """Output token limit (tokens), or ``None`` for the provider default."""
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = field(default=(), converter=_tuple)
    """Stop sequences."""
    thinking: ThinkingConfig | None = None
    response_format: dict[str, Any] | None = None
    """OpenAI-style ``response_format`` (``{"type": "json_schema", "json_schema": {...}}``), or ``None``."""
    parallel_tool_calls: bool | None = None
    extra: dict[str, Any] = field(factory=dict)
    """Protocol-specific options, merged into the wire body by the protocol module that knows them."""
    output_schema: OutputSchema | None = None
    """The JSON Schema the answer must match, or ``None`` for free text. Sent in the provider's own
    format; an explicit ``response_format`` takes precedence on the wire. The answer is checked with
    :func:`fsm_agent.structured.parse_output`."""

    @overload
    def get_extra(self, key: str, kind: type[T]) -> T: ...
    @overload
    def get_extra(self, key: str, kind: type[T], default: T) -> T: ...

    def get_extra(self, key: str, kind: type[T], default: Any = _MISSING) -> T:
        """``extra[key]`` checked against ``kind``.

        Raises:
            KeyError: the key is absent and no default was given.
            ExtraTypeError: the value is not an instance of ``kind``.
        """
        if key not in self.extra:
            if default is _MISSING:
                raise KeyError(f"MessageRequest.extra has no key {key!r}")
            return default  # type: ignore[no-any-return]
        value = self.extra[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return value  # type: ignore[return-value]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ExtraTypeError(
                f"MessageRequest.extra[{key!r}] must be {kind.__name__}, got {type(value).__name__}: {value!r}"
            )
        return value

    def with_extra(self, **values: Any) -> MessageRequest:
        """A copy with ``values`` merged into ``extra``."""
        return evolve(self, extra={**self.extra, **values})


@frozen
class MessageResponse:
    """A complete model response; the single source of truth for one call.

    The streaming path's ``MessageComplete.full_response`` is equal to what the
    non-streaming call returns for the same answer.
    """

    id: str
    """Provider response id (``chatcmpl-...``, ``msg_...``, ``resp_...``); may be empty."""
    model: str
    """Model that answered, as reported by the provider."""
    message: AssistantMessage
    stop_reason: ModelStopReason
    raw_stop_reason: str | None = None
    """The wire value (``stop``, ``tool_calls``, ``end_turn`` ...), or ``None`` when absent."""
    usage: Usage | None = None
    """Reported usage, or ``None`` when the provider reported none (never a made-up zero)."""
    provider: str = ""
    """Profile that served the call."""
    refusal: str | None = None
    """The model's refusal text (OpenAI ``message.refusal``, Anthropic ``stop_details.explanation``), or ``None``."""
    extra: dict[str, Any] = field(factory=dict)
    """Other response data worth keeping (``system_fingerprint``, ``stop_details``, other choices)."""

    @property
    def content(self) -> tuple[ContentBlock, ...]:
        return self.message.content

    @property
    def text(self) -> str:
        return self.message.text

    @property
    def tool_calls(self) -> tuple[ToolUseBlock, ...]:
        return self.message.tool_calls

    @property
    def thinking(self) -> str:
        return "".join(b.thinking for b in self.message.content if isinstance(b, ThinkingBlock))

    @property
    def is_empty(self) -> bool:
        """True when there is no non-blank text, no tool call and no refusal."""
        for b in self.message.content:
            if isinstance(b, TextBlock) and b.text.strip():
                return False
            if not isinstance(b, (TextBlock, ThinkingBlock)):
                return False
        return self.refusal is None and self.stop_reason not in (
            ModelStopReason.REFUSAL,
            ModelStopReason.CONTENT_FILTERED,
            ModelStopReason.MAX_TOKENS,
            ModelStopReason.PAUSE_TURN,
        )
