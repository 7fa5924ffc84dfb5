"""Message content as the GenAI conventions carry it (only with content capture on).

The shapes are ``opentelemetry-util-genai``'s (:class:`InputMessage`, :class:`OutputMessage` and their
parts) and so is the serialization (``get_content_attributes``), so a span carries what the official
instrumentations put there. Every string passes ``mask`` first (the chain's ``mask_for_telemetry``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson
from opentelemetry.util.genai._invocation import get_content_attributes
from opentelemetry.util.genai.types import (ContentCapturingMode, InputMessage, OutputMessage, ReasoningPart,
                                            TextPart, ToolCallRequestPart, ToolCallResponsePart)

from ..types.content import TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock
from ..types.messages import AssistantMessage, Message, ModelStopReason, SystemMessage, ToolResultMessage
from ..types.requests import MessageRequest, MessageResponse

__all__ = ["FINISH_REASONS", "chat_content", "masked", "tool_content"]

Mask = Callable[[str], str]

FINISH_REASONS: dict[ModelStopReason, str] = {
    ModelStopReason.END_TURN: "stop", ModelStopReason.STOP_SEQUENCE: "stop", ModelStopReason.MAX_TOKENS: "length",
    ModelStopReason.TOOL_USE: "tool_call", ModelStopReason.CONTENT_FILTERED: "content_filter",
    ModelStopReason.REFUSAL: "content_filter"}
"""The conventions' finish reasons for a model stop reason (others keep their own value)."""


def masked(value: Any, mask: Mask) -> Any:
    """``value`` (JSON-like) with ``mask`` applied to every string in it."""
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, Mapping):
        return {k: masked(v, mask) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [masked(v, mask) for v in value]
    return value


def _text(blocks: Any, mask: Mask) -> str:
    return mask("".join(b.text for b in blocks if isinstance(b, TextBlock)))


def _parts(message: Message, mask: Mask) -> list[Any]:
    parts: list[Any] = []
    for b in message.content:
        if isinstance(b, TextBlock):
            if b.text:
                parts.append(TextPart(mask(b.text)))
        elif isinstance(b, ToolUseBlock):
            args = b.input if b.raw_input is None else b.raw_input
            parts.append(ToolCallRequestPart(masked(args, mask), b.name, b.id))
        elif isinstance(b, ToolResultBlock):
            parts.append(ToolCallResponsePart(_text(b.content, mask), b.tool_use_id))
        elif isinstance(b, ThinkingBlock) and b.thinking:
            parts.append(ReasoningPart(mask(b.thinking)))
    return parts


def chat_content(request: MessageRequest, response: MessageResponse | None, mask: Mask,
                 mode: ContentCapturingMode, *, for_span: bool = True) -> dict[str, Any]:
    """``gen_ai.system_instructions``, ``gen_ai.input.messages`` and ``gen_ai.output.messages`` of one
    model call (images, audio and files are left out)."""
    system: list[Any] = []
    inputs: list[InputMessage] = []
    for m in request.messages:
        if isinstance(m, SystemMessage):
            system.append(TextPart(_text(m.content, mask)))
        elif isinstance(m, ToolResultMessage):
            inputs.append(InputMessage("tool", [ToolCallResponsePart(_text(m.content, mask), m.tool_call_id)]))
        else:
            inputs.append(InputMessage("assistant" if isinstance(m, AssistantMessage) else "user", _parts(m, mask)))
    outputs: list[OutputMessage] = []
    if response is not None:
        reason = FINISH_REASONS.get(response.stop_reason, response.stop_reason.value)
        outputs.append(OutputMessage("assistant", _parts(response.message, mask), reason))
    return get_content_attributes(input_messages=inputs, output_messages=outputs, system_instruction=system,
                                  tool_definitions=None, for_span=for_span, content_capturing_mode=mode)


def tool_content(call: Any, result: ToolResultMessage | None, mask: Mask) -> dict[str, str]:
    """``gen_ai.tool.call.arguments`` (JSON) and ``gen_ai.tool.call.result`` (the result's text)."""
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as G

    args = call.input if call.raw_input is None else call.raw_input
    out = {G.GEN_AI_TOOL_CALL_ARGUMENTS: mask(args) if isinstance(args, str) else
           orjson.dumps(masked(args, mask), option=orjson.OPT_NON_STR_KEYS).decode()}
    if result is not None:
        out[G.GEN_AI_TOOL_CALL_RESULT] = _text(result.content, mask)
    return out
