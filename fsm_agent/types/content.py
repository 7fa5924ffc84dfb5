"""Content blocks: the parts of a message (seed 003 §2.1, ContentBlock).

Every block is a frozen, slotted attrs class whose ``TAG`` is the name it is
stored under (the ``"type"`` key of its JSON form). Tags are public forever.

A block never holds a wire format; protocol modules map blocks to and from the
wire. Provider-specific data that must be sent back verbatim (a Responses
reasoning item id, an Anthropic thinking signature) lives in typed fields or in
``provider_data``, never in the text.
"""

from __future__ import annotations

from typing import Any, ClassVar, Union

from attrs import field, frozen

__all__ = [
    "AudioBlock",
    "ContentBlock",
    "ExtensionBlock",
    "FileBlock",
    "ImageBlock",
    "TextBlock",
    "ThinkingBlock",
    "ToolResultBlock",
    "ToolUseBlock",
]


def _tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else tuple(value)


@frozen
class TextBlock:
    """Plain text."""

    TAG: ClassVar[str] = "text"
    text: str
    """The text, as the model produced or the user wrote it."""
    citations: tuple[Any, ...] = field(default=(), converter=_tuple)
    """Provider citation / annotation objects (JSON), kept verbatim; empty when none."""

    @property
    def type(self) -> str:
        return self.TAG


@frozen
class ImageBlock:
    """An image, inline (base64 ``data``) or by ``url``."""

    TAG: ClassVar[str] = "image"
    data: str | None = None
    """Base64-encoded bytes, or ``None`` when ``url`` is used."""
    media_type: str | None = None
    """MIME type such as ``image/png``; required with ``data``."""
    url: str | None = None
    """An https or data URL, or ``None`` when ``data`` is used."""
    detail: str = "auto"
    """OpenAI detail hint: ``auto``, ``low`` or ``high``."""

    @property
    def type(self) -> str:
        return self.TAG


@frozen
class AudioBlock:
    """Audio input, base64-encoded."""

    TAG: ClassVar[str] = "audio"
    data: str
    """Base64-encoded audio bytes."""
    format: str
    """Container format: ``wav``, ``mp3`` ..."""

    @property
    def type(self) -> str:
        return self.TAG


@frozen
class FileBlock:
    """A document (PDF, text ...): inline, by URL, or by a provider file id."""

    TAG: ClassVar[str] = "file"
    data: str | None = None
    """Base64-encoded bytes, or ``None``."""
    media_type: str | None = None
    """MIME type such as ``application/pdf``."""
    url: str | None = None
    file_id: str | None = None
    """A provider-side file id (OpenAI ``file-...``)."""
    filename: str | None = None

    @property
    def type(self) -> str:
        return self.TAG


@frozen
class ToolUseBlock:
    """A tool call the model made.

    ``input`` is the parsed argument object. When the model's argument text was
    not valid JSON (or not an object), ``input`` is ``{}`` and ``raw_input``
    keeps the text so the driver can answer with an error tool result instead
    of calling the tool with made-up arguments.
    """

    TAG: ClassVar[str] = "tool_use"
    id: str
    """The call id the tool result must reference (``call_...``, ``toolu_...``)."""
    name: str
    """Tool name."""
    input: dict[str, Any] = field(factory=dict)
    """Parsed JSON arguments."""
    raw_input: str | None = None
    """The argument text when it could not be parsed into an object, else ``None``."""
    provider_data: dict[str, Any] | None = None
    """Protocol data to send back verbatim (Responses ``fc_`` item id, server-tool kind), or ``None``."""

    @property
    def type(self) -> str:
        return self.TAG


@frozen
class ToolResultBlock:
    """A tool result as a content block (Anthropic ``tool_result`` shape)."""

    TAG: ClassVar[str] = "tool_result"
    tool_use_id: str
    content: tuple[ContentBlock, ...] = field(default=(), converter=_tuple)
    is_error: bool = False

    @property
    def type(self) -> str:
        return self.TAG


@frozen
class ThinkingBlock:
    """Model reasoning.

    Anthropic thinking carries a ``signature`` that must be sent back with it;
    redacted thinking carries only opaque ``redacted_data``, sent back as
    received. DeepSeek/Qwen ``reasoning_content`` becomes a block with no
    signature. OpenAI Responses reasoning items keep their id and
    ``encrypted_content`` in ``provider_data``.
    """

    TAG: ClassVar[str] = "thinking"
    thinking: str = ""
    """The reasoning text (summary text for OpenAI Responses); empty when redacted."""
    signature: str | None = None
    """Anthropic signature, or ``None``."""
    redacted_data: str | None = None
    """Opaque data of an Anthropic ``redacted_thinking`` block, or ``None``."""
    source: str | None = None
    """Protocol that produced it (``anthropic``, ``openai-responses``, ``openai-chat``); reasoning is sent
    back only to the protocol that made it."""
    provider_data: dict[str, Any] | None = None
    """Protocol data to send back verbatim, or ``None``."""

    @property
    def type(self) -> str:
        return self.TAG

    @property
    def redacted(self) -> bool:
        return self.redacted_data is not None


@frozen
class ExtensionBlock:
    """A block the runtime does not model (server tool use, search results ...), kept verbatim."""

    TAG: ClassVar[str] = "extension"
    kind: str
    """The wire type, e.g. ``server_tool_use`` or ``web_search_tool_result``."""
    data: dict[str, Any] = field(factory=dict)
    """The wire object as received."""
    source: str | None = None
    """Protocol that produced it; it is sent back only to that protocol."""

    @property
    def type(self) -> str:
        return self.TAG


ContentBlock = Union[
    TextBlock,
    ImageBlock,
    AudioBlock,
    FileBlock,
    ToolUseBlock,
    ToolResultBlock,
    ThinkingBlock,
    ExtensionBlock,
]
"""Any content block."""
