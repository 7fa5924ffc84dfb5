"""Stream events (seed 003 Decision-03) and the aggregator that turns them into a response.

A provider stream yields :data:`StreamEvent` values and ends with exactly one
:class:`MessageComplete` whose ``full_response`` is the finished
:class:`~fsm_agent.types.requests.MessageResponse`: consumers never need to
aggregate deltas themselves. Protocol modules aggregate through one
:class:`PartialMessageResponse`, so the streamed result and the events agree by
construction.

Block indexes are the runtime's own (0, 1, 2 ... in order of first
appearance), not the wire's: OpenAI tool-call indexes may start at 1 or repeat
(cases B07, B08).
"""

from __future__ import annotations

from typing import Any, ClassVar, Union

import orjson
from attrs import define, field, frozen

from .content import ContentBlock, ExtensionBlock, TextBlock, ThinkingBlock, ToolUseBlock
from .messages import AssistantMessage, ModelStopReason, Usage
from .requests import MessageResponse

__all__ = [
    "ContentBlockEnd",
    "ContentBlockStart",
    "CostUpdate",
    "ErrorEvent",
    "MessageComplete",
    "MessageStart",
    "PartialMessageResponse",
    "RefusalDelta",
    "StreamEvent",
    "TextDelta",
    "ThinkingDelta",
    "ToolCallArgumentsDelta",
    "ToolCallEnd",
    "events_for_response",
    "parse_tool_arguments",
]


@frozen
class MessageStart:
    """The response began."""

    TAG: ClassVar[str] = "message_start"
    id: str
    model: str


@frozen
class ContentBlockStart:
    """A content block begins at ``index``.

    ``block_type`` is a content-block tag (``text``, ``thinking``, ``tool_use``,
    ``extension``). Tool-use blocks carry ``id`` and ``name``; thinking and
    extension blocks may carry wire data in ``data`` (a redacted thinking
    block's opaque data arrives whole here).
    """

    TAG: ClassVar[str] = "content_block_start"
    index: int
    block_type: str
    id: str | None = None
    name: str | None = None
    data: dict[str, Any] | None = None


@frozen
class ContentBlockEnd:
    """The block at ``index`` is complete.

    ``data`` carries wire data known only at the end of a block (an Anthropic thinking
    ``signature``, final citations, a Responses reasoning item's summary and
    ``encrypted_content``, a server-tool item), merged into the block, so that folding the
    events reproduces the final response exactly. A block may get one more ``ContentBlockEnd``
    after its first: its ``data`` revises what the block holds (a Responses stream whose final
    payload differs from the item's ``done`` event); folding merges it the same way.
    """

    TAG: ClassVar[str] = "content_block_end"
    index: int
    data: dict[str, Any] | None = None


@frozen
class TextDelta:
    """Text appended to the text block at ``index``."""

    TAG: ClassVar[str] = "text_delta"
    index: int
    text: str


@frozen
class ThinkingDelta:
    """Reasoning text appended to the thinking block at ``index``."""

    TAG: ClassVar[str] = "thinking_delta"
    index: int
    text: str


@frozen
class RefusalDelta:
    """Refusal text (OpenAI ``delta.refusal``)."""

    TAG: ClassVar[str] = "refusal_delta"
    text: str


@frozen
class ToolCallArgumentsDelta:
    """Argument JSON text appended to the tool-use block at ``index``."""

    TAG: ClassVar[str] = "tool_call_arguments_delta"
    index: int
    arguments: str


@frozen
class ToolCallEnd:
    """The tool call at ``index`` is complete; ``call`` is the finished block."""

    TAG: ClassVar[str] = "tool_call_end"
    index: int
    call: ToolUseBlock


@frozen
class CostUpdate:
    """Usage and cost so far of this call (cumulative for the call, not the run).

    The provider layer prices it (:func:`fsm_agent.providers.base.cost_update`, the one place a
    stream's cost is computed), so ``cost_usd`` always equals
    ``fsm_agent.pricing.cost_usd(model, usage)`` for the model the response names.
    """

    TAG: ClassVar[str] = "cost_update"
    usage: Usage
    cost_usd: float | None = None
    """The call's cost so far in US dollars (not cents, not per token), priced by
    :mod:`fsm_agent.pricing` from ``usage``. ``None`` when the model has no known price (or the
    response named no model): unknown, never a guessed zero. A local model priced at zero gives
    ``0.0``."""


@frozen
class MessageComplete:
    """The last event of a successful stream: the whole response."""

    TAG: ClassVar[str] = "message_complete"
    full_response: MessageResponse


@frozen
class ErrorEvent:
    """The stream failed; emitted just before the provider raises the typed error.

    ``kind`` is :attr:`fsm_agent.errors.ProviderError.kind`.
    """

    TAG: ClassVar[str] = "error"
    kind: str
    message: str


