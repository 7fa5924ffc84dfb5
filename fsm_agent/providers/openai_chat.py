"""OpenAI Chat Completions wire protocol (also DeepSeek, Qwen, llama.cpp, vLLM, OpenRouter ... as profiles).

Reference: https://platform.openai.com/docs/api-reference/chat/create and
https://platform.openai.com/docs/api-reference/chat-streaming.

Stream rules this parser keeps, each from a public bug report (../shared/cases):

* tool-call fragments are matched by ``index``; an index need not start at 0
  (B07) and a fragment with a new, non-empty ``id`` at an index already in use
  starts a new call (B08); later fragments with ``"id": ""`` continue the call;
* argument text in the defining fragment is kept (B10);
* ``arguments: null`` with no later text is a call with ``{}`` arguments, final
  when the stream ends (B11), sent back as ``"{}"``;
* chunks with ``choices: []`` (Azure's content-filter preamble, the usage tail)
  never fail, and their empty ``id``/``model`` never overwrite real ones (B12);
* a missing usage chunk leaves ``usage`` ``None``, never zero (B12);
* ``delta.reasoning_content`` (DeepSeek, Qwen, llama.cpp) and ``delta.reasoning``
  (OpenRouter) become thinking, also on turns with tool calls (B06);
* ``{"error": ...}`` inside a 200 stream is an error, never a success (B20, llama.cpp).
"""

from __future__ import annotations

from typing import Any

import orjson
from attrs import define, field

