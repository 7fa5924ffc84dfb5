"""Response decoding of the Chat Completions protocol: ``finish_reason``, ``usage`` and a
``chat.completion`` body into a :class:`MessageResponse`.

What the stream parser (:mod:`.stream`) shares with it is here too: the wire shapes both read
(:data:`CHUNK_SHAPE`, :data:`COMPLETION_SHAPE`), the usage object, and :func:`final_stop`, where the
calls in the message decide the stop reason: ``tool_calls`` with no call is ``end_turn`` (C01),
``stop`` (Ollama) or a trailing second ``stop`` after ``tool_calls`` with calls is ``tool_use`` (C02).
"""

from __future__ import annotations

from typing import Any

from ...types.codec import unstructure
from ...types.content import TextBlock, ThinkingBlock, ToolUseBlock
from ...types.messages import AssistantMessage, ModelStopReason, Usage
from ...types.requests import MessageResponse
from ...types.stream import parse_tool_arguments
from ..wire import ARRAY, COUNT, INT, OBJECT, STR, Shape, check, guard, list_of, obj, one_of
from .vendor import SOURCE, thinking_data, tool_vendor_fields

__all__ = ["CHUNK_SHAPE", "COMPLETION_SHAPE", "final_stop", "map_finish_reason", "parse_choice_message",
           "parse_completion", "parse_usage"]

_FINISH = {
    "stop": ModelStopReason.END_TURN,
    "end_turn": ModelStopReason.END_TURN,
    "eos": ModelStopReason.END_TURN,
    "length": ModelStopReason.MAX_TOKENS,
    "max_tokens": ModelStopReason.MAX_TOKENS,
    "tool_calls": ModelStopReason.TOOL_USE,
    "function_call": ModelStopReason.TOOL_USE,
    "tool_use": ModelStopReason.TOOL_USE,
    "content_filter": ModelStopReason.CONTENT_FILTERED,
    "stop_sequence": ModelStopReason.STOP_SEQUENCE,
}


def map_finish_reason(raw: str | None) -> ModelStopReason:
    """OpenAI ``finish_reason`` to :class:`ModelStopReason`; unknown values mean END_TURN."""
    return _FINISH.get(raw or "stop", ModelStopReason.END_TURN)


def parse_usage(u: Any) -> Usage | None:
    """The ``usage`` object (OpenAI, DeepSeek, Qwen, llama.cpp shapes) or ``None`` when absent."""
    if not isinstance(u, dict):
        return None
    prompt = u.get("prompt_tokens")
    completion = u.get("completion_tokens")
    if prompt is None and completion is None:
        return None
    pdet = u.get("prompt_tokens_details") or {}
    cdet = u.get("completion_tokens_details") or {}
    cached = pdet.get("cached_tokens") or u.get("prompt_cache_hit_tokens") or 0
    return Usage(
        input_tokens=int(prompt or 0),
        output_tokens=int(completion or 0),
        cache_read_tokens=int(cached or 0),
        reasoning_tokens=int(cdet.get("reasoning_tokens") or 0),
    )


def final_stop(raw: str | None, has_tools: bool, refusal: str | None, has_text: bool) -> ModelStopReason:
    """The stop reason the message itself supports: the calls in it decide whether the turn used tools.

    ``"stop"`` next to calls (Ollama, C02's trailing second finish chunk) is ``TOOL_USE``; ``"tool_calls"``
    with no call in the message (vLLM with ``tool_choice: "required"`` and no parsed call, C01) is not.
    """
    reason = map_finish_reason(raw)
    if has_tools and reason is ModelStopReason.END_TURN:
        return ModelStopReason.TOOL_USE  # some servers say "stop" for a tool-call turn
    if not has_tools and reason is ModelStopReason.TOOL_USE:
        reason = ModelStopReason.END_TURN  # a message without calls never reports tool use (C01)
    if refusal and not has_text and not has_tools and reason is ModelStopReason.END_TURN:
        return ModelStopReason.REFUSAL
    return reason


# ---------------------------------------------------------------------------- wire shapes
# What the parsers read (this module's and the stream parser's), by type (fsm_agent.providers.wire): a frame that differs raises a
# ProviderProtocolError naming the path. Keys not named here are kept or ignored as received.
_USAGE = obj(prompt_tokens=COUNT, completion_tokens=COUNT, total_tokens=COUNT, prompt_cache_hit_tokens=COUNT,
             prompt_tokens_details=obj(cached_tokens=COUNT), completion_tokens_details=obj(reasoning_tokens=COUNT))
_FUNCTION = obj(name=STR, arguments=one_of(STR, OBJECT))
_TOOL_CALL = obj(index=INT, id=one_of(STR, INT), type=STR, function=_FUNCTION).not_null()
_REASONING: dict[str, Shape] = dict(reasoning_content=STR, reasoning=STR, reasoning_details=list_of(OBJECT), refusal=STR,
                  tool_calls=list_of(_TOOL_CALL), function_call=_FUNCTION)