StreamEvent = Union[
    MessageStart,
    ContentBlockStart,
    ContentBlockEnd,
    TextDelta,
    ThinkingDelta,
    RefusalDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    CostUpdate,
    MessageComplete,
    ErrorEvent,
]
"""Any stream event."""


def parse_tool_arguments(text: str | None) -> tuple[dict[str, Any], str | None]:
    """Parse tool-call argument text into ``(input, raw_input)``.

    Empty, whitespace-only or ``null`` arguments mean "no arguments" and give
    ``({}, None)`` (case B11: a parameterless tool streamed with
    ``arguments: null``). Text that is not a JSON object gives ``({}, text)`` so
    the caller can report it instead of running the tool with made-up input.
    """
    if text is None:
        return {}, None
    stripped = text.strip()
    if not stripped or stripped == "null":
        return {}, None
    try:
        value = orjson.loads(stripped)
    except orjson.JSONDecodeError:
        return {}, text
    if isinstance(value, dict):
        return value, None
    return {}, text


@define(slots=True)
class _Block:
    kind: str
    parts: list[str] = field(factory=list)
    id: str | None = None
    name: str | None = None
    signature: str | None = None
    redacted_data: str | None = None
    source: str | None = None
    data: dict[str, Any] | None = None
    closed: bool = False


@define(slots=True)
class PartialMessageResponse:
    """Aggregates stream events into a :class:`MessageResponse`.

    Protocol modules :meth:`apply` every event they emit and set what has no
    event of its own (stop reason, thinking signature, provider extras) with the
    ``set_*`` methods. :meth:`finalize` builds the response; :meth:`snapshot`
    does the same without closing anything, for the ``partial`` of an error.
    """

    provider: str = ""
    source: str | None = None
    """Protocol tag recorded on thinking/extension blocks (``anthropic``, ``openai-chat`` ...)."""
    id: str = ""
    model: str = ""
    blocks: list[_Block] = field(factory=list)
    stop_reason: ModelStopReason | None = None
    raw_stop_reason: str | None = None
    usage: Usage | None = None
    refusal_parts: list[str] = field(factory=list)
    extra: dict[str, Any] = field(factory=dict)
    message_data: dict[str, Any] | None = None

    # -- applying events -------------------------------------------------
    def apply(self, event: StreamEvent) -> None:
        """Fold one event into the state. Unknown indexes raise ``IndexError`` (a parser bug)."""
        t = type(event)
        if t is TextDelta:
            self.blocks[event.index].parts.append(event.text)  # type: ignore[union-attr]
        elif t is ToolCallArgumentsDelta:
            self.blocks[event.index].parts.append(event.arguments)  # type: ignore[union-attr]
        elif t is ThinkingDelta:
            self.blocks[event.index].parts.append(event.text)  # type: ignore[union-attr]
        elif t is ContentBlockStart:
            assert isinstance(event, ContentBlockStart)
            if event.index != len(self.blocks):
                raise IndexError(f"block {event.index} started out of order (have {len(self.blocks)})")
            block = _Block(event.block_type, id=event.id, name=event.name, source=self.source)
            if event.data:
                block.data = dict(event.data)
                block.signature = event.data.get("signature")
                block.redacted_data = event.data.get("redacted_data")
            self.blocks.append(block)
        elif t is ContentBlockEnd or t is ToolCallEnd:
            block = self.blocks[event.index]  # type: ignore[union-attr]
            block.closed = True
            data = event.data if t is ContentBlockEnd else None  # type: ignore[union-attr]
            if data:
                if "signature" in data:
                    block.signature = data["signature"]
                rest = {k: v for k, v in data.items() if k != "signature"}
                if rest:
                    block.data = {**(block.data or {}), **rest}
        elif t is RefusalDelta:
            self.refusal_parts.append(event.text)  # type: ignore[union-attr]
        elif t is CostUpdate:
            self.usage = event.usage  # type: ignore[union-attr]
        elif t is MessageStart:
            assert isinstance(event, MessageStart)
            if event.id:
                self.id = event.id
            if event.model:
                self.model = event.model
        # MessageComplete / ErrorEvent carry no state to fold.

    def set_stop_reason(self, reason: ModelStopReason, raw: str | None) -> None:
        self.stop_reason = reason
        self.raw_stop_reason = raw

    def set_thinking_signature(self, index: int, signature: str) -> None:
        """Attach an Anthropic signature to the thinking block at ``index`` (it arrives after the text)."""
        block = self.blocks[index]
        block.signature = (block.signature or "") + signature

    def set_block_data(self, index: int, **data: Any) -> None:
        """Merge protocol data into the block at ``index`` (kept in ``provider_data``)."""
        block = self.blocks[index]
        block.data = {**(block.data or {}), **data}

    # -- building the response --------------------------------------------
    def _build_block(self, b: _Block) -> ContentBlock | None:
        if b.kind == "text":
            text = "".join(b.parts)
            if not text:
                return None
            citations = tuple((b.data or {}).get("citations", ()))
            return TextBlock(text, citations)
        if b.kind == "tool_use":
            args_text = "".join(b.parts) if b.parts else None
            args, raw = parse_tool_arguments(args_text)
            pdata = {k: v for k, v in (b.data or {}).items()} or None
            if pdata and "arguments_error" in pdata:  # the stream could not be trusted with them: never run
                args, raw = {}, args_text or ""
            return ToolUseBlock(b.id or "", b.name or "", args, raw, pdata)
        if b.kind == "thinking":
            pdata = {k: v for k, v in (b.data or {}).items() if k not in ("signature", "redacted_data")}
            return ThinkingBlock(
                "".join(b.parts), b.signature, b.redacted_data, b.source, pdata or None
            )
        data = dict(b.data or {})
        kind = data.pop("kind", b.kind)
        if b.parts:
            data["partial_json"] = "".join(b.parts)
        return ExtensionBlock(kind, data, b.source)

    def snapshot(self) -> MessageResponse:
        """The response as it stands, for a stream that failed part-way."""
        content = tuple(x for x in (self._build_block(b) for b in self.blocks) if x is not None)
        refusal = "".join(self.refusal_parts) if self.refusal_parts else None
        stop = self.stop_reason
        if stop is None:
            if any(isinstance(c, ToolUseBlock) for c in content):
                stop = ModelStopReason.TOOL_USE
            elif refusal is not None:
                stop = ModelStopReason.REFUSAL
            else:
                stop = ModelStopReason.END_TURN
        return MessageResponse(
            id=self.id,
            model=self.model,
            message=AssistantMessage(content, self.message_data),
            stop_reason=stop,
            raw_stop_reason=self.raw_stop_reason,
            usage=self.usage,
            provider=self.provider,
            refusal=refusal,
            extra=dict(self.extra),
        )

    def finalize(self) -> MessageResponse:
        """Close every open block and return the finished response."""
        for b in self.blocks:
            b.closed = True
        return self.snapshot()

    def open_tool_blocks(self) -> list[int]:
        """Indexes of tool-use blocks not yet closed."""
        return [i for i, b in enumerate(self.blocks) if b.kind == "tool_use" and not b.closed]

    def tool_block(self, index: int) -> ToolUseBlock:
        """The tool-use block at ``index`` as it stands."""
        built = self._build_block(self.blocks[index])
        assert isinstance(built, ToolUseBlock)
        return built