from ..errors import ProviderConnectionError, ProviderProtocolError
from ..types.content import (
    AudioBlock,
    FileBlock,
    ImageBlock,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from ..types.messages import (
    AssistantMessage,
    Message,
    ModelStopReason,
    SystemMessage,
    ToolResultMessage,
    Usage,
    UserImageMessage,
    UserMessage,
)
from ..types.codec import unstructure
from ..types.requests import MessageRequest, MessageResponse
from ..types.stream import (
    ContentBlockEnd,
    ContentBlockStart,
    CostUpdate,
    MessageComplete,
    MessageStart,
    PartialMessageResponse,
    RefusalDelta,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
)
from .base import HttpProvider, StreamParser
from .errors import error_from_payload
from .sse import ServerSentEvent
from .structured_output import response_format_of

__all__ = ["OpenAIChatProvider", "OpenAIChatStreamParser", "map_finish_reason", "parse_usage"]

SOURCE = "openai-chat"

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


def _final_stop(raw: str | None, has_tools: bool, refusal: str | None, has_text: bool) -> ModelStopReason:
    reason = map_finish_reason(raw)
    if has_tools and reason is ModelStopReason.END_TURN:
        return ModelStopReason.TOOL_USE  # some servers say "stop" for a tool-call turn
    if refusal and not has_text and not has_tools and reason is ModelStopReason.END_TURN:
        return ModelStopReason.REFUSAL
    return reason


# ---------------------------------------------------------------------------- request
def _data_url(data: str, media_type: str | None) -> str:
    if data.startswith("data:") or data.startswith("http://") or data.startswith("https://"):
        return data
    return f"data:{media_type or 'application/octet-stream'};base64,{data}"


def _user_parts(content: tuple[Any, ...]) -> str | list[dict[str, Any]]:
    if all(isinstance(b, TextBlock) for b in content):
        return "".join(b.text for b in content)
    parts: list[dict[str, Any]] = []
    for b in content:
        if isinstance(b, TextBlock):
            parts.append({"type": "text", "text": b.text})
        elif isinstance(b, ImageBlock):
            url = b.url or _data_url(b.data or "", b.media_type)
            parts.append({"type": "image_url", "image_url": {"url": url, "detail": b.detail}})
        elif isinstance(b, AudioBlock):
            parts.append({"type": "input_audio", "input_audio": {"data": b.data, "format": b.format}})
        elif isinstance(b, FileBlock):
            f: dict[str, Any] = {}
            if b.file_id:
                f["file_id"] = b.file_id
            elif b.data:
                f["file_data"] = _data_url(b.data, b.media_type)
            if b.filename:
                f["filename"] = b.filename
            parts.append({"type": "file", "file": f})
    return parts


def tool_call_to_wire(call: ToolUseBlock) -> dict[str, Any]:
    """A tool-use block as an OpenAI ``tool_calls`` entry; arguments always a JSON string (B11: ``"{}"``)."""
    args = call.raw_input if call.raw_input is not None else orjson.dumps(call.input).decode()
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": args}}


def messages_to_wire(messages: tuple[Message, ...], *, system_role: str = "system",
                     reasoning_field: str | None = None, echo_reasoning: bool = False) -> list[dict[str, Any]]:
    """Neutral messages as Chat Completions ``messages``.

    Assistant turns with tool calls and no text send ``content: null`` (B04);
    whitespace-only assistant turns without tool calls are dropped (B04).
    ``reasoning_field`` is sent only when the profile names one and
    ``echo_reasoning`` is set, verbatim and never empty (B06).
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        if isinstance(m, SystemMessage):
            out.append({"role": system_role, "content": m.text})
        elif isinstance(m, UserMessage):
            out.append({"role": "user", "content": _user_parts(m.content)})
        elif isinstance(m, UserImageMessage):
            out.append({"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _data_url(m.data, m.mime_type), "detail": m.detail}}]})
        elif isinstance(m, AssistantMessage):
            calls = [tool_call_to_wire(c) for c in m.tool_calls]
            text = m.text
            if not calls and not text.strip():
                continue
            msg: dict[str, Any] = {"role": "assistant", "content": text if text.strip() else None}
            if calls:
                msg["tool_calls"] = calls
            if reasoning_field and echo_reasoning:
                reasoning = "".join(
                    b.thinking for b in m.content if isinstance(b, ThinkingBlock) and b.source in (None, SOURCE)
                )
                if reasoning:
                    msg[reasoning_field] = reasoning
            out.append(msg)
        elif isinstance(m, ToolResultMessage):
            out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.text})
    return out


# ---------------------------------------------------------------------------- response
def parse_choice_message(msg: dict[str, Any], reasoning_keys: tuple[str, ...] = ("reasoning_content", "reasoning")) -> tuple[list[Any], str | None]:
    """(content blocks, refusal) of one ``choices[i].message``."""
    blocks: list[Any] = []
    for key in reasoning_keys:
        r = msg.get(key)
        if isinstance(r, str) and r:
            blocks.append(ThinkingBlock(r, source=SOURCE))
            break
    content = msg.get("content")
    if isinstance(content, str) and content:
        blocks.append(TextBlock(content))
    elif isinstance(content, list):  # some compatible servers return parts
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("text", "output_text") and part.get("text"):
                blocks.append(TextBlock(part["text"]))
    from ..types.stream import parse_tool_arguments

    for i, tc in enumerate(msg.get("tool_calls") or ()):
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, dict):
            inp, raw = args, None
        else:
            inp, raw = parse_tool_arguments(args)
        blocks.append(ToolUseBlock(tc.get("id") or f"call_{i}", fn.get("name") or "", inp, raw))
    fc = msg.get("function_call")
    if isinstance(fc, dict) and fc.get("name"):
        inp, raw = parse_tool_arguments(fc.get("arguments"))
        blocks.append(ToolUseBlock("call_function", fc["name"], inp, raw))
    refusal = msg.get("refusal")
    return blocks, refusal if isinstance(refusal, str) and refusal else None


def parse_completion(data: dict[str, Any], provider: str) -> MessageResponse:
    """A Chat Completions response body into a :class:`MessageResponse` (choice 0; others in ``extra``)."""
    choices = data.get("choices") or []
    blocks: list[Any] = []
    refusal = None
    raw_finish = None
    if choices:
        first = choices[0]
        blocks, refusal = parse_choice_message(first.get("message") or {})
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
            b, r = parse_choice_message(c.get("message") or {})
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
        stop_reason=_final_stop(raw_finish, has_tools, refusal, has_text),
        raw_stop_reason=raw_finish,
        usage=parse_usage(data.get("usage")),
        provider=provider,
        refusal=refusal,
        extra=extra,
    )


# ---------------------------------------------------------------------------- streaming
@define(slots=True)
class _Slot:
    block: int
    id: str


@define(slots=True)
class _Choice:
    """Aggregation state of one choice."""

    partial: PartialMessageResponse
    emit: bool
    text: int | None = None
    thinking: int | None = None
    slots: dict[int, _Slot] = field(factory=dict)
    finish: str | None = None
    fn_slot: int | None = None


class OpenAIChatStreamParser:
    """Chat Completions chunks into stream events (choice 0; other choices aggregated into ``extra``)."""

    def __init__(self, provider: str = "openai") -> None:
        self.provider = provider
        self.partial = PartialMessageResponse(provider=provider, source=SOURCE)
        self._choices: dict[int, _Choice] = {0: _Choice(self.partial, True)}
        self._started = False
        self.done = False
        self._chunks = 0
        self._extra: dict[str, Any] = {}

    def _choice(self, index: int) -> _Choice:
        c = self._choices.get(index)
        if c is None:
            c = _Choice(PartialMessageResponse(provider=self.provider, source=SOURCE), False)
            self._choices[index] = c
        return c

    def feed(self, sse: ServerSentEvent) -> list[StreamEvent]:
        data = sse.data
        if data == "[DONE]":
            self.done = True
            return []
        if sse.event == "error":
            try:
                payload: Any = orjson.loads(data)
            except orjson.JSONDecodeError:
                payload = {"error": {"message": data}}
            raise error_from_payload(payload, provider=self.provider)
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ProviderProtocolError(
                f"stream chunk is not JSON ({exc}): {data[:200]!r}", provider=self.provider
            ) from exc
        if not isinstance(chunk, dict):
            raise ProviderProtocolError(f"stream chunk is not a JSON object: {data[:200]!r}", provider=self.provider)
        if chunk.get("error"):
            raise error_from_payload(chunk, provider=self.provider)
        self._chunks += 1
        out: list[StreamEvent] = []
        cid = chunk.get("id") or ""
        model = chunk.get("model") or ""
        if (cid or model) and (not self._started or not self.partial.id or not self.partial.model):
            ev = MessageStart(cid, model)
            self.partial.apply(ev)
            if not self._started:
                self._started = True
                out.append(MessageStart(self.partial.id, self.partial.model))
        for key in ("system_fingerprint", "service_tier"):
            if chunk.get(key) is not None:
                self._extra[key] = chunk[key]
        if chunk.get("prompt_filter_results"):
            self._extra["prompt_filter_results"] = chunk["prompt_filter_results"]
        for choice in chunk.get("choices") or ():
            self._delta(choice, out)
        usage = parse_usage(chunk.get("usage"))
        if usage is not None:
            ev2 = CostUpdate.of(usage, self.partial.model)
            self.partial.apply(ev2)
            out.append(ev2)
        return out

    def _delta(self, choice: dict[str, Any], out: list[StreamEvent]) -> None:
        c = self._choice(choice.get("index") or 0)
        sink: list[StreamEvent] = out if c.emit else []
        p = c.partial
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning_content")
        if not reasoning:
            reasoning = delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            if c.thinking is None:
                self._close_text(c, sink)
                c.thinking = self._start(p, sink, ContentBlockStart(len(p.blocks), "thinking"))
            ev: StreamEvent = ThinkingDelta(c.thinking, reasoning)
            p.apply(ev)
            sink.append(ev)
        content = delta.get("content")
        if isinstance(content, str) and content:
            if c.text is None:
                self._close_thinking(c, sink)
                c.text = self._start(p, sink, ContentBlockStart(len(p.blocks), "text"))
            ev = TextDelta(c.text, content)
            p.apply(ev)
            sink.append(ev)
        refusal = delta.get("refusal")
        if isinstance(refusal, str) and refusal:
            ev = RefusalDelta(refusal)
            p.apply(ev)
            sink.append(ev)
        tool_calls = delta.get("tool_calls")
        if tool_calls:
            self._close_thinking(c, sink)
            for pos, tc in enumerate(tool_calls):
                self._tool_fragment(c, p, tc, pos, sink)
        fc = delta.get("function_call")
        if isinstance(fc, dict):
            self._tool_fragment(c, p, {"index": -1, "id": "call_function" if c.fn_slot is None else "",
                                       "function": fc}, 0, sink)
            c.fn_slot = -1
        if choice.get("finish_reason"):
            c.finish = choice["finish_reason"]
        if choice.get("content_filter_results"):
            self._extra["content_filter_results"] = choice["content_filter_results"]

    def _tool_fragment(self, c: _Choice, p: PartialMessageResponse, tc: dict[str, Any], pos: int,
                       sink: list[StreamEvent]) -> None:
        widx = tc.get("index")
        if not isinstance(widx, int):
            widx = pos
        tid = tc.get("id") or ""
        fn = tc.get("function") or {}
        name = fn.get("name") or ""
        args = fn.get("arguments")
        slot = c.slots.get(widx)
        if slot is not None and tid and slot.id and tid != slot.id:
            # B08: a new id at an index in use starts a new call.
            self._end_tool(p, slot.block, sink)
            slot = None
        if slot is None:
            self._close_text(c, sink)
            block = self._start(p, sink, ContentBlockStart(len(p.blocks), "tool_use", tid, name))
            slot = _Slot(block, tid)
            c.slots[widx] = slot
        else:
            b = p.blocks[slot.block]
            if tid and not slot.id:
                slot.id = tid
                b.id = tid
            if name and not b.name:
                b.name = name  # names are set once, never concatenated (B08)
        if isinstance(args, dict):
            args = orjson.dumps(args).decode() if args else ""
        if isinstance(args, str) and args:
            ev = ToolCallArgumentsDelta(slot.block, args)
            p.apply(ev)
            sink.append(ev)

    @staticmethod
    def _start(p: PartialMessageResponse, sink: list[StreamEvent], ev: ContentBlockStart) -> int:
        p.apply(ev)
        sink.append(ev)
        return ev.index

    @staticmethod
    def _end_tool(p: PartialMessageResponse, index: int, sink: list[StreamEvent]) -> None:
        if p.blocks[index].closed:
            return
        ev = ToolCallEnd(index, p.tool_block(index))
        p.apply(ev)
        sink.append(ev)
        end = ContentBlockEnd(index)
        sink.append(end)

    @staticmethod
    def _close_text(c: _Choice, sink: list[StreamEvent]) -> None:
        if c.text is not None:
            ev = ContentBlockEnd(c.text)
            c.partial.apply(ev)
            sink.append(ev)
            c.text = None

    @staticmethod
    def _close_thinking(c: _Choice, sink: list[StreamEvent]) -> None:
        if c.thinking is not None:
            ev = ContentBlockEnd(c.thinking)
            c.partial.apply(ev)
            sink.append(ev)
            c.thinking = None

    def finish(self) -> list[StreamEvent]:
        main = self._choices[0]
        if not self.done and main.finish is None:
            if not self.partial.blocks and self.partial.usage is None:
                raise ProviderProtocolError(
                    "the stream ended before any data (no chunk, no finish_reason, no [DONE])",
                    provider=self.provider, partial=self.partial.snapshot() if self._chunks else None,
                )
            raise ProviderConnectionError(
                "the stream ended without finish_reason or [DONE]: the response is incomplete",
                provider=self.provider, partial=self.partial.snapshot(),
            )
        out: list[StreamEvent] = []
        others = []
        for idx in sorted(self._choices):
            c = self._choices[idx]
            sink: list[StreamEvent] = out if c.emit else []
            self._close_thinking(c, sink)
            self._close_text(c, sink)
            for slot in c.slots.values():
                self._end_tool(c.partial, slot.block, sink)
            resp = c.partial.snapshot()
            refusal = resp.refusal
            stop = _final_stop(c.finish, bool(resp.tool_calls), refusal, bool(resp.text))
            c.partial.set_stop_reason(stop, c.finish)
            if idx != 0:
                others.append({
                    "index": idx,
                    "message": unstructure(resp.message),
                    "finish_reason": c.finish,
                    "refusal": refusal,
                })
        self.partial.extra.update(self._extra)
        if others:
            self.partial.extra["choices"] = others
        out.append(MessageComplete(self.partial.finalize()))
        return out


class OpenAIChatProvider(HttpProvider):
    """Chat Completions over aiohttp, for every OpenAI-compatible profile."""

    protocol = "openai-chat"

    def endpoint(self, request: MessageRequest, stream: bool) -> str:
        return "/chat/completions"

    def build_body(self, request: MessageRequest, stream: bool) -> dict[str, Any]:
        prof = self.profile
        body: dict[str, Any] = {
            "model": request.model or self.model,
            "messages": messages_to_wire(
                request.messages,
                system_role=prof.option("system_role", "system"),
                reasoning_field=prof.reasoning_field,
                echo_reasoning=prof.echo_reasoning,
            ),
        }
        if request.tools:
            tools = []
            for t in request.tools:
                fn: dict[str, Any] = {"name": t.name, "description": t.description, "parameters": t.parameters}
                if t.strict is not None:
                    fn["strict"] = t.strict
                tools.append({"type": "function", "function": fn})
            body["tools"] = tools
            if request.tool_choice is not None:
                tc = request.tool_choice
                if isinstance(tc, dict) and "name" in tc and "type" not in tc:
                    tc = {"type": "function", "function": {"name": tc["name"]}}
                body["tool_choice"] = tc
            if request.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = request.parallel_tool_calls
        max_tokens = request.max_tokens if request.max_tokens is not None else prof.default_max_tokens
        if max_tokens is not None:
            body[prof.max_tokens_field] = max_tokens
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.top_p is not None:
            body["top_p"] = request.top_p
        if request.stop:
            body["stop"] = list(request.stop)
        rf = response_format_of(request)  # output_schema → json_schema unless response_format is given
        if rf is not None:
            body["response_format"] = rf
        if request.thinking is not None:
            param = prof.option("thinking_param")
            if param == "enable_thinking":  # Qwen / DashScope
                body["enable_thinking"] = request.thinking.enabled
                if request.thinking.budget_tokens:
                    body["thinking_budget"] = request.thinking.budget_tokens
            elif param == "thinking":  # DeepSeek V3.1+
                body["thinking"] = {"type": "enabled" if request.thinking.enabled else "disabled"}
            elif request.thinking.effort:
                body["reasoning_effort"] = request.thinking.effort
        if stream:
            body["stream"] = True
            if prof.stream_usage:
                body["stream_options"] = {"include_usage": True}
        wire_extra = request.extra.get("body")
        if isinstance(wire_extra, dict):
            body.update(wire_extra)
        return body

    def parse_response(self, data: dict[str, Any]) -> MessageResponse:
        return parse_completion(data, self.name)

    def stream_parser(self) -> StreamParser:
        return OpenAIChatStreamParser(self.name)

