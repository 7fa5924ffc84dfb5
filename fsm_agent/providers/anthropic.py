"""Anthropic Messages wire protocol.

Reference: https://docs.anthropic.com/en/api/messages and
https://docs.anthropic.com/en/docs/build-with-claude/streaming.

Request rules, each from a public bug report (../shared/cases):

* system messages go to the top-level ``system`` parameter, in order;
* consecutive same-role turns are merged into one message, and in a merged user
  turn every ``tool_result`` block comes first, in the order of the calls (B02);
* text blocks that are empty or whitespace-only are never sent, and an assistant
  turn left with no blocks is dropped, so its neighbouring user turns merge (B04);
* thinking goes back with its ``signature``, redacted thinking with its opaque
  ``data``, extension blocks (``server_tool_use``, ``web_search_tool_result`` ...)
  as the wire object they came as; such blocks made by another protocol are never sent;
* a call given twice in one turn is sent once, a result given twice once, and a call the
  history never answered gets an error ``tool_result`` (:data:`MISSING_RESULT`) in the next
  user turn;
* an assistant turn never ends in a ``thinking`` or ``redacted_thinking`` block (the API answers
  400 "The final block in an assistant message cannot be `thinking`"): reasoning after the turn's
  last text or call is not sent, so a turn of reasoning alone is left out;
* an answer marked interrupted (``AssistantMessage.provider_data["interrupted"]``, kept by the
  driver from a cut stream) goes without its reasoning, and the marker is never sent; a request
  never ends in a plain assistant turn (a prefill to the API): a user turn asking to continue
  follows it, unless the turn ends in a server tool block (``pause_turn``).

A message without ``tool_use`` blocks never reports TOOL_USE, and one with them never END_TURN,
whatever the wire said (:func:`truthful_stop`).

Stream rules: every emitted event is folded into one :class:`PartialMessageResponse`,
so ``MessageComplete.full_response`` is what the events add up to, and it equals what
:func:`parse_message` makes of the same message. ``ping`` and unknown event or delta
types are ignored; ``event: error`` raises the typed error, never a success;
``message_delta`` usage is cumulative and may repeat the input and cache counts (the
later value wins). A text block's start is emitted with its first text, carrying the
citations that came before it, and an extension block is emitted whole at its
``content_block_stop``: the events carry everything except the thinking signature,
which has no event and is set on the aggregate.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import Any

import orjson
from attrs import define, field

from ..errors import (ConfigurationError, InvalidRequestError, ProviderConnectionError,
                      ProviderProtocolError)
from ..types.content import (AudioBlock, ContentBlock, ExtensionBlock, FileBlock, ImageBlock,
                             TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock)
from ..types.messages import (AssistantMessage, Message, ModelStopReason, SystemMessage,
                              ToolResultMessage, Usage, UserImageMessage, UserMessage)
from ..types.pairing import MISSING_RESULT, normalize_pairing  # the tool_result of a call never answered
from ..types.requests import MessageRequest, MessageResponse, ToolDefinition
from ..types.stream import (ContentBlockEnd, ContentBlockStart, CostUpdate, MessageComplete,
                            MessageStart, PartialMessageResponse, RefusalDelta, StreamEvent,
                            TextDelta, ThinkingDelta, ToolCallArgumentsDelta, ToolCallEnd,
                            parse_tool_arguments)
from .base import HttpProvider, StreamParser
from .costs import cost_update
from .errors import error_from_payload
from .sse import ServerSentEvent
from .structured_output import response_format_of
from .wire import (ARRAY, COUNT, INT, OBJECT, STR, STRAY, Shape, check, guard, list_of, obj, one_of, orphan_error,
                   stray_error, tagged)

__all__ = ["DEFAULT_MAX_TOKENS", "DEFAULT_THINKING_BUDGET", "AnthropicProvider",
           "AnthropicStreamParser", "map_stop_reason", "messages_to_wire", "parse_block",
           "parse_message", "parse_usage", "tool_choice_to_wire", "tool_to_wire", "truthful_stop"]

SOURCE = "anthropic"
DEFAULT_MAX_TOKENS = 4096
"""``max_tokens`` (tokens) when neither the request nor the profile's ``max_output_tokens`` do."""
DEFAULT_THINKING_BUDGET = 1024
"""``budget_tokens`` (tokens) for thinking enabled without a budget: the API's minimum."""

_STOP = {r.value: r for r in ModelStopReason if r is not ModelStopReason.CONTENT_FILTERED}
_STOP["model_context_window_exceeded"] = ModelStopReason.MAX_TOKENS
_CITATIONS = frozenset({"char_location", "page_location", "content_block_location",
                        "web_search_result_location", "search_result_location"})