def events_for_response(response: MessageResponse, cost_usd: float | None = None) -> list[StreamEvent]:
    """The event sequence a stream of ``response`` would have produced (for servers that ignore
    ``stream: true`` and for the constrained tool mode). Ends with :class:`MessageComplete`.
    ``cost_usd``: the call's cost for its :class:`CostUpdate` (priced by the caller; ``None``: unknown)."""
    out: list[StreamEvent] = [MessageStart(response.id, response.model)]
    for i, block in enumerate(response.message.content):
        if isinstance(block, TextBlock):
            cites = {"citations": list(block.citations)} if block.citations else None
            out += [ContentBlockStart(i, "text", data=cites), TextDelta(i, block.text), ContentBlockEnd(i)]
        elif isinstance(block, ToolUseBlock):
            out.append(ContentBlockStart(i, "tool_use", block.id, block.name, block.provider_data))
            if block.input or block.raw_input:
                out.append(ToolCallArgumentsDelta(i, block.raw_input or orjson.dumps(block.input).decode()))
            out += [ToolCallEnd(i, block), ContentBlockEnd(i)]
        elif isinstance(block, ThinkingBlock):
            data = {**(block.provider_data or {}),
                    **({"redacted_data": block.redacted_data} if block.redacted_data is not None else {})}
            out.append(ContentBlockStart(i, "thinking", data=data or None))
            if block.thinking:
                out.append(ThinkingDelta(i, block.thinking))
            out.append(ContentBlockEnd(i, {"signature": block.signature} if block.signature else None))
        elif isinstance(block, ExtensionBlock):
            out += [ContentBlockStart(i, "extension", data={**block.data, "kind": block.kind}), ContentBlockEnd(i)]
        else:
            out += [ContentBlockStart(i, block.TAG), ContentBlockEnd(i)]
    if response.refusal:
        out.append(RefusalDelta(response.refusal))
    if response.usage is not None:
        out.append(CostUpdate(response.usage, cost_usd))
    out.append(MessageComplete(response))
    return out
