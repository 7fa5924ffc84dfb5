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
* ``{"error": ...}`` inside a 200 stream is an error, never a success (B20, llama.cpp);
* a fragment without ``index`` that carries the ``id`` of an earlier call continues that call; one
  with neither (``index: null`` and no ``id``: Qwen, local servers) continues the one call whose
  arguments are still open (not yet a complete JSON value); a call whose arguments are complete is
  never appended to, and argument text that no call can take unambiguously (several calls open, or
  none) ends the calls concerned with ``provider_data["arguments_error"]``: they are answered with
  an error result, never run with arguments that may be wrong (:meth:`OpenAIChatStreamParser._tool_fragment`);
* the calls in the message decide the stop reason: ``tool_calls`` with no call is ``end_turn`` (C01),
  ``stop`` (Ollama) or a trailing second ``stop`` after ``tool_calls`` with calls is ``tool_use`` (C02).

Vendor fields (C03-C05): what fsm_agent does not model is kept on the block it came with, under
``provider_data["openai-chat"]`` with the ``vendor`` that produced it (:attr:`OpenAIChatProvider.vendor`),
and sent back to that vendor only: a tool call's extra keys (Gemini's ``extra_content``), OpenRouter's
``reasoning_details`` (on the thinking block), and the field reasoning text came under
(``reasoning_content`` or ``reasoning``), echoed on tool-call turns.
"""

from __future__ import annotations

import hashlib
import re
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
from ..types.pairing import missing_result, normalize_pairing
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
from .costs import cost_update
from .errors import error_from_payload
from .sse import ServerSentEvent
from .structured_output import response_format_of
from .wire import (ARRAY, COUNT, INT, OBJECT, STR, STRAY, Shape, check, guard, list_of, obj, one_of, orphan_error,
                   stray_error)

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


_TOOL_CALL_KEYS = frozenset({"index", "id", "type", "function"})
"""Keys of a ``tool_calls`` entry the protocol defines; any other key is a vendor field (Gemini's
``extra_content``), kept on the block and sent back only to the vendor it came from."""

CONTINUE_AFTER_CUT = "Your previous answer was cut off before it finished; continue from where it stopped."
"""The user turn that follows an interrupted answer at the end of a request (the driver's wording)."""
CONTINUE = "Continue."


def vendor_data(block: Any) -> dict[str, Any]:
    """This protocol's vendor record on a block (``provider_data["openai-chat"]``), or ``{}``.

    ``vendor`` names the endpoint that produced the block (:attr:`OpenAIChatProvider.vendor`); the
    other keys are wire fields fsm_agent does not model: ``fields`` (extra keys of a tool call),
    ``field`` (the name reasoning text came under), ``reasoning_details`` (OpenRouter)."""
    pd = getattr(block, "provider_data", None)
    data = pd.get(SOURCE) if isinstance(pd, dict) else None
    return data if isinstance(data, dict) else {}


def merge_vendor_fields(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Fold the vendor fields of a later stream fragment into those of earlier ones: objects merge
    key by key, arrays extend, anything else replaces; ``null`` adds nothing."""
    out = dict(old)
    for k, v in new.items():
        if v is None:
            continue
        cur = out.get(k)
        if isinstance(cur, dict) and isinstance(v, dict):
            out[k] = merge_vendor_fields(cur, v)
        elif isinstance(cur, list) and isinstance(v, list):
            out[k] = cur + v
        else:
            out[k] = v
    return out


def merge_reasoning_details(entries: list[Any], new: Any) -> list[Any]:
    """OpenRouter's ``reasoning_details`` of one more chunk folded into ``entries``.

    A stream sends an entry in pieces that share its ``index`` and ``type`` (``reasoning.text``
    text a few tokens at a time): their ``text``/``summary``/``data`` strings are joined and other
    keys kept from the first piece (a later value fills a missing one). Entries without an index,
    or with a new one, are appended unchanged, so a non-streamed array comes back as received."""
    out = list(entries)
    for e in new if isinstance(new, list) else ():
        if not isinstance(e, dict):
            continue
        idx = e.get("index")
        at = None
        if isinstance(idx, int):
            at = next((j for j in range(len(out) - 1, -1, -1)
                       if isinstance(out[j], dict) and out[j].get("index") == idx), None)
        if at is None or out[at].get("type") != e.get("type"):
            out.append(dict(e))
            continue
        merged = dict(out[at])
        for k, v in e.items():
            if k in ("text", "summary", "data") and isinstance(v, str) and isinstance(merged.get(k), str):
                merged[k] = merged[k] + v
            elif merged.get(k) is None:
                merged[k] = v
        out[at] = merged
    return out


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_B62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


class ToolIdMap:
    """Call ids as a vendor requires them, the same for a call and its result.

    ``mistral``: exactly 9 characters from ``[A-Za-z0-9]`` (Mistral answers 400 "Tool call id was
    ... but must be a-z, A-Z, 0-9, with a length of 9" otherwise). An id already in that form is
    kept; any other becomes 9 base-62 characters hashed from it, so the same history maps to the
    same ids on every request; two ids that would map alike get distinct ones. ``None``: unchanged.
    """

    def __init__(self, style: str | None) -> None:
        self.style = style
        self._map: dict[str, str] = {}
        self._used: dict[str, str] = {}

    def __call__(self, call_id: str) -> str:
        if self.style != "mistral":
            return call_id
        got = self._map.get(call_id)
        if got is not None:
            return got
        n = 0
        cand = call_id if _MISTRAL_ID.fullmatch(call_id) else self._hash(call_id, n)
        while cand in self._used and self._used[cand] != call_id:
            n += 1
            cand = self._hash(call_id, n)
        self._map[call_id] = cand
        self._used[cand] = call_id
        return cand

    def reserve(self, call_id: str) -> None:
        """Claim an id already in the vendor's form first, so that no hashed id takes it."""
        if self.style == "mistral" and _MISTRAL_ID.fullmatch(call_id) and call_id not in self._used:
            self._map[call_id] = call_id
            self._used[call_id] = call_id

    @staticmethod
    def _hash(call_id: str, n: int) -> str:
        num = int.from_bytes(hashlib.sha256(f"{call_id}#{n}".encode()).digest()[:12], "big")
        chars = []
        for _ in range(9):
            num, r = divmod(num, 62)
            chars.append(_B62[r])
        return "".join(chars)


def tool_call_to_wire(call: ToolUseBlock, *, vendor: str | None = None,
                      ids: ToolIdMap | None = None) -> dict[str, Any]:
    """A tool-use block as an OpenAI ``tool_calls`` entry; arguments always a JSON string (B11: ``"{}"``).

    Vendor fields kept on the block (Gemini's ``extra_content.google.thought_signature``, C03) are
    sent back when ``vendor`` is the endpoint that produced them, and never to another one."""
    args = call.raw_input if call.raw_input is not None else orjson.dumps(call.input).decode()
    out: dict[str, Any] = {"id": ids(call.id) if ids else call.id, "type": "function",
                           "function": {"name": call.name, "arguments": args}}
    vd = vendor_data(call)
    fields = vd.get("fields")
    if vendor is not None and vd.get("vendor") == vendor and isinstance(fields, dict):
        for k, v in fields.items():
            if k not in _TOOL_CALL_KEYS:
                out[k] = v
    return out


def _reasoning_fields(m: AssistantMessage, *, has_calls: bool, vendor: str | None,
                      reasoning_field: str | None, echo_reasoning: bool) -> dict[str, Any]:
    """The reasoning wire fields of one assistant turn.

    A thinking block this protocol decoded records the endpoint it came from and the field name;
    to that same endpoint its text goes back under that field on every tool-call turn (Kimi,
    DeepSeek, vLLM templates read it there: C05, B06), and on other turns when the profile echoes
    reasoning; its OpenRouter ``reasoning_details`` go back unchanged (C04). To any other endpoint
    nothing of it is sent. A block with no such record (older sessions, hand-built histories) goes
    back under the profile's ``reasoning_field`` when the profile echoes reasoning (B06)."""
    texts: dict[str, list[str]] = {}
    details: list[Any] = []
    for b in m.content:
        if not isinstance(b, ThinkingBlock) or b.source not in (None, SOURCE):
            continue
        vd = vendor_data(b)
        if vd.get("vendor") is not None:
            if vendor is None or vd["vendor"] != vendor:
                continue  # another vendor's reasoning: never sent here
            if isinstance(vd.get("reasoning_details"), list):
                details += vd["reasoning_details"]
            name = vd.get("field")
            if b.thinking and isinstance(name, str) and (has_calls or echo_reasoning):
                texts.setdefault(name, []).append(b.thinking)
        elif reasoning_field and echo_reasoning and b.thinking:
            texts.setdefault(reasoning_field, []).append(b.thinking)
    out: dict[str, Any] = {}
    if details:
        out["reasoning_details"] = details  # it holds the text too: no second copy under "reasoning"
        texts.pop("reasoning", None)
    for name, parts in texts.items():
        text = "".join(parts)
        if text:
            out[name] = text
    return out


def messages_to_wire(messages: tuple[Message, ...] | list[Message], *, system_role: str = "system",
                     reasoning_field: str | None = None, echo_reasoning: bool = False,
                     vendor: str | None = None, tool_ids: str | None = None,
                     foreign_call_signature: str | None = None,
                     provider: str = "openai") -> list[dict[str, Any]]:
    """Neutral messages as Chat Completions ``messages``.

    * The history is first put in the shape the protocol accepts
      (:func:`~fsm_agent.types.normalize_pairing`): a call given twice (twice in one turn, or repeated
      in a later turn before or without a result of its own: same id, name and arguments) is sent
      once, with one result, and a second result for an answered call is dropped (the same id reused
      for a call with a result of its own is a new call); the ``tool`` messages come right after the
      ``tool_calls`` message, in call order, and a system, user or assistant message that sat
      between a call and its result comes after them; a call with no result is answered with an
      error result saying none was recorded (:data:`~fsm_agent.types.MISSING_RESULT`), as the other
      protocols do.
    * Calls of one step split over several assistant messages go as one ``tool_calls`` message.
    * Assistant turns with tool calls and no text send ``content: null`` (B04); whitespace-only
      assistant turns without tool calls are dropped (B04).
    * Reasoning and vendor fields go back only to the endpoint ``vendor`` that produced them
      (:func:`_reasoning_fields`, :func:`tool_call_to_wire`).
    * ``tool_ids="mistral"``: ids in Mistral's form, the same for each call and its result.
    * ``foreign_call_signature`` (Gemini): the first call of a turn that another vendor made (or one
      with no record) carries this documented placeholder signature, as Gemini requires a signature
      there; calls Gemini made itself go back exactly as they came.
    * A request never ends in an assistant turn without calls, which servers read as a prefill (or
      refuse): a user turn asking to continue follows it. Message ``provider_data`` (the driver's
      ``interrupted`` marker) is never sent.

    Raises:
        InvalidHistoryError: a tool result answers no earlier call (an orphan: the protocol refuses
            it, and dropping it would lose what it says). The message names it and what to do.
    """
    normal, orphans = normalize_pairing(messages, fill=missing_result)
    if orphans:
        raise orphan_error(normal, orphans, provider)
    ids = ToolIdMap(tool_ids)
    for m in normal:
        if type(m) is AssistantMessage:
            for c in m.tool_calls:
                ids.reserve(c.id)
    out: list[dict[str, Any]] = []
    last_cut = False
    n = len(normal)
    i = 0
    while i < n:
        m = normal[i]
        i += 1
        if isinstance(m, SystemMessage):
            out.append({"role": system_role, "content": m.text})
        elif isinstance(m, UserMessage):
            out.append({"role": "user", "content": _user_parts(m.content)})
        elif isinstance(m, UserImageMessage):
            out.append({"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _data_url(m.data, m.mime_type), "detail": m.detail}}]})
        elif isinstance(m, AssistantMessage):
            if m.tool_calls:  # the step's later messages (calls split over several): one message
                while i < n and isinstance(nxt := normal[i], AssistantMessage) and nxt.tool_calls:
                    m = AssistantMessage(m.content + nxt.content, m.provider_data)
                    i += 1
            sent = m.tool_calls
            calls = [tool_call_to_wire(c, vendor=vendor, ids=ids) for c in sent]
            if (calls and foreign_call_signature and vendor_data(sent[0]).get("vendor") != vendor
                    and "extra_content" not in calls[0]):
                calls[0]["extra_content"] = {"google": {"thought_signature": foreign_call_signature}}
            text = m.text
            if not calls and not text.strip():
                continue
            msg: dict[str, Any] = {"role": "assistant", "content": text if text.strip() else None}
            if calls:
                msg["tool_calls"] = calls
            msg.update(_reasoning_fields(m, has_calls=bool(calls), vendor=vendor, reasoning_field=reasoning_field,
                                         echo_reasoning=echo_reasoning))
            out.append(msg)
            last_cut = bool((m.provider_data or {}).get("interrupted"))
        elif isinstance(m, ToolResultMessage):
            out.append({"role": "tool", "tool_call_id": ids(m.tool_call_id), "content": m.text})
    if out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
        out.append({"role": "user", "content": CONTINUE_AFTER_CUT if last_cut else CONTINUE})
    return out


# ---------------------------------------------------------------------------- wire shapes
# What the parsers below read, by type (fsm_agent.providers.wire): a frame that differs raises a
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
"""A ``chat.completion.chunk``, as the stream parser reads it."""
_PART = obj(type=STR, text=STR)
COMPLETION_SHAPE = obj(
    id=STR, model=STR, usage=_USAGE,
    choices=list_of(obj(index=INT, finish_reason=STR, message=obj(content=one_of(STR, list_of(_PART)), **_REASONING))),
)
"""A ``chat.completion`` body, as :func:`parse_completion` reads it."""


# ---------------------------------------------------------------------------- response
def _thinking_data(vendor: str | None, field_name: str | None,
                   details: list[Any] | None = None) -> dict[str, Any] | None:
    rec: dict[str, Any] = {}
    if vendor is not None:
        rec["vendor"] = vendor
    if field_name is not None:
        rec["field"] = field_name
    if details:
        rec["reasoning_details"] = details
    return {SOURCE: rec} if rec else None


def _tool_vendor_fields(tc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in tc.items() if k not in _TOOL_CALL_KEYS and v is not None}


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
            blocks.append(ThinkingBlock(r, source=SOURCE, provider_data=_thinking_data(vendor, key, details)))
            break
    else:
        if details:
            blocks.append(ThinkingBlock("", source=SOURCE, provider_data=_thinking_data(vendor, None, details)))
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
        fields = _tool_vendor_fields(tc)
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
                                                                    data=_thinking_data(self.vendor, key)))
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
                                                                        data=_thinking_data(self.vendor, None)))
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
        fields = _tool_vendor_fields(tc)
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
        ev = ContentBlockEnd(c.rd_block, _thinking_data(self.vendor, c.rd_field, c.rd))
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

    @property
    def vendor(self) -> str:
        """The endpoint this provider talks to, as recorded on what it decodes: the profile name, plus
        ``@host[:port]`` when the base URL is not the profile's own (any ``openai-compatible`` or
        local server). Reasoning and vendor fields are sent back only to the same vendor."""
        from urllib.parse import urlsplit

        host = urlsplit(self.base_url).netloc
        own = urlsplit(self.profile.base_url).netloc if self.profile.base_url else None
        return self.profile.name if host == own else f"{self.profile.name}@{host}"

    def endpoint(self, request: MessageRequest, stream: bool) -> str:
        return "/chat/completions"

    def build_body(self, request: MessageRequest, stream: bool) -> dict[str, Any]:
        prof = self.wire_profile(request.model or self.model)
        body: dict[str, Any] = {
            "model": request.model or self.model,
            "messages": messages_to_wire(
                request.messages,
                system_role=prof.option("system_role", "system"),
                reasoning_field=prof.reasoning_field,
                echo_reasoning=prof.echo_reasoning,
                vendor=self.vendor,
                tool_ids=prof.option("tool_ids"),
                foreign_call_signature=prof.option("foreign_call_signature"),
                provider=self.name,
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
        param = prof.option("thinking_param")
        if request.thinking is not None:
            th = request.thinking
            if param == "enable_thinking":  # Qwen / DashScope
                body["enable_thinking"] = th.enabled
                if th.budget_tokens:
                    body["thinking_budget"] = th.budget_tokens
            elif param == "thinking":  # DeepSeek V3.1+, Kimi K2.5+
                body["thinking"] = {"type": "enabled" if th.enabled else "disabled"}
            elif param == "reasoning":  # OpenRouter's unified reasoning object: effort or max_tokens, not both
                if not th.enabled:
                    body["reasoning"] = {"enabled": False}
                elif th.effort:
                    body["reasoning"] = {"effort": th.effort}
                elif th.budget_tokens:
                    body["reasoning"] = {"max_tokens": th.budget_tokens}
                else:
                    body["reasoning"] = {"enabled": True}
            elif param == "chat_template_kwargs":  # vLLM / SGLang: the model's chat template switches it
                body["chat_template_kwargs"] = {"enable_thinking": th.enabled, "thinking": th.enabled}
                if th.effort:
                    body["reasoning_effort"] = th.effort
            elif th.effort:
                body["reasoning_effort"] = th.effort
        if stream:
            body["stream"] = True
            if prof.stream_usage:
                body["stream_options"] = {"include_usage": True}
        elif prof.option("thinking_streamed_only"):
            # DashScope (C09): open-source Qwen3 models think by default, and thinking is allowed only on
            # streamed calls ("parameter.enable_thinking must be set to false for non-streaming calls").
            if request.thinking is not None and request.thinking.enabled:
                body["stream"] = True  # thinking asked for: stream it; chat() reads the event stream whole
                if prof.stream_usage:
                    body["stream_options"] = {"include_usage": True}
            else:
                body["enable_thinking"] = False
        wire_extra = request.extra.get("body")
        if isinstance(wire_extra, dict):
            body.update(wire_extra)
        return body

    def parse_response(self, data: dict[str, Any]) -> MessageResponse:
        return parse_completion(data, self.name, self.vendor)

    def stream_parser(self) -> StreamParser:
        return OpenAIChatStreamParser(self.name, self.vendor)

