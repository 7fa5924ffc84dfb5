"""The stream parser of the Chat Completions protocol: ``chat.completion.chunk`` events into stream
events, tool-call fragments assembled into calls.

Reference: https://platform.openai.com/docs/api-reference/chat-streaming.

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
* ``{"error": ...}`` inside a 200 stream is an error, never a success (B20, llama.cpp);
* a fragment without ``index`` that carries the ``id`` of an earlier call continues that call; one
  with neither (``index: null`` and no ``id``: Qwen, local servers) continues the one call whose
  arguments are still open (not yet a complete JSON value); a call whose arguments are complete is
  never appended to, and argument text that no call can take unambiguously (several calls open, or
  none) ends the calls concerned with ``provider_data["arguments_error"]``: they are answered with
  an error result, never run with arguments that may be wrong (:meth:`OpenAIChatStreamParser._tool_fragment`);
* the calls in the message decide the stop reason: ``tool_calls`` with no call is ``end_turn`` (C01),
  ``stop`` (Ollama) or a trailing second ``stop`` after ``tool_calls`` with calls is ``tool_use`` (C02)
  (:func:`~fsm_agent.providers.openai_chat.response.final_stop`).

Reasoning text and a tool call's vendor fields are recorded with the vendor that produced them
(:mod:`.vendor`), as the non-streaming decoder (:mod:`.response`) records them.
"""

from __future__ import annotations

from typing import Any

import orjson
from attrs import define, field

