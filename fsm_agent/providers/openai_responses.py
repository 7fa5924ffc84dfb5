"""OpenAI Responses wire protocol (``POST /responses``; also DeepSeek's compatible endpoint).

Reference: https://platform.openai.com/docs/api-reference/responses and
https://platform.openai.com/docs/api-reference/responses-streaming.

Request (:func:`messages_to_input`): leading system messages become ``instructions``, a
later one a ``developer`` message where it was said; user content → ``input_text`` /
``input_image`` / ``input_file``; tool results → ``function_call_output``. An assistant turn
becomes output items in block order: text → assistant ``message`` (``output_text`` with
``annotations``; id and ``phase`` from ``AssistantMessage.provider_data``), tool calls →
``function_call`` (arguments a JSON string, ``"{}"`` for none; ``fc_`` id from
``ToolUseBlock.provider_data``), this protocol's thinking → ``reasoning`` (id, ``summary``,
``encrypted_content``), its server-tool items (:class:`ExtensionBlock`) verbatim; other
protocols' thinking and extensions are not sent. Case B05 (:func:`keep_reasoning_items`): a
reasoning item goes only when the next item of its response is an output item. A reasoning
item that cannot be replayed (no id; ``store: false`` without ``encrypted_content``) sends
its turn's items without ids, so none points at it (the inverse 400 of B05). An answer marked
interrupted (``provider_data["interrupted"]``, a cut stream's partial) goes without reasoning and
without item ids, and the marker is never sent. :func:`_pair_calls`: a call given twice is sent
once, an output given twice once, and a call never answered gets an error output (C11).
``store: false`` on a model that reasons adds ``include: ["reasoning.encrypted_content"]`` (C08).

Assistant provider data written here: ``{"text_item_ids": [item id per text block],
"item_phases": {id: phase}}``; a hand-built ``{"id": "msg_..."}`` is read too. Thinking text
is the summary texts, then DeepSeek's ``reasoning_text`` parts, joined by a blank line.

Streams fold every ``response.*`` event into one :class:`PartialMessageResponse`; the
``*.done`` events and the ``response.completed`` payload fill what deltas missed (and give
the final ``encrypted_content``), so the result equals :func:`parse_output` of that payload.
A block's wire data (reasoning summary, ``encrypted_content``, DeepSeek's ``content``, a
server-tool item, a text's annotations) rides in its ``ContentBlockEnd``; when the final
payload revises a closed block, one more ``ContentBlockEnd`` carries what changed. So the
emitted events, folded again, give the same blocks as the final response.
``response.failed`` and ``error`` events raise; a stream without a terminal event raises
:class:`ProviderConnectionError` (content arrived) or :class:`ProviderProtocolError`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import orjson
from attrs import define, field

from ..errors import InvalidRequestError, ProviderConnectionError, ProviderProtocolError
from ..types.content import (AudioBlock, ContentBlock, ExtensionBlock, FileBlock, ImageBlock,
                             TextBlock, ThinkingBlock, ToolUseBlock)
from ..types.messages import (AssistantMessage, Message, ModelStopReason, SystemMessage,
                              Usage, UserImageMessage, UserMessage)
from ..types.pairing import MISSING_RESULT, normalize_pairing
from ..types.requests import MessageRequest, MessageResponse
from ..types.stream import (ContentBlockEnd, ContentBlockStart, CostUpdate, MessageComplete,
                            MessageStart, PartialMessageResponse, RefusalDelta, StreamEvent,
                            TextDelta, ThinkingDelta, ToolCallArgumentsDelta, ToolCallEnd,
                            parse_tool_arguments)
from .base import HttpProvider, StreamParser
from .costs import cost_update
from .errors import error_from_payload
from .sse import ServerSentEvent
from .structured_output import response_format_of
from .wire import (ARRAY, COUNT, INT, OBJECT, STR, STRAY, check, guard, list_of, obj, one_of, orphan_error, stray_error,
                   tagged)

__all__ = ["OpenAIResponsesProvider", "OpenAIResponsesStreamParser", "keep_reasoning_items",
           "map_status", "messages_to_input", "parse_output", "parse_usage"]

_ANNOTATIONS = frozenset({"url_citation", "file_citation", "file_path", "container_file_citation"})
"""The annotation types of Responses output text (OpenAI API reference, ``output_text.annotations``)."""

SOURCE = "openai-responses"
_SEP = "\n\n"
_NOT_OUTPUT = frozenset({"reasoning", "function_call_output", "computer_call_output", "item_reference",
                         "local_shell_call_output", "custom_tool_call_output", "mcp_approval_response"})
_PASS_THROUGH = ("truncation", "metadata", "prompt_cache_key", "service_tier", "safety_identifier",
                 "max_tool_calls", "top_logprobs")


def parse_usage(u: Any) -> Usage | None:
    """``usage`` in tokens (cached from ``input_tokens_details``, reasoning from
    ``output_tokens_details``), or ``None`` when absent."""
    if not isinstance(u, dict) or (u.get("input_tokens") is None and u.get("output_tokens") is None):
        return None
    return Usage(int(u.get("input_tokens") or 0), int(u.get("output_tokens") or 0),
                 cache_read_tokens=int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0),
                 reasoning_tokens=int((u.get("output_tokens_details") or {}).get("reasoning_tokens") or 0))


def map_status(status: str | None, reason: str | None, *, has_tools: bool, has_text: bool,
               refusal: str | None) -> ModelStopReason:
    """``status`` (and ``incomplete_details.reason``) to :class:`ModelStopReason`.

    ``incomplete``: ``content_filter`` → CONTENT_FILTERED, any other reason
    (``max_output_tokens``) → MAX_TOKENS. Otherwise TOOL_USE with function calls, REFUSAL
    for a refusal without text, else END_TURN. ``failed`` raises before getting here.
    """
    if status == "incomplete":
        return ModelStopReason.CONTENT_FILTERED if reason == "content_filter" else ModelStopReason.MAX_TOKENS
    if has_tools:
        return ModelStopReason.TOOL_USE
    return ModelStopReason.REFUSAL if refusal and not has_text else ModelStopReason.END_TURN


def _raise_if_failed(resp: dict[str, Any], provider: str) -> None:
    status = resp.get("status")
    if status in ("failed", "cancelled"):
        err = resp.get("error") or {"message": f"the response {status}", "code": status}
        # a response's error has a ``code`` (server_error ...) and no ``type``: classify by it
        raise error_from_payload({"error": {"type": err.get("code"), **err}}, provider=provider)


def _reasoning_text(item: dict[str, Any]) -> str:
    segs = [p.get("text") or "" for p in item.get("summary") or () if isinstance(p, dict)]
    segs += [p.get("text") or "" for p in item.get("content") or ()
             if isinstance(p, dict) and p.get("type") == "reasoning_text"]
    return _SEP.join(segs)


def _reasoning_data(item: dict[str, Any]) -> dict[str, Any]:
    """What a reasoning item needs to go back: id, summary, encrypted_content, content."""
    data: dict[str, Any] = {"summary": list(item.get("summary") or [])}
    data.update({k: item[k] for k in ("id", "encrypted_content", "content") if item.get(k)})
    return data


def _finish(resp: dict[str, Any], tools: bool, ids: list[str | None], phases: dict[str, str],
            refusal: str | None) -> tuple[ModelStopReason, str, dict[str, Any] | None, dict[str, Any]]:
    """(stop reason, raw stop reason, assistant provider data, extra), shared by both paths."""
    status = resp.get("status") or "completed"
    reason = (resp.get("incomplete_details") or {}).get("reason")
    stop = map_status(status, reason, has_tools=tools, has_text=bool(ids), refusal=refusal)
    data = {"text_item_ids": ids, **({"item_phases": phases} if phases else {})} if any(ids) else None
    extra = {k: resp[k] for k in ("service_tier", "incomplete_details", "previous_response_id")
             if resp.get(k) is not None}
    return stop, (reason if status == "incomplete" and reason else status), data, extra


# ---------------------------------------------------------------------------- request
def _data_url(data: str, media_type: str | None) -> str:
    if data.startswith(("data:", "http://", "https://")):
        return data
    return f"data:{media_type or 'application/octet-stream'};base64,{data}"


def _input_parts(content: Sequence[ContentBlock]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for b in content:
        if isinstance(b, TextBlock):
            parts.append({"type": "input_text", "text": b.text})
        elif isinstance(b, ImageBlock):
            url = b.url or _data_url(b.data or "", b.media_type)
            parts.append({"type": "input_image", "image_url": url, "detail": b.detail})
        elif isinstance(b, FileBlock):
            src = ({"file_id": b.file_id} if b.file_id else {"file_data": _data_url(b.data, b.media_type)}
                   if b.data else {"file_url": b.url})
            parts.append({"type": "input_file", **src, **({"filename": b.filename} if b.filename else {})})
        elif isinstance(b, AudioBlock):
            raise InvalidRequestError("audio input is not part of the Responses protocol; use the "
                                      "openai-chat provider for audio", provider=SOURCE)
    return parts


def _reasoning_item(b: ThinkingBlock, store: bool | None) -> dict[str, Any] | None:
    pd = b.provider_data or {}
    if not isinstance(pd.get("id"), str) or not pd["id"]:
        return None
    if store is False and not pd.get("encrypted_content") and not pd.get("content"):
        return None  # not stored server-side and nothing to rebuild it from
    summary = pd.get("summary")
    if summary is None:
        summary = [{"type": "summary_text", "text": b.thinking}] if b.thinking else []
    item = {"type": "reasoning", "id": pd["id"], "summary": list(summary)}
    item.update({k: pd[k] for k in ("encrypted_content", "content") if pd.get(k)})
    return item


def _assistant_items(m: AssistantMessage, store: bool | None) -> list[dict[str, Any]]:
    pd = m.provider_data or {}
    cut = bool(pd.get("interrupted"))  # a partial answer of a cut stream: its items never completed
    n_text = sum(1 for b in m.content if isinstance(b, TextBlock) and b.text)
    ids = pd.get("text_item_ids")
    if not isinstance(ids, list) or len(ids) != n_text:
        ids = [pd["id"] if isinstance(pd.get("id"), str) else None] * n_text
    next_id = iter(ids)
    phases = pd.get("item_phases") or {}
    items: list[dict[str, Any]] = []
    msg: dict[str, Any] | None = None
    lost_reasoning = False
    for b in m.content:
        if isinstance(b, TextBlock):
            if not b.text:
                continue
            mid = next(next_id)
            # only OpenAI's own annotation types: citations from another protocol (after a provider
            # switch) would be rejected
            part = {"type": "output_text", "text": b.text,
                    "annotations": [a for a in b.citations if isinstance(a, dict) and a.get("type") in _ANNOTATIONS]}
            if msg is not None and msg.get("id") == mid:
                msg["content"].append(part)
                continue
            msg = {"type": "message", "role": "assistant", "content": [part]}
            if mid:
                msg.update(id=mid, status="completed", **({"phase": phases[mid]} if mid in phases else {}))
            items.append(msg)
            continue
        msg = None
        if isinstance(b, ThinkingBlock) and b.source == SOURCE:
            item = None if cut else _reasoning_item(b, store)
            lost_reasoning |= item is None
            items += [item] if item is not None else []
        elif isinstance(b, ToolUseBlock):
            args = b.raw_input if b.raw_input is not None else orjson.dumps(b.input).decode()
            call = {"type": "function_call", "call_id": b.id, "name": b.name, "arguments": args}
            fid = (b.provider_data or {}).get("id")
            items.append({**call, "id": fid} if isinstance(fid, str) and fid else call)
        elif isinstance(b, ExtensionBlock) and b.source == SOURCE:
            items.append(dict(b.data))
    if lost_reasoning or cut:
        for item in items:
            if item["type"] in ("function_call", "message"):
                for key in ("id", "status", "phase"):
                    item.pop(key, None)
    return items


def keep_reasoning_items(items: Sequence[dict[str, Any]],
                         groups: Sequence[int | None] | None = None) -> list[dict[str, Any]]:
    """Case B05: drop each reasoning item not followed by an output item of its response.

    ``groups`` gives, per item, the assistant turn (response) it came from, ``None`` for input
    items; without it neighbours count as one response. A run of reasoning items counts as
    one: kept when the item after the run is an output item (``function_call``, assistant
    ``message``, a server-tool call) of the same response. Only reasoning items are dropped,
    so a function call always keeps the reasoning before it. Returns a new list.
    """
    def is_output(item: dict[str, Any]) -> bool:
        kind = item.get("type")
        if kind is None or kind == "message":
            return item.get("role") == "assistant"
        return kind not in _NOT_OUTPUT

    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if item.get("type") == "reasoning":
            g = groups[i] if groups is not None else None
            j = i + 1
            while j < len(items) and items[j].get("type") == "reasoning" and (groups is None or groups[j] == g):
                j += 1
            if j == len(items) or (groups is not None and groups[j] != g) or not is_output(items[j]):
                continue
        out.append(item)
    return out


def messages_to_input(messages: Sequence[Message], *, system_role: str = "developer",
                      store: bool | None = None, server_state: bool = True,
                      provider: str = SOURCE) -> tuple[str | None, list[dict[str, Any]]]:
    """Neutral messages as ``(instructions, input items)``, by the rules of the module docstring.

    ``store`` is the request's ``store`` flag (``False``: reasoning without
    ``encrypted_content`` cannot be replayed).

    ``server_state``: the request continues state kept on the server (``previous_response_id``,
    ``conversation``), where the calls of results with none before them may be.

    Raises:
        InvalidRequestError: audio input (the protocol has no audio part).
        InvalidHistoryError: without ``server_state``, a tool result that answers no earlier call
            (the API refuses it: "No tool call found for function call output").
    """
    system: list[str] = []
    items: list[dict[str, Any]] = []
    groups: list[int | None] = []
    # results right after their calls (:func:`~fsm_agent.types.normalize_pairing`); an output with no
    # call before it stays (with ``previous_response_id`` the call is on the server)
    messages, orphans = normalize_pairing(messages)
    if orphans and not server_state:
        raise orphan_error(messages, orphans, provider)
    for pos, m in enumerate(messages):
        if isinstance(m, AssistantMessage):
            made = _assistant_items(m, store)
            items += made
            groups += [pos] * len(made)
            continue
        if isinstance(m, SystemMessage):
            if not items:
                system.append(m.text)
                continue
            new = {"type": "message", "role": system_role, "content": [{"type": "input_text", "text": m.text}]}
        elif isinstance(m, UserMessage):
            new = {"type": "message", "role": "user", "content": _input_parts(m.content)}
        elif isinstance(m, UserImageMessage):
            image = {"type": "input_image", "image_url": _data_url(m.data, m.mime_type), "detail": m.detail}
            new = {"type": "message", "role": "user", "content": [image]}
        else:
            simple = all(isinstance(b, TextBlock) for b in m.content)
            new = {"type": "function_call_output", "call_id": m.tool_call_id,
                   "output": m.text if simple else _input_parts(m.content)}
        items.append(new)
        groups.append(None)
    items, groups = _pair_calls(items, groups)
    return (_SEP.join(system) if system else None), keep_reasoning_items(items, groups)


MISSING_OUTPUT = MISSING_RESULT
"""The output sent for a ``function_call`` the history never answered (the API rejects the request
otherwise: "No tool output found for function call ...")."""


def _pair_calls(items: list[dict[str, Any]], groups: list[int | None]
                ) -> tuple[list[dict[str, Any]], list[int | None]]:
    """Every ``function_call`` once, with exactly one ``function_call_output`` after it (C11, and a
    history that repeats one call).

    A call whose id is still waiting for its output is the same call given again (once as a
    block and once more): it is sent once. An output repeated for one call is sent once (the
    first). A call never answered gets a :data:`MISSING_OUTPUT` error output right after its
    turn's items. A call id used again after its output (``call_0`` every turn) is a new call.
    An output with no call before it stays: with ``previous_response_id`` the call is on the
    server.
    """
    waiting: dict[Any, int] = {}  # call id -> position in ``out`` of its call, until answered
    answered: set[Any] = set()
    out: list[dict[str, Any]] = []
    out_groups: list[int | None] = []
    for item, g in zip(items, groups):
        kind, cid = item.get("type"), item.get("call_id")
        if kind == "function_call":
            if cid in waiting:
                continue
            waiting[cid] = len(out)
            answered.discard(cid)
        elif kind == "function_call_output":
            if cid in waiting:
                del waiting[cid]
            elif cid in answered:
                continue
            answered.add(cid)
        out.append(item)
        out_groups.append(g)
    if not waiting:
        return out, out_groups
    unanswered = {pos: cid for cid, pos in waiting.items()}
    fixed: list[dict[str, Any]] = []
    fixed_groups: list[int | None] = []
    pending: list[str] = []
    for i, (item, g) in enumerate(zip(out, out_groups)):
        fixed.append(item)
        fixed_groups.append(g)
        if i in unanswered:
            pending.append(unanswered[i])
        if pending and (i + 1 == len(out) or out_groups[i + 1] != g):
            fixed += [{"type": "function_call_output", "call_id": c, "output": MISSING_OUTPUT} for c in pending]
            fixed_groups += [None] * len(pending)
            pending = []
    return fixed, fixed_groups


# ---------------------------------------------------------------------------- wire shapes
# What the parsers below read, by type (fsm_agent.providers.wire): a frame that differs raises a
# ProviderProtocolError naming the path. Keys not named here are kept or ignored as received.
_USAGE = obj(input_tokens=COUNT, output_tokens=COUNT, total_tokens=COUNT,
             input_tokens_details=obj(cached_tokens=COUNT), output_tokens_details=obj(reasoning_tokens=COUNT))
_PART = obj(type=STR, text=STR, annotations=ARRAY, refusal=STR)
_PARTS = list_of(_PART)
_ITEMS = {
    "message": obj(id=STR, phase=STR, content=_PARTS),
    "function_call": obj(id=STR, call_id=STR, name=STR, arguments=one_of(STR, OBJECT)),
    "reasoning": obj(id=STR, summary=_PARTS, content=_PARTS, encrypted_content=STR),
}
_ITEM = tagged("type", _ITEMS, obj(id=STR), missing="message")
RESPONSE_SHAPE = obj(id=STR, model=STR, status=STR,
                     output=list_of(tagged("type", _ITEMS, obj(id=STR), missing="message", nullable=False)),
                     usage=_USAGE, incomplete_details=obj(reason=STR), error=OBJECT)
"""A response object, as :func:`parse_output` reads it."""
EVENT_SHAPE = obj(type=STR, response=RESPONSE_SHAPE, item=_ITEM, part=_PART, delta=STR, text=STR, refusal=STR,
                  arguments=STR, output_index=INT, content_index=INT, summary_index=INT, item_id=STR)
"""Every stream event the parser reads (those of ``_HANDLERS``); others are ignored."""


# ---------------------------------------------------------------------------- response
def parse_output(data: dict[str, Any], provider: str) -> MessageResponse:
    """A response object into a :class:`MessageResponse`, ``output`` items in order.

    ``message`` → text blocks (annotations as citations; ``refusal`` parts → ``refusal``),
    ``function_call`` → tool use (``fc_`` id in provider data), ``reasoning`` → thinking
    (source ``openai-responses``), anything else (``web_search_call`` ...) → extension.

    Raises:
        ProviderError: status ``failed`` or ``cancelled``, classified from ``error``.
        ProviderProtocolError: a value of the wrong type (the message names its path).
    """
    check(data, RESPONSE_SHAPE, what="response body", provider=provider)
    with guard("response body", provider):
        return _parse_output(data, provider)


def _parse_output(data: dict[str, Any], provider: str) -> MessageResponse:
    _raise_if_failed(data, provider)
    blocks: list[ContentBlock] = []
    refusals: list[str] = []
    ids: list[str | None] = []
    phases: dict[str, str] = {}
    for item in data.get("output") or ():
        kind = item.get("type")
        if kind == "message":
            for part in item.get("content") or ():
                if part.get("type") in ("output_text", "text") and part.get("text"):
                    blocks.append(TextBlock(part["text"], tuple(part.get("annotations") or ())))
                    ids.append(item.get("id"))
                elif part.get("type") == "refusal":
                    refusals.append(part.get("refusal") or "")
            if item.get("id") and item.get("phase"):
                phases[item["id"]] = item["phase"]
        elif kind == "function_call":
            args = item.get("arguments")
            inp, raw = (args, None) if isinstance(args, dict) else parse_tool_arguments(args)
            blocks.append(ToolUseBlock(item.get("call_id") or item.get("id") or "", item.get("name") or "",
                                       inp, raw, {"id": item["id"]} if item.get("id") else None))
        elif kind == "reasoning":
            blocks.append(ThinkingBlock(_reasoning_text(item), source=SOURCE, provider_data=_reasoning_data(item)))
        else:
            blocks.append(ExtensionBlock(str(kind), dict(item), SOURCE))
    refusal = "".join(refusals) or None
    tools = any(isinstance(b, ToolUseBlock) for b in blocks)
    stop, raw_stop, mdata, extra = _finish(data, tools, ids, phases, refusal)
    return MessageResponse(data.get("id") or "", data.get("model") or "", AssistantMessage(tuple(blocks), mdata),
                           stop, raw_stop, parse_usage(data.get("usage")), provider, refusal, extra)


# ---------------------------------------------------------------------------- streaming
@define(slots=True)
class _Item:
    """Stream state of one output item: its runtime block (function_call / reasoning /
    extension), text blocks by ``content_index`` (message), reasoning segments begun."""

    index: int
    type: str
    id: str | None
    phase: str | None = None
    block: int | None = None
    parts: dict[int, int] = field(factory=dict)
    segments: list[tuple[str, int]] = field(factory=list)


class OpenAIResponsesStreamParser:
    """``response.*`` SSE events into stream events, aggregated in :attr:`partial`.

    ``feed`` raises the classified :class:`~fsm_agent.errors.ProviderError` on
    ``response.failed`` or an ``error`` event; ``finish`` raises when neither
    ``response.completed`` nor ``response.incomplete`` arrived.
    """

    def __init__(self, provider: str = SOURCE) -> None:
        self.provider = provider
        self.partial = PartialMessageResponse(provider=provider, source=SOURCE)
        self._items: dict[int, _Item] = {}
        self._by_id: dict[str, int] = {}
        self._len: dict[Any, int] = {}  # characters received per block / reasoning segment / refusal part
        self._texts: dict[int, _Item] = {}
        self._tools: set[int] = set()
        self._closed: set[int] = set()
        self._citations: dict[int, list[Any]] = {}
        self._final: dict[str, Any] | None = None
        self._started = False
        self._events = 0

    def feed(self, sse: ServerSentEvent) -> list[StreamEvent]:
        """The stream events of one server-sent event.

        Raises:
            ProviderError: ``response.failed`` or an ``error`` event, as its most specific class.
            ProviderProtocolError: data that is not a JSON object, or holds a value of the wrong type
                (the message names its path: ``item.content[0].text: expected string, got number``).
        """
        self._events += 1
        try:
            return self._feed(sse)
        except STRAY as exc:  # wire.guard, inlined: this runs once per event
            raise stray_error(exc, f"stream event {self._events} ({sse.event})", self.provider) from exc

    def _feed(self, sse: ServerSentEvent) -> list[StreamEvent]:
        data = sse.data.strip()
        if self._final is not None or not data or data == "[DONE]":
            return []
        try:
            ev = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            if sse.event == "error":
                raise error_from_payload({"error": {"message": data}}, provider=self.provider) from exc
            raise ProviderProtocolError(f"stream event is not JSON ({exc}): {data[:200]!r}",
                                        provider=self.provider) from exc
        if not isinstance(ev, dict):
            raise ProviderProtocolError(f"stream event is not an object: {data[:200]!r}", provider=self.provider)
        kind = ev.get("type") or sse.event
        if kind == "error" or sse.event == "error":
            raise error_from_payload(ev, provider=self.provider)
        out: list[StreamEvent] = []
        handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
        if handler is not None or not isinstance(kind, str):  # a "type" that is no string fails the check
            check(ev, EVENT_SHAPE, what=f"stream event {self._events} ({kind if handler else sse.event})",
                  provider=self.provider, raw=data)
        if handler is not None:
            if not self._started and handler[0] != "_on_terminal":
                self._on_start(ev, out)
            getattr(self, handler[0])(ev, out, handler[1])
        return out

    # -- handlers: (event, out, argument from _HANDLERS) -----------------------------------------
    def _on_start(self, ev: dict[str, Any], out: list[StreamEvent], arg: Any = None) -> None:
        """Emit MessageStart once, first (also for servers that skip ``response.created``)."""
        resp = ev.get("response") or {}
        start = MessageStart(resp.get("id") or "", resp.get("model") or "")
        self.partial.apply(start)  # fills id and model, never blanks them
        if not self._started:
            self._started = True
            out.append(start)

    def _on_item(self, ev: dict[str, Any], out: list[StreamEvent], done: bool) -> None:
        item = ev.get("item") or {}
        self._sync(self._index(ev.get("output_index"), item.get("id")), item, out, done)

    def _on_part(self, ev: dict[str, Any], out: list[StreamEvent], done: bool) -> None:
        it, ci, part = self._item(ev, "message", out), ev.get("content_index", 0), ev.get("part") or {}
        if it.type == "reasoning":  # DeepSeek: reasoning_text parts
            self._think(it, ("c", ci), part.get("text") or "", True, out)
        else:
            self._fill_part(it, ci, part, out, close=done)

    def _on_annotation(self, ev: dict[str, Any], out: list[StreamEvent], arg: Any = None) -> None:
        b = self._text_block(self._item(ev, "message", out), ev.get("content_index", 0), out)
        self._set_citations(b, [*self._citations.get(b, ()), ev.get("annotation")], out)

    def _on_delta(self, ev: dict[str, Any], out: list[StreamEvent], arg: tuple[str, str, bool]) -> None:
        """Text, refusal, arguments or reasoning text: a delta, or (``full``) a whole ``*.done`` text."""
        what, key, full = arg
        text = ((ev.get("part") or {}).get("text") if key == "part" else ev.get(key)) or ""
        ci = ev.get("content_index", 0)
        if what == "text":
            b = self._text_block(self._item(ev, "message", out), ci, out)
            self._put(b, b, TextDelta, text, full, out)
        elif what == "refusal":
            self._put(("r", self._item(ev, "message", out).index, ci), None, RefusalDelta, text, full, out)
        elif what == "args":
            call = self._item(ev, "function_call", out).block
            if call is not None:
                self._put(call, call, ToolCallArgumentsDelta, text, full, out)
        else:
            seg = ("s", ev.get("summary_index", 0)) if what == "summary" else ("c", ci)
            self._think(self._item(ev, "reasoning", out), seg, text, full, out)

    def _on_terminal(self, ev: dict[str, Any], out: list[StreamEvent], arg: Any = None) -> None:
        resp = ev.get("response") or {}
        if ev.get("type") == "response.incomplete" and not resp.get("status"):
            resp = {**resp, "status": "incomplete"}
        self._on_start({"response": resp}, out)
        for pos, item in enumerate(resp.get("output") or ()):
            self._sync(self._index(pos, item.get("id"), prefer_id=True), item, out, True)
        usage = parse_usage(resp.get("usage"))
        if usage is not None:
            cost = cost_update(usage, self.partial.model)
            self.partial.apply(cost)
            out.append(cost)
        self._final = resp

    def _on_failed(self, ev: dict[str, Any], out: list[StreamEvent], arg: Any = None) -> None:
        resp = ev.get("response") or {}
        _raise_if_failed({**resp, "status": resp.get("status") or "failed"}, self.provider)

    # -- items ----------------------------------------------------------------------------------
    def _index(self, pos: Any, item_id: Any, prefer_id: bool = False) -> int:
        if (prefer_id or not isinstance(pos, int)) and item_id in self._by_id:
            return self._by_id[item_id]
        return pos if isinstance(pos, int) else len(self._items)

    def _item(self, ev: dict[str, Any], kind: str, out: list[StreamEvent]) -> _Item:
        """The item an event refers to, opened from the event when its ``added`` never came."""
        idx = self._index(ev.get("output_index"), ev.get("item_id"))
        return self._items.get(idx) or self._sync(idx, {"type": kind, "id": ev.get("item_id")}, out, False)

    def _start(self, ev: ContentBlockStart, out: list[StreamEvent]) -> int:
        self.partial.apply(ev)
        out.append(ev)
        return ev.index

    def _sync(self, idx: int, item: dict[str, Any], out: list[StreamEvent], done: bool) -> _Item:
        """Open the item at ``idx`` if new, fill in what ``item`` holds, and with ``done`` complete
        it (``output_item.done`` or the final payload: data and encrypted content, then close)."""
        it = self._items.get(idx)
        if it is None:
            kind, iid = item.get("type") or "message", item.get("id")
            it = self._items[idx] = _Item(idx, kind, iid, item.get("phase"))
            self._by_id.update({iid: idx} if iid else {})
            n, data = len(self.partial.blocks), {"id": iid} if iid else None
            if kind == "function_call":
                call_id = item.get("call_id") or iid or ""
                it.block = self._start(ContentBlockStart(n, "tool_use", call_id, item.get("name") or "", data), out)
                self._tools.add(it.block)
            elif kind == "reasoning":
                it.block = self._start(ContentBlockStart(n, "thinking", data=data), out)
            elif kind != "message":
                it.block = self._start(ContentBlockStart(n, "extension", data={"kind": kind, **item}), out)
        b = it.block
        if it.type == "message":
            it.phase = item.get("phase") or it.phase
            for ci, part in enumerate(item.get("content") or ()):
                self._fill_part(it, ci, part, out, close=done)
            return it
        assert b is not None
        if it.type == "function_call":
            args = item.get("arguments")
            args = orjson.dumps(args).decode() if isinstance(args, dict) else args
            self._put(b, b, ToolCallArgumentsDelta, args if isinstance(args, str) else "", True, out)
        elif it.type == "reasoning":
            for i, p in enumerate(item.get("summary") or ()):
                self._think(it, ("s", i), p.get("text") or "", True, out)
            for i, p in enumerate(item.get("content") or ()):
                if p.get("type") == "reasoning_text":
                    self._think(it, ("c", i), p.get("text") or "", True, out)
            if done:
                self._close(b, out, _reasoning_data(item))
        elif done:
            self._close(b, out, dict(item))
        if done:
            self._close(b, out)
        return it

    def _fill_part(self, it: _Item, ci: int, part: dict[str, Any], out: list[StreamEvent], close: bool) -> None:
        if part.get("type") in ("output_text", "text"):
            b = self._text_block(it, ci, out)
            self._put(b, b, TextDelta, part.get("text") or "", True, out)
            notes = part.get("annotations")
            if isinstance(notes, list) and (notes or b in self._citations):
                self._set_citations(b, notes, out)
            if close:
                self._close(b, out)
        elif part.get("type") == "refusal":
            self._put(("r", it.index, ci), None, RefusalDelta, part.get("refusal") or "", True, out)

    def _text_block(self, it: _Item, ci: int, out: list[StreamEvent]) -> int:
        b = it.parts.get(ci)
        if b is None:
            b = it.parts[ci] = self._start(ContentBlockStart(len(self.partial.blocks), "text"), out)
            self._texts[b] = it
        return b

    # -- deltas ---------------------------------------------------------------------------------
    def _put(self, key: Any, b: int | None, cls: Any, text: str, full: bool, out: list[StreamEvent]) -> None:
        """Emit ``text`` (a delta), or with ``full`` only what it holds beyond what arrived."""
        have = self._len.get(key, 0)
        piece = text[have:] if full else text
        if piece:
            ev = cls(piece) if b is None else cls(b, piece)
            self.partial.apply(ev)
            out.append(ev)
            self._len[key] = have + len(piece)

    def _think(self, it: _Item, seg: tuple[str, int], text: str, full: bool, out: list[StreamEvent]) -> None:
        b = it.block
        if it.type != "reasoning":
            return
        if seg not in it.segments:
            if it.segments:
                self._put(("sep", b, seg), b, ThinkingDelta, _SEP, False, out)
            it.segments.append(seg)
        self._put((b, seg), b, ThinkingDelta, text, full, out)

    def _set_citations(self, b: int, notes: list[Any], out: list[StreamEvent]) -> None:
        """A text block's annotations so far. An open block keeps them on the aggregate (so the
        ``partial`` of a cut stream has them) and its ``ContentBlockEnd`` carries them all; a closed
        block gets them in a revising ``ContentBlockEnd``."""
        self._citations[b] = list(notes)
        if b in self._closed:
            self._close(b, out)
        else:
            self.partial.set_block_data(b, citations=list(notes))

    def _close(self, b: int, out: list[StreamEvent], data: dict[str, Any] | None = None) -> None:
        """End block ``b``; ``data`` is what its item's ``*.done`` (or the final payload) says of it
        (reasoning summary and encrypted content, a server-tool item, a text's annotations).

        Everything a block's wire data adds rides in its ``ContentBlockEnd``, so folding the events
        gives the final response. When a later event revises a closed block (the final payload's
        ``encrypted_content`` differs from ``output_item.done``'s in recorded OpenAI streams), one
        more ``ContentBlockEnd`` carries only what changed."""
        if b in self._citations:
            data = {**(data or {}), "citations": list(self._citations[b])}
        if b in self._closed:
            have = self.partial.blocks[b].data or {}
            changed = {k: v for k, v in (data or {}).items() if have.get(k) != v}
            if changed:
                revised = ContentBlockEnd(b, changed)
                self.partial.apply(revised)
                out.append(revised)
            return
        self._closed.add(b)
        ends: list[StreamEvent] = [ToolCallEnd(b, self.partial.tool_block(b))] if b in self._tools else []
        for ev in ends + [ContentBlockEnd(b, data or None)]:
            self.partial.apply(ev)
            out.append(ev)

    def finish(self) -> list[StreamEvent]:
        with guard("end of stream", self.provider):
            return self._finish()

    def _finish(self) -> list[StreamEvent]:
        final = self._final
        if final is None:
            if self.partial.blocks or self.partial.refusal_parts:
                raise ProviderConnectionError("the stream ended before response.completed: the response is "
                                              "incomplete", provider=self.provider, partial=self.partial.snapshot())
            raise ProviderProtocolError("the stream ended before any output (no response.completed)",
                                        provider=self.provider)
        out: list[StreamEvent] = []
        for b in range(len(self.partial.blocks)):
            self._close(b, out)
        texts = [self._texts[b] for b in sorted(self._texts) if self._len.get(b)]
        phases = {it.id: it.phase for it in texts if it.id and it.phase}
        refusal = "".join(self.partial.refusal_parts) or None
        stop, raw_stop, mdata, extra = _finish(final, bool(self._tools), [it.id for it in texts], phases, refusal)
        self.partial.set_stop_reason(stop, raw_stop)
        self.partial.message_data = mdata
        self.partial.extra.update(extra)
        out.append(MessageComplete(self.partial.finalize()))
        return out


_HANDLERS: dict[str, tuple[str, Any]] = {
    "response.created": ("_on_start", None),
    "response.in_progress": ("_on_start", None),
    "response.queued": ("_on_start", None),
    "response.output_item.added": ("_on_item", False),
    "response.output_item.done": ("_on_item", True),
    "response.content_part.added": ("_on_part", False),
    "response.content_part.done": ("_on_part", True),
    "response.output_text.annotation.added": ("_on_annotation", None),
    "response.output_text.delta": ("_on_delta", ("text", "delta", False)),
    "response.output_text.done": ("_on_delta", ("text", "text", True)),
    "response.refusal.delta": ("_on_delta", ("refusal", "delta", False)),
    "response.refusal.done": ("_on_delta", ("refusal", "refusal", True)),
    "response.function_call_arguments.delta": ("_on_delta", ("args", "delta", False)),
    "response.function_call_arguments.done": ("_on_delta", ("args", "arguments", True)),
    "response.reasoning_summary_part.added": ("_on_delta", ("summary", "part", True)),
    "response.reasoning_summary_part.done": ("_on_delta", ("summary", "part", True)),
    "response.reasoning_summary_text.delta": ("_on_delta", ("summary", "delta", False)),
    "response.reasoning_summary_text.done": ("_on_delta", ("summary", "text", True)),
    "response.reasoning_text.delta": ("_on_delta", ("content", "delta", False)),
    "response.reasoning_text.done": ("_on_delta", ("content", "text", True)),
    "response.completed": ("_on_terminal", None),
    "response.incomplete": ("_on_terminal", None),
    "response.failed": ("_on_failed", None),
}
"""Event type → (handler, its argument). Other events (``response.web_search_call.*`` progress
...) carry nothing to keep: their items arrive whole in ``response.output_item.done``."""


_ENCRYPTED = "reasoning.encrypted_content"
_REASONING_MODEL = re.compile(r"^(?:[\w.-]+/)?(?:o\d|gpt-5(?!(?:\.\d+)?-chat)|codex)", re.I)
"""OpenAI's reasoning model families (``o1``, ``o3-mini``, ``o4-mini``, ``gpt-5*`` but not
``gpt-5-chat``, ``codex-mini``), optionally behind a ``vendor/`` prefix."""


def _reasons(request: MessageRequest, body: dict[str, Any]) -> bool:
    """Whether the call is to a model that reasons: reasoning was asked for, the history holds this
    protocol's reasoning, or the model is one of OpenAI's reasoning families. Only then is
    ``reasoning.encrypted_content`` requested: other models answer 400 to it."""
    th = request.thinking
    if "reasoning" in body or (th is not None and th.enabled) or _REASONING_MODEL.match(str(body.get("model") or "")):
        return True
    return any(isinstance(b, ThinkingBlock) and b.source == SOURCE
               for m in request.messages if isinstance(m, AssistantMessage) for b in m.content)


class OpenAIResponsesProvider(HttpProvider):
    """The Responses API over aiohttp (``openai-responses`` profile; DeepSeek's ``/responses``).

    ``request.extra`` keys: ``builtin_tools`` (list of wire tool objects such as
    ``{"type": "web_search"}``, appended after the function tools), ``previous_response_id``
    (str), ``store`` (bool), ``include`` (list), the pass-through switches ``truncation``,
    ``metadata``, ``prompt_cache_key``, ``service_tier``, ``safety_identifier``,
    ``max_tool_calls``, ``top_logprobs``, and ``body`` (dict, merged last and shallowly).
    ``max_tokens`` → ``max_output_tokens`` (tokens); thinking → ``reasoning: {effort,
    summary}`` (a disabled config sends only an explicit effort); ``response_format``
    (Chat shape) → ``text.format``. ``stop`` sequences are not sent: the protocol has none.
    """

    protocol = "openai-responses"

    def endpoint(self, request: MessageRequest, stream: bool) -> str:
        return "/responses"

    def build_body(self, request: MessageRequest, stream: bool) -> dict[str, Any]:
        extra = request.extra
        wire_extra = extra["body"] if isinstance(extra.get("body"), dict) else {}
        store = request.get_extra("store", bool) if "store" in extra else wire_extra.get("store")
        role = self.profile.option("system_role", "developer")
        server_state = any(k in extra or k in wire_extra for k in ("previous_response_id", "conversation"))
        instructions, items = messages_to_input(request.messages, system_role=role, store=store,
                                                server_state=server_state, provider=self.name)
        body: dict[str, Any] = {"model": request.model or self.model, "input": items}
        if instructions is not None:
            body["instructions"] = instructions
        tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                  **({"strict": t.strict} if t.strict is not None else {})} for t in request.tools]
        tools += request.get_extra("builtin_tools", list, [])
        if tools:
            body["tools"] = tools
            tc = request.tool_choice
            if isinstance(tc, dict) and ("name" in tc or isinstance(tc.get("function"), dict)):
                tc = {"type": "function", "name": tc.get("name") or tc["function"].get("name")}
            if tc is not None:
                body["tool_choice"] = tc
            if request.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = request.parallel_tool_calls
        options = {self.profile.max_tokens_field: request.max_tokens, "temperature": request.temperature,
                   "top_p": request.top_p}
        body.update({k: v for k, v in options.items() if v is not None})
        th = request.thinking
        if th is not None and (th.effort or (th.enabled and th.summary)):
            summary = th.summary if th.enabled else None
            body["reasoning"] = {k: v for k, v in (("effort", th.effort), ("summary", summary)) if v}
        rf = response_format_of(request)  # output_schema → json_schema unless response_format is given
        if rf is not None:
            js = rf.get("json_schema")
            if rf.get("type") == "json_schema" and isinstance(js, dict):  # Chat shape → Responses shape
                rf = {"type": "json_schema", "name": js.get("name") or "response", "schema": js.get("schema") or {},
                      **{k: js[k] for k in ("strict", "description") if js.get(k) is not None}}
            body["text"] = {"format": rf}
        if "previous_response_id" in extra:
            body["previous_response_id"] = request.get_extra("previous_response_id", str)
        if "store" in extra:
            body["store"] = store
        include = list(request.get_extra("include", list)) if "include" in extra else None
        if store is False and _reasons(request, body) and _ENCRYPTED not in (include or ()):
            include = [*(include or ()), _ENCRYPTED]  # C08: stateless reasoning comes back only if asked for
        if include is not None:
            body["include"] = include
        body.update({k: extra[k] for k in _PASS_THROUGH if k in extra})
        if stream:
            body["stream"] = True
        body.update(wire_extra)
        return body

    def parse_response(self, data: dict[str, Any]) -> MessageResponse:
        return parse_output(data, self.name)

    def stream_parser(self) -> StreamParser:
        return OpenAIResponsesStreamParser(self.name)