_TOOL_USE_KEYS = frozenset({"type", "id", "name", "input"})
_EXTRA_KEYS = ("stop_sequence", "stop_details", "container")
_IMAGE_MAGIC = (("iVBOR", "image/png"), ("/9j/", "image/jpeg"), ("R0lGOD", "image/gif"),
                ("UklGR", "image/webp"))
_TOOL_CHOICE = {"auto": "auto", "any": "any", "required": "any", "none": "none"}

Wire = dict[str, Any]


def map_stop_reason(raw: str | None) -> ModelStopReason:
    """Anthropic ``stop_reason`` to :class:`ModelStopReason` (``model_context_window_exceeded``
    is MAX_TOKENS); unknown values mean END_TURN, the wire value stays in ``raw_stop_reason``."""
    return _STOP.get(raw or "end_turn", ModelStopReason.END_TURN)


def truthful_stop(stop: ModelStopReason, has_calls: bool) -> ModelStopReason:
    """The stop reason the message's content supports: the calls decide whether a turn used tools.

    ``tool_use`` on a message without a ``tool_use`` block is END_TURN (a consumer branching on it
    would look for calls that are not there); ``end_turn`` next to calls is TOOL_USE. Every other
    reason (``max_tokens`` with a cut call, ``pause_turn``, ``refusal`` ...) stands.
    """
    if stop is ModelStopReason.TOOL_USE and not has_calls:
        return ModelStopReason.END_TURN
    if stop is ModelStopReason.END_TURN and has_calls:
        return ModelStopReason.TOOL_USE
    return stop


def parse_usage(u: Any) -> Usage | None:
    """The ``usage`` object, or ``None`` when absent. Units: tokens.

    ``input_tokens`` of the result is the whole prompt: the uncached ``input_tokens`` plus
    ``cache_read_input_tokens`` plus ``cache_creation_input_tokens``;
    ``output_tokens_details.thinking_tokens`` becomes ``reasoning_tokens``.
    """
    if not isinstance(u, dict):
        return None
    if u.get("input_tokens") is None and u.get("output_tokens") is None:
        return None
    read = int(u.get("cache_read_input_tokens") or 0)
    write = int(u.get("cache_creation_input_tokens") or 0)
    details = u.get("output_tokens_details")
    thinking = details.get("thinking_tokens") if isinstance(details, dict) else None
    return Usage(input_tokens=int(u.get("input_tokens") or 0) + read + write,
                 output_tokens=int(u.get("output_tokens") or 0), cache_read_tokens=read,
                 cache_write_tokens=write, reasoning_tokens=int(thinking or 0))


def _refusal(raw: Any, details: Any) -> str | None:
    """``stop_details.explanation`` of a refusal, or ``None``."""
    if isinstance(details, dict) and (raw == "refusal" or details.get("type") == "refusal"):
        text = details.get("explanation")
        return text if isinstance(text, str) and text else None
    return None


# ---------------------------------------------------------------------------- request
def _data_url(url: str | None) -> tuple[str | None, str] | None:
    """``data:<type>;base64,<data>`` as ``(type, data)``; ``None`` for anything else."""
    if not url or not url.startswith("data:") or ";base64," not in url:
        return None
    head, data = url[5:].split(";base64,", 1)
    return head or None, data


def _image(data: str | None, media_type: str | None, url: str | None) -> Wire:
    ref = url or data or ""
    parsed = _data_url(ref)
    if parsed is None and ref.startswith(("http://", "https://")):
        return {"type": "image", "source": {"type": "url", "url": ref}}
    if parsed is not None:
        media_type, ref = parsed[0] or media_type, parsed[1]
    if not media_type:
        media_type = next((mt for magic, mt in _IMAGE_MAGIC if ref.startswith(magic)), "image/png")
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": ref}}