from ...errors import ProviderConnectionError, ProviderProtocolError
from ...types.codec import unstructure
from ...types.stream import (
    ContentBlockEnd,
    ContentBlockStart,
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
from ..costs import cost_update
from ..errors import error_from_payload
from ..sse import ServerSentEvent
from ..wire import STRAY, check, guard, stray_error
from .response import CHUNK_SHAPE, final_stop, parse_usage
from .vendor import SOURCE, merge_reasoning_details, merge_vendor_fields, thinking_data, tool_vendor_fields

__all__ = ["OpenAIChatStreamParser"]


@define(slots=True)
class _Slot:
    block: int
    id: str
    fields: dict[str, Any] = field(factory=dict)
    """Vendor fields of the call so far (keys of its fragments outside the protocol's)."""
    start_fields: dict[str, Any] = field(factory=dict)
    """The vendor fields sent with its ContentBlockStart."""
    name: str = ""
    text: list[str] = field(factory=list)
    """The argument text received so far, in pieces (the partial block's own list)."""
    tail: str = ""
    """The last non-blank character of the argument text (``""``: none yet)."""
    whole: bool | None = False
    """Whether the argument text is one complete JSON value (``None``: not checked since the last piece)."""
    error: str | None = None
    """Why the stream cannot be trusted with this call's arguments; the call is then never run."""

    def added(self, text: str) -> None:
        """Note a piece just appended to :attr:`text`."""
        stripped = text.rstrip()
        if stripped:
            self.tail = stripped[-1]
            self.whole = None if self.tail in "}]" else False

    @property
    def complete(self) -> bool:
        """The argument text is a complete JSON value: nothing more may be appended to it. Checked
        only when the text ends in ``}`` or ``]``, once per new piece."""
        if self.whole is None:
            try:
                orjson.loads("".join(self.text))
                self.whole = True
            except orjson.JSONDecodeError:
                self.whole = False
        return self.whole


@define(slots=True)
class _Choice:
    """Aggregation state of one choice."""

    partial: PartialMessageResponse
    emit: bool
    text: int | None = None
    thinking: int | None = None
    thinking_field: str | None = None
    slots: dict[int, _Slot] = field(factory=dict)
    """The call at each wire index (a fragment without ``index`` uses its position in the delta)."""
    by_id: dict[str, _Slot] = field(factory=dict)
    order: list[_Slot] = field(factory=list)
    last: _Slot | None = None
    finish: str | None = None
    fn_slot: int | None = None
    rd_block: int | None = None
    """The thinking block that holds OpenRouter's ``reasoning_details``; it ends with the stream."""
    rd: list[Any] = field(factory=list)
    rd_field: str | None = None


class OpenAIChatStreamParser:
    """Chat Completions chunks into stream events (choice 0; other choices aggregated into ``extra``).

    ``vendor`` (see :attr:`OpenAIChatProvider.vendor`) is recorded on the thinking blocks and on the
    vendor fields of tool calls, so that they go back only to the endpoint that produced them."""

    def __init__(self, provider: str = "openai", vendor: str | None = None) -> None:
        self.provider = provider
        self.vendor = vendor
        self.partial = PartialMessageResponse(provider=provider, source=SOURCE)
        self._choices: dict[int, _Choice] = {0: _Choice(self.partial, True)}
        self._started = False
        self.done = False
        self._chunks = 0
        self._events = 0
        self._extra: dict[str, Any] = {}

    def _choice(self, index: int) -> _Choice:
        c = self._choices.get(index)
        if c is None:
            c = _Choice(PartialMessageResponse(provider=self.provider, source=SOURCE), False)
            self._choices[index] = c
        return c

    def feed(self, sse: ServerSentEvent) -> list[StreamEvent]:
        """The stream events of one chunk.

        Raises:
            ProviderError: an error object in the stream, as its most specific class.
            ProviderProtocolError: a chunk that is not a JSON object, or holds a value of the wrong
                type (the message names its path: ``stream event 3: choices[0].delta.content: expected
                string or array, got number``).
        """
        self._events += 1
        try:
            return self._feed(sse)
        except STRAY as exc:  # wire.guard, inlined: this runs once per chunk
            raise stray_error(exc, f"stream event {self._events}", self.provider) from exc

    def _feed(self, sse: ServerSentEvent) -> list[StreamEvent]:
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
        check(chunk, CHUNK_SHAPE, what=f"stream event {self._events}", provider=self.provider, raw=data)
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
            ev2 = cost_update(usage, self.partial.model)
            self.partial.apply(ev2)
            out.append(ev2)
        return out

    def _delta(self, choice: dict[str, Any], out: list[StreamEvent]) -> None:
        c = self._choice(choice.get("index") or 0)
        sink: list[StreamEvent] = out if c.emit else []
        p = c.partial
        delta = choice.get("delta") or {}
        key = "reasoning_content"
        reasoning = delta.get(key)
        if not reasoning:
            key = "reasoning"
            reasoning = delta.get(key)
        if isinstance(reasoning, str) and reasoning:
            if c.thinking is None:
                self._close_text(c, sink)
                c.thinking_field = key
                c.thinking = self._start(p, sink, ContentBlockStart(len(p.blocks), "thinking",
                                                                    data=thinking_data(self.vendor, key)))
            ev: StreamEvent = ThinkingDelta(c.thinking, reasoning)
            p.apply(ev)
            sink.append(ev)
        details = delta.get("reasoning_details")
        if isinstance(details, list) and details:
            if c.rd_block is None:
                if c.thinking is not None:
                    c.rd_block = c.thinking
                    c.rd_field = c.thinking_field
                else:  # encrypted-only reasoning: an empty thinking block carries it
                    c.rd_block = self._start(p, sink, ContentBlockStart(len(p.blocks), "thinking",
                                                                        data=thinking_data(self.vendor, None)))
            c.rd = merge_reasoning_details(c.rd, details)
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
                if isinstance(tc, dict):
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
        """One ``tool_calls`` fragment: which call it continues, or the call it starts.

        * With an ``index``: the call at that index; a new non-empty ``id`` there starts a new call
          (B08), ``"id": ""`` continues it.
        * Without one: a known ``id`` continues that call, wherever it is (a parallel call's later
          fragment); a new ``id`` starts a call (Gemini sends each call whole, unindexed: C03).
        * With neither (``index: null``, no ``id``: Qwen, local servers): the fragment continues the
          one call whose arguments are still open, that is not yet a complete JSON value (the latest
          call, or an earlier one already holding part of its arguments). A fragment with a name
          starts a new call unless that open call has the same name or none yet.

        A call whose arguments are already a complete JSON value is never appended to: a fragment
        with a name and no ``id`` then starts a new call (unless it only repeats the name), and
        argument text is an error for that call. So is argument text the stream does not attribute:
        no ``index``, no ``id`` and several calls open (each of them), or none open (the latest
        call). Such a call ends with ``provider_data["arguments_error"]`` saying why, its arguments
        unparsed (``raw_input``), so it is answered with an error result and never run.
        """
        raw_index = tc.get("index")
        explicit = isinstance(raw_index, int) and not isinstance(raw_index, bool)
        widx: int = raw_index if explicit and isinstance(raw_index, int) else pos
        tid = tc.get("id") or ""
        if not isinstance(tid, str):
            tid = str(tid)
        fn = tc.get("function") or {}
        if not isinstance(fn, dict):
            fn = {}
        name = fn.get("name") or ""
        args = fn.get("arguments")
        if isinstance(args, dict):
            args = orjson.dumps(args).decode() if args else ""
        text = args if isinstance(args, str) else ""
        blank = not text.strip()
        fields = tool_vendor_fields(tc)
        slot: _Slot | None = None
        if explicit:
            slot = c.slots.get(widx)
            if slot is not None:
                if tid and slot.id and tid != slot.id:
                    # B08: a new id at an index in use starts a new call.
                    self._end_tool(c, p, slot, sink)
                    slot = None
                elif (name or not blank) and slot.complete:
                    if not tid and name and (not blank or name != slot.name):
                        self._end_tool(c, p, slot, sink)
                        slot = None  # a finished call's index given to the next call, with no id
                    elif not blank:
                        self._stray(p, [slot], text, f"index {widx}")
                        return
        elif tid:
            slot = c.by_id.get(tid)
            if slot is not None and not blank and slot.complete:
                self._stray(p, [slot], text, f"id {tid!r}")
                return
        elif c.order:
            last = c.last
            open_ = [s for s in c.order if (s is last or s.tail) and not s.complete]
            if name:
                if len(open_) == 1 and (not open_[0].name or open_[0].name == name):
                    slot = open_[0]
                elif not open_ and blank and last is not None and last.name == name:
                    slot = last  # the name again, nothing more
            elif len(open_) == 1:
                slot = open_[0]
            elif blank:
                slot = last  # nothing to place: vendor fields at most
            else:
                self._stray(p, open_ or ([last] if last is not None else []), text, None)
                return
        if slot is None:
            self._close_text(c, sink)
            data = {SOURCE: {"vendor": self.vendor, "fields": fields}} if fields else None
            block = self._start(p, sink, ContentBlockStart(len(p.blocks), "tool_use", tid, name, data))
            slot = _Slot(block, tid, dict(fields), dict(fields), name, p.blocks[block].parts)
            c.slots[widx] = slot
            c.order.append(slot)
            if tid:
                c.by_id.setdefault(tid, slot)
        else:
            b = p.blocks[slot.block]
            if tid and not slot.id:
                slot.id = tid
                b.id = tid
                c.by_id.setdefault(tid, slot)
            if name and not b.name:
                b.name = slot.name = name  # names are set once, never concatenated (B08)
            if fields:
                slot.fields = merge_vendor_fields(slot.fields, fields)
        c.last = slot
        if text and not (blank and slot.complete):
            ev = ToolCallArgumentsDelta(slot.block, text)
            p.apply(ev)
            slot.added(text)
            sink.append(ev)

    def _stray(self, p: PartialMessageResponse, calls: list[_Slot], text: str, key: str | None) -> None:
        """Argument text that continues no call it may be appended to: each of ``calls`` ends with an
        error instead of arguments that could be wrong (the text is dropped, not guessed)."""
        piece = text if len(text) <= 60 else text[:57] + "..."
        if key is not None:
            why = (f"the stream sent more argument text ({piece!r}) for the call at {key} after its "
                   "arguments were already a complete JSON value")
        elif len(calls) > 1:
            names = ", ".join(repr(p.blocks[s.block].name or "?") for s in calls)
            why = (f"the stream sent argument text ({piece!r}) with no index and no id while calls {names} "
                   "were all still open: it does not say which call it continues")
        else:
            why = (f"the stream sent argument text ({piece!r}) with no index and no id after this call's "
                   "arguments were already a complete JSON value")
        for s in calls:
            if s.error is None:
                s.error = why

    @staticmethod
    def _start(p: PartialMessageResponse, sink: list[StreamEvent], ev: ContentBlockStart) -> int:
        p.apply(ev)
        sink.append(ev)
        return ev.index

    def _end_tool(self, c: _Choice, p: PartialMessageResponse, slot: _Slot, sink: list[StreamEvent]) -> None:
        index = slot.block
        if p.blocks[index].closed:
            return
        data: dict[str, Any] | None = None
        if slot.fields != slot.start_fields:  # vendor fields that came after the first fragment
            data = {SOURCE: {"vendor": self.vendor, "fields": slot.fields}}
        if slot.error is not None:  # the call is answered with an error, never run (its arguments are unsure)
            data = {**(data or {}), "arguments_error": slot.error}
        if data:
            p.set_block_data(index, **data)
        call = p.tool_block(index)
        ev = ToolCallEnd(index, call)
        p.apply(ev)
        sink.append(ev)
        end = ContentBlockEnd(index, data)
        p.apply(end)
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
            if c.thinking != c.rd_block:  # the block holding reasoning_details ends with the stream
                ev = ContentBlockEnd(c.thinking)
                c.partial.apply(ev)
                sink.append(ev)
            c.thinking = None

    def _end_details(self, c: _Choice, sink: list[StreamEvent]) -> None:
        if c.rd_block is None or c.partial.blocks[c.rd_block].closed:
            return
        ev = ContentBlockEnd(c.rd_block, thinking_data(self.vendor, c.rd_field, c.rd))
        c.partial.apply(ev)
        sink.append(ev)

    def finish(self) -> list[StreamEvent]:
        with guard("end of stream", self.provider):
            return self._finish()

    def _finish(self) -> list[StreamEvent]:
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
            self._end_details(c, sink)
            for slot in c.order:
                self._end_tool(c, c.partial, slot, sink)
            resp = c.partial.snapshot()
            refusal = resp.refusal
            stop = final_stop(c.finish, bool(resp.tool_calls), refusal, bool(resp.text))
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
