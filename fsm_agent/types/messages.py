"""Messages (seed 003 Decision-01: a flat union), usage and the model stop reason.

``Message`` is one of :class:`SystemMessage`, :class:`UserMessage`,
:class:`UserImageMessage`, :class:`AssistantMessage`, :class:`ToolResultMessage`.
Each has a ``ROLE`` tag (the ``"role"`` key of its JSON form). An assistant
turn keeps text, thinking and tool calls in one ordered ``content`` tuple,
because their order is part of the answer.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, ClassVar, Union

from attrs import field, frozen

from .content import ContentBlock, TextBlock, ThinkingBlock, ToolUseBlock

__all__ = [
    "AssistantMessage",
    "Message",
    "ModelStopReason",
    "SystemMessage",
    "ToolResultMessage",
    "Usage",
    "UserImageMessage",
    "UserMessage",
]


def _blocks(value: Any) -> tuple[ContentBlock, ...]:
    if isinstance(value, str):
        return (TextBlock(value),)
    if isinstance(value, tuple):
        return value
    return tuple(value)


def _text_of(content: Iterable[ContentBlock]) -> str:
    return "".join(b.text for b in content if isinstance(b, TextBlock))


@frozen
class SystemMessage:
    """Instructions to the model (the system / developer prompt)."""

    ROLE: ClassVar[str] = "system"
    content: tuple[ContentBlock, ...] = field(converter=_blocks)
    """Text blocks; a ``str`` is accepted and wrapped."""

    @property
    def role(self) -> str:
        return self.ROLE

    @property
    def text(self) -> str:
        return _text_of(self.content)


@frozen
class UserMessage:
    """User input: text, images, audio, files."""

    ROLE: ClassVar[str] = "user"
    content: tuple[ContentBlock, ...] = field(converter=_blocks)
    """Content blocks; a ``str`` is accepted and wrapped in a :class:`TextBlock`."""

    @property
    def role(self) -> str:
        return self.ROLE

    @property
    def text(self) -> str:
        return _text_of(self.content)


@frozen
class UserImageMessage:
    """A user image, without building blocks by hand (seed 003 ``UserImage``)."""

    ROLE: ClassVar[str] = "user_image"
    data: str
    """Base64 bytes or an https/data URL."""
    mime_type: str
    detail: str = "auto"

    @property
    def role(self) -> str:
        return "user"

    @property
    def text(self) -> str:
        return ""


@frozen
class AssistantMessage:
    """One model turn: text, thinking and tool calls in the order the model produced them."""

    ROLE: ClassVar[str] = "assistant"
    content: tuple[ContentBlock, ...] = field(converter=_blocks)
    """Ordered blocks; a ``str`` is accepted and wrapped."""
    provider_data: dict[str, Any] | None = None
    """Protocol data to send back with this turn (e.g. a Responses message item id), or ``None``."""

    @property
    def role(self) -> str:
        return self.ROLE

    @property
    def text(self) -> str:
        """All text blocks joined."""
        return _text_of(self.content)

    @property
    def tool_calls(self) -> tuple[ToolUseBlock, ...]:
        """The tool-use blocks, in order."""
        return tuple(b for b in self.content if isinstance(b, ToolUseBlock))

    @property
    def thinking(self) -> str:
        return "".join(b.thinking for b in self.content if isinstance(b, ThinkingBlock))


@frozen
class ToolResultMessage:
    """The result of one tool call."""

    ROLE: ClassVar[str] = "tool"
    tool_call_id: str
    """Id of the :class:`ToolUseBlock` this answers."""
    content: tuple[ContentBlock, ...] = field(converter=_blocks)
    """Result blocks (usually one text block); a ``str`` is accepted."""
    is_error: bool = False
    """True when the tool failed, timed out, was denied, or the result was synthesized."""
    name: str | None = None
    """The tool's name, when known (some protocols and the constrained mode need it)."""
    metadata: dict[str, Any] | None = None
    """Runtime annotations, e.g. ``{"synthetic": "unavailable"}`` for a result the repair
    pipeline made up; never sent to the model."""

    @property
    def role(self) -> str:
        return self.ROLE

    @property
    def text(self) -> str:
        return _text_of(self.content)


Message = Union[SystemMessage, UserMessage, UserImageMessage, AssistantMessage, ToolResultMessage]
"""Any message."""


class ModelStopReason(str, enum.Enum):
    """How one model response ended. Not to be confused with the run's :class:`StopReason`.

    Mapping from the wire: OpenAI ``stop``→END_TURN, ``tool_calls``/``function_call``→TOOL_USE,
    ``length``→MAX_TOKENS, ``content_filter``→CONTENT_FILTERED; Anthropic names map one to one.
    """

    END_TURN = "end_turn"
    TOOL_USE = "tool_use"
    MAX_TOKENS = "max_tokens"
    STOP_SEQUENCE = "stop_sequence"
    CONTENT_FILTERED = "content_filtered"
    REFUSAL = "refusal"
    PAUSE_TURN = "pause_turn"


@frozen
class Usage:
    """Token usage of one call or a whole session. Units: tokens.

    ``estimated`` is true when a count was made locally (tiktoken) because the
    provider did not report usage (case B12): never mistake it for a bill.
    """

    input_tokens: int = 0
    """Prompt tokens, including cached ones."""
    output_tokens: int = 0
    """Completion tokens, including reasoning tokens."""
    cache_read_tokens: int = 0
    """Prompt tokens served from the provider's cache (subset of ``input_tokens`` for OpenAI;
    reported separately by Anthropic, where they are added into ``input_tokens``)."""
    cache_write_tokens: int = 0
    """Prompt tokens written to the cache (Anthropic ``cache_creation_input_tokens``)."""
    reasoning_tokens: int = 0
    """Reasoning tokens (subset of ``output_tokens``), when reported."""
    estimated: bool = False
    """True when any part of this count is a local estimate."""

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def __add__(self, other: Usage) -> Usage:
        if not isinstance(other, Usage):
            return NotImplemented
        return Usage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.cache_read_tokens + other.cache_read_tokens,
            self.cache_write_tokens + other.cache_write_tokens,
            self.reasoning_tokens + other.reasoning_tokens,
            self.estimated or other.estimated,
        )