def _document(b: FileBlock) -> Wire:
    parsed = _data_url(b.url)
    data, media_type = (parsed[1], parsed[0] or b.media_type) if parsed else (b.data, b.media_type)
    source: Wire = {"type": "base64", "media_type": media_type or "application/pdf",
                    "data": data or ""}
    if b.file_id:
        source = {"type": "file", "file_id": b.file_id}
    elif b.url and parsed is None:
        source = {"type": "url", "url": b.url}
    elif media_type == "text/plain" and data:
        try:
            text = base64.b64decode(data, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            text = data
        source = {"type": "text", "media_type": "text/plain", "data": text}
    return {"type": "document", "source": source, **({"title": b.filename} if b.filename else {})}


def _tool_result(tool_use_id: str, content: Iterable[ContentBlock], is_error: bool) -> Wire:
    parts = _blocks(content, "tool")
    out: Wire = {"type": "tool_result", "tool_use_id": tool_use_id}
    if len(parts) == 1 and parts[0]["type"] == "text":
        out["content"] = parts[0]["text"]
    elif parts:
        out["content"] = parts
    if is_error:
        out["is_error"] = True
    return out


def _blocks(content: Iterable[ContentBlock], role: str) -> list[Wire]:
    """Blocks of a ``user`` or ``assistant`` turn, or of a ``tool`` result, that the API takes."""
    out: list[Wire] = []
    for b in content:
        if isinstance(b, TextBlock):
            if not b.text.strip():
                continue  # B04: "text content blocks must be non-empty"
            text: Wire = {"type": "text", "text": b.text}
            cites = [c for c in b.citations if isinstance(c, dict) and c.get("type") in _CITATIONS]
            if cites and role == "assistant":  # Anthropic shapes only, never OpenAI annotations
                text["citations"] = cites
            out.append(text)
        elif isinstance(b, ImageBlock) and role != "assistant":
            out.append(_image(b.data, b.media_type, b.url))
        elif isinstance(b, FileBlock) and role != "assistant":
            out.append(_document(b))
        elif isinstance(b, ToolResultBlock) and role == "user":
            out.append(_tool_result(b.tool_use_id, b.content, b.is_error))
        elif isinstance(b, ToolUseBlock) and role == "assistant":
            call: Wire = {"type": "tool_use", "id": b.id, "name": b.name,
                          "input": b.input if b.raw_input is None else {}}
            extra = (b.provider_data or {}).get(SOURCE)
            if isinstance(extra, dict):  # e.g. "caller", sent back as received
                call.update((k, v) for k, v in extra.items() if k not in _TOOL_USE_KEYS)
            out.append(call)
        elif isinstance(b, ThinkingBlock) and role == "assistant" and b.source in (None, SOURCE):
            if b.redacted_data is not None:
                out.append({"type": "redacted_thinking", "data": b.redacted_data})
            elif b.signature:  # the API rejects unsigned thinking: it is never sent
                out.append({"type": "thinking", "thinking": b.thinking, "signature": b.signature})
        elif isinstance(b, ExtensionBlock) and role != "tool" and b.source in (None, SOURCE):
            out.append({"type": b.kind, **b.data})
        elif isinstance(b, AudioBlock):
            raise InvalidRequestError("the Anthropic Messages API takes no audio input; transcribe "
                                      "it or use a provider that accepts audio", provider=SOURCE)
    return out


def messages_to_wire(messages: Iterable[Message]) -> tuple[str | list[Wire] | None, list[Wire]]:
    """Neutral messages as the ``(system, messages)`` of a Messages API request.

    ``system`` is ``None`` (no system text), a string (one text block) or a list of text
    blocks. Each message's ``content`` is a list of blocks and roles alternate; a
    :class:`ToolResultMessage` is a ``tool_result`` block (string content when it is one
    text) in a user turn. Images are ``base64`` or ``url`` sources (a data URL is
    unpacked); files are ``document`` blocks (PDF base64, plain text, URL or file id).

    The history is first put in the shape the API accepts (:func:`~fsm_agent.types.normalize_pairing`):
    results right after the turn that called them, even past a later user or assistant turn.

    Raises:
        InvalidRequestError: the history holds audio, which the API does not accept.
        InvalidHistoryError: a tool result answers no earlier call (the API refuses it).
    """
    messages, orphans = normalize_pairing(tuple(messages))
    if orphans:
        raise orphan_error(messages, orphans, SOURCE)
    system: list[Wire] = []
    turns: list[tuple[str, list[Wire], bool]] = []  # role, blocks, holds an interrupted answer
    for m in messages:
        cut = False
        if isinstance(m, SystemMessage):
            system.extend(_blocks((b for b in m.content if isinstance(b, TextBlock)), "user"))
            continue
        if isinstance(m, UserMessage):
            role, blocks = "user", _blocks(m.content, "user")
        elif isinstance(m, UserImageMessage):
            role, blocks = "user", [_image(None, m.mime_type, m.data)]
        elif isinstance(m, AssistantMessage):
            # an answer cut part-way: its reasoning is not sent (it may be unsigned, and a turn that
            # ends in reasoning is rejected); neither is the ``interrupted`` marker
            cut = bool((m.provider_data or {}).get("interrupted"))
            content = [b for b in m.content if not (cut and isinstance(b, ThinkingBlock))]
            role, blocks = "assistant", _blocks(content, "assistant")
            # "The final block in an assistant message cannot be `thinking`": reasoning after a turn's
            # last text or call is not sent, so a turn of reasoning alone is left out (its neighbours merge)
            while blocks and blocks[-1]["type"] in _REASONING:
                blocks.pop()
        elif isinstance(m, ToolResultMessage):
            role, blocks = "user", [_tool_result(m.tool_call_id, m.content, m.is_error)]
        else:
            continue
        if not blocks:
            continue  # an empty turn is dropped, so its neighbours merge (B04)
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
            turns[-1] = (role, turns[-1][1], turns[-1][2] or cut)
        else:
            turns.append((role, blocks, cut))
    out: list[Wire] = []
    calls: dict[str, int] = {}
    k = 0
    while k < len(turns):
        role, blocks, cut = turns[k]
        if role == "assistant":
            blocks = _once(blocks, "tool_use", "id")  # one call given twice is sent once
            calls = {b["id"]: i for i, b in enumerate(x for x in blocks if x["type"] == "tool_use")}
            if calls:  # every call answered in the next user turn, or the API answers 400
                if k + 1 == len(turns):
                    turns.append(("user", [], False))
                answered = {b.get("tool_use_id") for b in turns[k + 1][1] if b["type"] == "tool_result"}
                turns[k + 1][1].extend({"type": "tool_result", "tool_use_id": c, "content": MISSING_RESULT,
                                        "is_error": True} for c in calls if c not in answered)
        elif any(b["type"] == "tool_result" for b in blocks):  # B02: results first, in call order
            results = sorted(_once([b for b in blocks if b["type"] == "tool_result"], "tool_result", "tool_use_id"),
                             key=lambda b: calls.get(b["tool_use_id"], len(calls)))
            blocks = results + [b for b in blocks if b["type"] != "tool_result"]
        out.append({"role": role, "content": blocks})
        k += 1
    if out and out[-1]["role"] == "assistant" and out[-1]["content"][-1]["type"] in _PREFILL:
        # a request ending in a plain assistant turn is a prefill to the API: the model would go on
        # inside that turn (and newer models refuse it). Ask in a user turn instead, as the driver
        # does; a turn ending in a server tool block (``pause_turn``) is continued as it is.
        text = CONTINUE_CUT if turns[-1][2] else CONTINUE
        out.append({"role": "user", "content": [{"type": "text", "text": text}]})
    if len(system) == 1:
        return system[0]["text"], out
    return system or None, out


_PREFILL = frozenset({"text", "thinking", "redacted_thinking"})
_REASONING = frozenset({"thinking", "redacted_thinking"})
CONTINUE_CUT = "Your previous answer was cut off before it finished; continue from where it stopped."
CONTINUE = "Continue."
"""The user turns that follow a history ending in an assistant answer (an interrupted one, or
another), so that it is not read as a prefill (the same words as the driver's)."""


def _once(blocks: list[Wire], kind: str, key: str) -> list[Wire]:
    """``blocks`` with each ``kind`` block whose ``key`` was already seen left out."""
    seen: set[Any] = set()
    out = []
    for b in blocks:
        if b["type"] == kind:
            if b.get(key) in seen:
                continue
            seen.add(b.get(key))
        out.append(b)
    return out


def tool_to_wire(tool: ToolDefinition) -> Wire:
    """A tool as ``{"name", "description", "input_schema"}``; OpenAI's ``strict`` is not sent."""
    return {"name": tool.name, "description": tool.description, "input_schema": tool.parameters}


def tool_choice_to_wire(choice: str | Wire | None, parallel: bool | None = None) -> Wire | None:
    """A neutral ``tool_choice`` as Anthropic's, or ``None`` for the API default.

    ``auto``, ``none``, ``any`` (and OpenAI's ``required``) map to ``{"type": ...}``;
    ``{"name": X}`` and OpenAI's ``{"type": "function", ...}`` to ``{"type": "tool", "name": X}``;
    Anthropic dicts pass through. ``parallel`` sets ``disable_parallel_tool_use`` (on ``auto``
    when no choice is given). Raises ConfigurationError for any other value.
    """
    wire: Wire | None = None
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICE:
            raise ConfigurationError(f"unknown tool_choice {choice!r}: use auto, any, required, "
                                     "none or {'name': ...}")
        wire = {"type": _TOOL_CHOICE[choice]}
    elif isinstance(choice, dict):
        kind = choice.get("type")
        if kind in ("auto", "any", "none", "tool"):
            wire = dict(choice)
        elif kind == "required":
            wire = {"type": "any"}
        elif kind == "function" or (kind is None and "name" in choice):
            fn = choice.get("function") or {}
            wire = {"type": "tool", "name": fn.get("name") or choice.get("name")}
        if wire is None or (wire["type"] == "tool" and not wire.get("name")):
            raise ConfigurationError(f"unknown tool_choice {choice!r}")
    if parallel is not None and (wire is None or wire["type"] != "none"):
        wire = wire or {"type": "auto"}
        wire["disable_parallel_tool_use"] = not parallel
    return wire


# ---------------------------------------------------------------------------- wire shapes
# What the parsers below read, by type (fsm_agent.providers.wire): a frame that differs raises a
# ProviderProtocolError naming the path. Keys not named here are kept or ignored as received.
_USAGE = obj(input_tokens=COUNT, output_tokens=COUNT, cache_read_input_tokens=COUNT,
             cache_creation_input_tokens=COUNT, output_tokens_details=obj(thinking_tokens=COUNT))
_BLOCK = tagged("type", {
    "text": obj(text=STR, citations=ARRAY),
    "thinking": obj(thinking=STR, signature=STR),
    "redacted_thinking": obj(data=STR),
    "tool_use": obj(id=STR, name=STR, input=one_of(OBJECT, STR)),
}, nullable=False)
_STOP_FIELDS: dict[str, Shape] = dict(stop_reason=STR, stop_details=obj(type=STR, explanation=STR))
MESSAGE_SHAPE = obj(type=STR, id=STR, model=STR, content=list_of(_BLOCK), usage=_USAGE, **_STOP_FIELDS)
"""A Messages API response body, as :func:`parse_message` reads it."""
_DELTA = tagged("type", {
    "text_delta": obj(text=STR),
    "input_json_delta": obj(partial_json=STR),
    "thinking_delta": obj(thinking=STR),
    "signature_delta": obj(signature=STR),
}, nullable=False)
EVENT_SHAPES = {
    "message_start": obj(type=STR, message=obj(id=STR, model=STR, usage=_USAGE, content=ARRAY, **_STOP_FIELDS)),
    "content_block_start": obj(type=STR, index=INT, content_block=_BLOCK),
    "content_block_delta": obj(type=STR, index=INT, delta=_DELTA),
    "content_block_stop": obj(type=STR, index=INT),
    "message_delta": obj(type=STR, usage=_USAGE, delta=obj(**_STOP_FIELDS)),
    "message_stop": obj(type=STR),
}
"""Each stream event the parser reads, by its type; others are ignored."""
_OTHER_EVENT = obj(type=STR)


# ---------------------------------------------------------------------------- response
def parse_block(b: Wire) -> ContentBlock | None:
    """One wire content block; ``None`` for a text block with empty text."""
    kind = b.get("type")
    if kind == "text":
        text = b.get("text") or ""
        return TextBlock(text, tuple(b.get("citations") or ())) if text else None
    if kind == "thinking":
        return ThinkingBlock(b.get("thinking") or "", b.get("signature") or None, source=SOURCE)
    if kind == "redacted_thinking":
        return ThinkingBlock("", redacted_data=b.get("data") or "", source=SOURCE)
    if kind == "tool_use":
        inp = b.get("input")
        args, raw = (inp, None) if isinstance(inp, dict) else parse_tool_arguments(
            inp if isinstance(inp, str) else None)
        extra = {k: v for k, v in b.items() if k not in _TOOL_USE_KEYS}
        return ToolUseBlock(str(b.get("id") or ""), str(b.get("name") or ""), args, raw,
                            {SOURCE: extra} if extra else None)
    return ExtensionBlock(str(kind), dict(b), SOURCE)


def parse_message(data: Wire, provider: str = "anthropic") -> MessageResponse:
    """A Messages API response body (``"type": "message"``) into a :class:`MessageResponse`.

    Blocks keep their order: text (with citations), ``tool_use`` (wire fields beyond
    id/name/input, such as ``caller``, in ``provider_data["anthropic"]``), thinking with its
    signature, redacted thinking as ``ThinkingBlock.redacted_data``, and anything else as an
    :class:`ExtensionBlock` holding the wire object. ``stop_sequence``, ``stop_details``,
    ``container`` and ``usage.server_tool_use`` are kept in ``extra``; a refusal's
    ``stop_details.explanation`` is ``refusal``.

    Raises:
        ProviderProtocolError: a value of the wrong type (the message names its path).
    """
    check(data, MESSAGE_SHAPE, what="response body", provider=provider)
    with guard("response body", provider):
        return _parse_message(data, provider)


def _parse_message(data: Wire, provider: str) -> MessageResponse:
    content = tuple(x for x in (parse_block(b) for b in data.get("content") or ()
                                if isinstance(b, dict)) if x is not None)
    raw = data.get("stop_reason") if isinstance(data.get("stop_reason"), str) else None
    refusal = _refusal(raw, data.get("stop_details"))
    extra: Wire = {k: data[k] for k in _EXTRA_KEYS if data.get(k) is not None}
    usage = data.get("usage")
    if isinstance(usage, dict) and usage.get("server_tool_use") is not None:
        extra["server_tool_use"] = usage["server_tool_use"]
    calls = any(isinstance(b, ToolUseBlock) for b in content)
    stop = (truthful_stop(map_stop_reason(raw), calls) if raw is not None  # absent: inferred as for a stream
            else ModelStopReason.TOOL_USE if calls
            else ModelStopReason.REFUSAL if refusal is not None else ModelStopReason.END_TURN)
    return MessageResponse(id=str(data.get("id") or ""), model=str(data.get("model") or ""),
                           message=AssistantMessage(content), stop_reason=stop,
                           raw_stop_reason=raw, usage=parse_usage(usage), provider=provider,
                           refusal=refusal, extra=extra)


# ---------------------------------------------------------------------------- streaming
@define(slots=True)
class _Open:
    """A wire block between its ``content_block_start`` and ``content_block_stop``."""

    kind: str  # text, thinking, tool_use or extension
    index: int = -1  # runtime index; -1 until its ContentBlockStart is emitted
    data: Wire = field(factory=dict)  # text: citations; tool use: start input; extension: the block
    parts: list[str] = field(factory=list)  # an extension block's input_json_delta text
    got_args: bool = False


class AnthropicStreamParser:
    """Messages API server-sent events into stream events (rules in the module docstring)."""

    def __init__(self, provider: str = "anthropic") -> None:
        self.provider = provider
        self.partial = PartialMessageResponse(provider=provider, source=SOURCE)
        self.done = False
        """``message_stop`` was seen; later events are ignored."""
        self._open: dict[Any, _Open] = {}
        self._usage: Wire = {}
        self._events = 0

    def _emit(self, out: list[StreamEvent], ev: StreamEvent) -> None:
        self.partial.apply(ev)
        out.append(ev)

    def _fail(self, what: str, data: Any) -> ProviderProtocolError:
        return ProviderProtocolError(f"{what}: {str(data)[:200]}", provider=self.provider)

    def feed(self, sse: ServerSentEvent) -> list[StreamEvent]:
        """The stream events for one server-sent event.

        Raises:
            ProviderError: an ``error`` event, as its most specific class (OverloadedError ...).
            ProviderProtocolError: data that is not a JSON object; a value of the wrong type (the
                message names its path: ``delta.text: expected string, got number``); a delta for
                no open block.
        """
        self._events += 1
        try:
            return self._feed(sse)
        except STRAY as exc:  # wire.guard, inlined: this runs once per event
            raise stray_error(exc, f"stream event {self._events} ({sse.event})", self.provider) from exc

    def _feed(self, sse: ServerSentEvent) -> list[StreamEvent]:
        if self.done or sse.event == "ping":
            return []
        try:
            payload: Any = orjson.loads(sse.data)
        except orjson.JSONDecodeError:
            payload = None  # an error event's text becomes its message; otherwise a protocol error
        kind = payload.get("type") if isinstance(payload, dict) else None
        if kind == "error" or sse.event == "error":
            if not isinstance(payload, dict):
                payload = {"error": {"message": sse.data}}
            raise error_from_payload(payload, provider=self.provider)
        if not isinstance(payload, dict):
            raise self._fail("stream event is not a JSON object", repr(sse.data))
        kind = kind if isinstance(kind, str) else sse.event
        check(payload, EVENT_SHAPES.get(kind, _OTHER_EVENT), what=f"stream event {self._events} ({kind})",
              provider=self.provider, raw=sse.data)
        out: list[StreamEvent] = []
        if kind == "content_block_delta":
            self._delta(payload, out)
        elif kind == "content_block_start":
            self._block_start(payload, out)
        elif kind == "content_block_stop":
            st = self._open.pop(payload.get("index"), None)
            if st is not None:
                self._close(st, out)
        elif kind == "message_delta":
            delta: dict[str, Any] = payload["delta"] if isinstance(payload.get("delta"), dict) else {}
            raw = delta.get("stop_reason")
            if isinstance(raw, str) and raw:
                self.partial.set_stop_reason(map_stop_reason(raw), raw)
            extra = ((k, v) for k in _EXTRA_KEYS if (v := delta.get(k)) is not None)
            self.partial.extra.update(extra)
            refusal = _refusal(raw, delta.get("stop_details"))
            if refusal is not None:
                self._emit(out, RefusalDelta(refusal))
            self._add_usage(payload.get("usage"), out)
        elif kind == "message_start":
            msg: dict[str, Any] = payload["message"] if isinstance(payload.get("message"), dict) else {}
            self._emit(out, MessageStart(str(msg.get("id") or ""), str(msg.get("model") or "")))
            self.partial.extra.update((k, v) for k in _EXTRA_KEYS if (v := msg.get(k)) is not None)
            self._add_usage(msg.get("usage"), out)
        elif kind == "message_stop":
            self.done = True
        return out  # other event types (the API may add some) are ignored

    def _add_usage(self, u: Any, out: list[StreamEvent]) -> None:
        if not isinstance(u, dict):
            return
        self._usage.update((k, v) for k, v in u.items() if v is not None)  # later values win
        usage = parse_usage(self._usage)
        if usage is not None:
            self._emit(out, cost_update(usage, self.partial.model))
        if self._usage.get("server_tool_use") is not None:
            self.partial.extra["server_tool_use"] = self._usage["server_tool_use"]

    def _block_start(self, payload: Wire, out: list[StreamEvent]) -> None:
        block = payload.get("content_block")
        if not isinstance(block, dict) or not isinstance(payload.get("index"), int):
            raise self._fail("malformed content_block_start", payload)
        for other in self._open.values():  # blocks come one at a time; if not, keep wire order
            self._ensure(other, out)
        kind, nxt = block.get("type"), len(self.partial.blocks)
        if kind == "text":
            st = _Open("text", data={"citations": list(block.get("citations") or ())})
            if block.get("text"):
                self._ensure(st, out)
                self._emit(out, TextDelta(nxt, block["text"]))
        elif kind == "thinking" or kind == "redacted_thinking":
            st = _Open("thinking", nxt)
            data = {"redacted_data": block.get("data") or ""} if kind != "thinking" else None
            if kind == "thinking" and block.get("signature"):
                data = {"signature": block["signature"]}
            self._emit(out, ContentBlockStart(nxt, "thinking", data=data))
            if kind == "thinking" and block.get("thinking"):
                self._emit(out, ThinkingDelta(nxt, block["thinking"]))
        elif kind == "tool_use":
            inp = block.get("input")
            st = _Open("tool_use", nxt, inp if isinstance(inp, dict) else {})
            extra = {k: v for k, v in block.items() if k not in _TOOL_USE_KEYS}
            self._emit(out, ContentBlockStart(nxt, "tool_use", str(block.get("id") or ""),
                                              str(block.get("name") or ""),
                                              {SOURCE: extra} if extra else None))
        else:  # server tool use, its results ...: emitted whole at content_block_stop
            st = _Open("extension", data=dict(block))
        self._open[payload["index"]] = st

    def _delta(self, payload: Wire, out: list[StreamEvent]) -> None:
        st, delta = self._open.get(payload.get("index")), payload.get("delta")
        if st is None or not isinstance(delta, dict):
            raise self._fail("content_block_delta for a block that is not open", payload)
        kind = delta.get("type")
        if kind == "text_delta" and st.kind == "text" and delta.get("text"):
            self._ensure(st, out)
            self._emit(out, TextDelta(st.index, delta["text"]))
        elif kind == "input_json_delta" and delta.get("partial_json"):  # the first is often ""
            if st.kind == "tool_use":
                st.got_args = True
                self._emit(out, ToolCallArgumentsDelta(st.index, delta["partial_json"]))
            else:
                st.parts.append(delta["partial_json"])
        elif kind == "thinking_delta" and st.kind == "thinking" and delta.get("thinking"):
            self._emit(out, ThinkingDelta(st.index, delta["thinking"]))
        elif kind == "signature_delta" and st.kind == "thinking" and delta.get("signature"):
            self.partial.set_thinking_signature(st.index, delta["signature"])
        elif kind == "citations_delta" and st.kind == "text" and delta.get("citation") is not None:
            if st.index < 0:
                st.data["citations"].append(delta["citation"])
            else:
                have = (self.partial.blocks[st.index].data or {}).get("citations", ())
                self.partial.set_block_data(st.index, citations=[*have, delta["citation"]])

    def _ensure(self, st: _Open, out: list[StreamEvent]) -> None:
        """Emit the held-back ContentBlockStart of a text or extension block."""
        if st.index >= 0:
            return
        st.index = len(self.partial.blocks)
        if st.kind == "text":
            cites = st.data["citations"]
            self._emit(out, ContentBlockStart(st.index, "text",
                                              data={"citations": cites} if cites else None))
            return
        data = dict(st.data)
        if st.parts:
            data["input"], raw = parse_tool_arguments("".join(st.parts))
            if raw is not None:
                data["partial_json"] = raw
            st.parts.clear()
        data["kind"] = str(data.get("type"))
        self._emit(out, ContentBlockStart(st.index, "extension", data=data))

    def _close(self, st: _Open, out: list[StreamEvent]) -> None:
        if st.kind == "text" and st.index < 0:
            return  # a text block that stayed empty: nothing to show or send back
        if st.kind == "extension" and st.index >= 0 and st.parts:
            self.partial.set_block_data(st.index, input=parse_tool_arguments("".join(st.parts))[0])
        self._ensure(st, out)
        if st.kind == "tool_use":
            if not st.got_args and st.data:  # the input came whole in content_block_start
                self._emit(out, ToolCallArgumentsDelta(st.index, orjson.dumps(st.data).decode()))
            self._emit(out, ToolCallEnd(st.index, self.partial.tool_block(st.index)))
        signature = self.partial.blocks[st.index].signature if st.kind == "thinking" else None
        self._emit(out, ContentBlockEnd(st.index, {"signature": signature} if signature else None))

    def finish(self) -> list[StreamEvent]:
        """Close what is open; the last events, ending with :class:`MessageComplete`.

        Raises:
            ProviderConnectionError: no ``message_stop``, but content came (``partial`` has it).
            ProviderProtocolError: no ``message_stop`` and no content.
        """
        with guard("end of stream", self.provider):
            return self._finish()

    def _finish(self) -> list[StreamEvent]:
        if not self.done:
            if self.partial.blocks or self.partial.stop_reason is not None:
                raise ProviderConnectionError(
                    "the stream ended before message_stop: the response is incomplete",
                    provider=self.provider, partial=self.partial.snapshot())
            raise ProviderProtocolError("the stream ended before any content (no message_stop)",
                                        provider=self.provider)
        out: list[StreamEvent] = []
        for st in self._open.values():
            self._close(st, out)
        self._open.clear()
        if self.partial.stop_reason is not None:
            calls = any(b.kind == "tool_use" for b in self.partial.blocks)
            self.partial.set_stop_reason(truthful_stop(self.partial.stop_reason, calls), self.partial.raw_stop_reason)
        out.append(MessageComplete(self.partial.finalize()))
        return out


class AnthropicProvider(HttpProvider):
    """The Messages API (``POST {base_url}/messages``) over aiohttp.

    Authentication (``x-api-key``) and the ``anthropic-version`` header come from the
    profile. ``max_tokens``, which the API requires, is ``request.max_tokens``, else the
    profile's ``capabilities.max_output_tokens``, else :data:`DEFAULT_MAX_TOKENS` (4096).
    """

    protocol = "anthropic"

    def endpoint(self, request: MessageRequest, stream: bool) -> str:
        return "/messages"

    def build_body(self, request: MessageRequest, stream: bool) -> dict[str, Any]:
        """The request body.

        ``system`` and ``messages`` come from :func:`messages_to_wire`, ``tools`` from
        :func:`tool_to_wire`, ``tool_choice`` from :func:`tool_choice_to_wire` (sent only
        with tools); ``stop`` is ``stop_sequences``; thinking is ``{"type": "enabled",
        "budget_tokens": N}`` (N defaults to :data:`DEFAULT_THINKING_BUDGET`) or
        ``{"type": "disabled"}``; a ``json_schema`` ``response_format``, else ``output_schema``, is
        ``output_config.format`` (models without it: :meth:`prepare_output_schema`). ``extra["body"]``
        (a dict) is merged in last.

        Raises:
            InvalidRequestError: audio in the history.
            ConfigurationError: an unknown ``tool_choice``.
        """
        system, messages = messages_to_wire(request.messages)
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = self.profile.capabilities.max_output_tokens or DEFAULT_MAX_TOKENS
        body: dict[str, Any] = {"model": request.model or self.model, "max_tokens": max_tokens,
                                "messages": messages}
        if system is not None:
            body["system"] = system
        if request.tools:
            body["tools"] = [tool_to_wire(t) for t in request.tools]
            choice = tool_choice_to_wire(request.tool_choice, request.parallel_tool_calls)
            if choice is not None:
                body["tool_choice"] = choice
        for key, value in (("stop_sequences", list(request.stop) or None),
                           ("temperature", request.temperature), ("top_p", request.top_p)):
            if value is not None:
                body[key] = value
        thinking = request.thinking
        if thinking is not None:
            budget = thinking.budget_tokens or DEFAULT_THINKING_BUDGET
            body["thinking"] = ({"type": "enabled", "budget_tokens": budget} if thinking.enabled
                                else {"type": "disabled"})
        rf = response_format_of(request)  # output_schema → json_schema unless response_format is given
        if isinstance(rf, dict) and rf.get("type") == "json_schema":
            schema = (rf.get("json_schema") or {}).get("schema")
            if isinstance(schema, dict):
                body["output_config"] = {"format": {"type": "json_schema", "schema": schema}}
        if stream:
            body["stream"] = True
        wire_extra = request.extra.get("body")
        if isinstance(wire_extra, dict):
            body.update(wire_extra)
        return body

    def prepare_output_schema(self, request: MessageRequest) -> MessageRequest:
        """Models without ``output_config`` (``capabilities.structured_output=False``): the schema as a
        forced answer tool (:func:`~fsm_agent.providers.structured_output.answer_tool_request`)."""
        from .structured_output import answer_tool_request

        return answer_tool_request(request)

    def _answer_tool(self, request: MessageRequest) -> Any:
        if (request.output_schema is not None and request.response_format is None
                and not self.capabilities.structured_output):
            return request.output_schema
        return None

    def interpret(self, original: MessageRequest, response: MessageResponse) -> MessageResponse:
        schema = self._answer_tool(original)
        if schema is not None:
            from .structured_output import interpret_answer_tool

            return interpret_answer_tool(response, schema)
        return super().interpret(original, response)

    def stream_wrapper(self, request: MessageRequest) -> Any:
        schema = self._answer_tool(request)
        if schema is not None:
            from .structured_output import AnswerToolStream

            return AnswerToolStream(schema).wrap
        return super().stream_wrapper(request)

    def parse_response(self, data: dict[str, Any]) -> MessageResponse:
        return parse_message(data, self.name)

    def stream_parser(self) -> StreamParser:
        return AnthropicStreamParser(self.name)