CHUNK_SHAPE = obj(
    id=STR, model=STR, usage=_USAGE,
    choices=list_of(obj(index=INT, finish_reason=STR, delta=obj(content=one_of(STR, ARRAY), **_REASONING))),
)
"""A ``chat.completion.chunk``, as the stream parser (:class:`~.stream.OpenAIChatStreamParser`) reads it."""
_PART = obj(type=STR, text=STR)
COMPLETION_SHAPE = obj(
    id=STR, model=STR, usage=_USAGE,
    choices=list_of(obj(index=INT, finish_reason=STR, message=obj(content=one_of(STR, list_of(_PART)), **_REASONING))),
)
"""A ``chat.completion`` body, as :func:`parse_completion` reads it."""


# ---------------------------------------------------------------------------- response
def parse_choice_message(msg: dict[str, Any], reasoning_keys: tuple[str, ...] = ("reasoning_content", "reasoning"),
                         vendor: str | None = None) -> tuple[list[Any], str | None]:
    """(content blocks, refusal) of one ``choices[i].message``.

    Reasoning text becomes a thinking block that records ``vendor`` and the field it came under;
    OpenRouter's ``reasoning_details`` are kept on it as received (on an empty thinking block when
    no text came); a tool call's vendor fields (``extra_content``) are kept on its block."""
    blocks: list[Any] = []
    details = msg.get("reasoning_details")
    details = [d for d in details if isinstance(d, dict)] if isinstance(details, list) else []
    for key in reasoning_keys:
        r = msg.get(key)
        if isinstance(r, str) and r:
            blocks.append(ThinkingBlock(r, source=SOURCE, provider_data=thinking_data(vendor, key, details)))
            break
    else:
        if details:
            blocks.append(ThinkingBlock("", source=SOURCE, provider_data=thinking_data(vendor, None, details)))
    content = msg.get("content")
    if isinstance(content, str) and content:
        blocks.append(TextBlock(content))
    elif isinstance(content, list):  # some compatible servers return parts
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("text", "output_text") and part.get("text"):
                blocks.append(TextBlock(part["text"]))
    for i, tc in enumerate(msg.get("tool_calls") or ()):
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, dict):
            inp, raw = args, None
        else:
            inp, raw = parse_tool_arguments(args)
        fields = tool_vendor_fields(tc)
        pdata = {SOURCE: {"vendor": vendor, "fields": fields}} if fields else None
        blocks.append(ToolUseBlock(str(tc.get("id") or f"call_{i}"), fn.get("name") or "", inp, raw, pdata))
    fc = msg.get("function_call")
    if isinstance(fc, dict) and fc.get("name"):
        inp, raw = parse_tool_arguments(fc.get("arguments"))
        blocks.append(ToolUseBlock("call_function", fc["name"], inp, raw))
    refusal = msg.get("refusal")
    return blocks, refusal if isinstance(refusal, str) and refusal else None


def parse_completion(data: dict[str, Any], provider: str, vendor: str | None = None) -> MessageResponse:
    """A Chat Completions response body into a :class:`MessageResponse` (choice 0; others in ``extra``).

    Raises:
        ProviderProtocolError: a value of the wrong type (the message names its path).
    """
    check(data, COMPLETION_SHAPE, what="response body", provider=provider)
    with guard("response body", provider):
        return _parse_completion(data, provider, vendor)


def _parse_completion(data: dict[str, Any], provider: str, vendor: str | None) -> MessageResponse:
    choices = data.get("choices") or []
    blocks: list[Any] = []
    refusal = None
    raw_finish = None
    if choices:
        first = choices[0]
        blocks, refusal = parse_choice_message(first.get("message") or {}, vendor=vendor)
        raw_finish = first.get("finish_reason")
    has_tools = any(isinstance(b, ToolUseBlock) for b in blocks)
    has_text = any(isinstance(b, TextBlock) for b in blocks)
    extra: dict[str, Any] = {}
    for key in ("system_fingerprint", "service_tier", "prompt_filter_results"):
        if data.get(key) is not None:
            extra[key] = data[key]
    if choices and choices[0].get("content_filter_results"):
        extra["content_filter_results"] = choices[0]["content_filter_results"]
    if len(choices) > 1:
        others = []
        for c in choices[1:]:
            b, r = parse_choice_message(c.get("message") or {}, vendor=vendor)
            others.append({
                "index": c.get("index"),
                "message": unstructure(AssistantMessage(tuple(b))),
                "finish_reason": c.get("finish_reason"),
                "refusal": r,
            })
        extra["choices"] = others
    return MessageResponse(
        id=data.get("id") or "",
        model=data.get("model") or "",
        message=AssistantMessage(tuple(blocks)),
        stop_reason=final_stop(raw_finish, has_tools, refusal, has_text),
        raw_stop_reason=raw_finish,
        usage=parse_usage(data.get("usage")),
        provider=provider,
        refusal=refusal,
        extra=extra,
    )
