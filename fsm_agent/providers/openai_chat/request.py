"""Request mapping of the Chat Completions protocol: neutral messages and a :class:`MessageRequest` as
the ``/chat/completions`` body, with each vendor's quirks taken from its profile.

* :func:`messages_to_wire`: the history in the shape the protocol accepts (pairing, B04's empty
  turns, reasoning and vendor fields sent back only to the vendor that produced them, Mistral's
  call ids through :class:`ToolIdMap`, Gemini's placeholder signature, no trailing prefill);
* :func:`request_body`: the whole body: tools and tool choice, ``max_tokens`` or
  ``max_completion_tokens``, sampling, ``response_format``, each vendor's thinking switch, stream
  options, DashScope's streamed-only thinking (C09), and ``extra["body"]`` over all of it.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import orjson

from ...types.content import AudioBlock, FileBlock, ImageBlock, TextBlock, ThinkingBlock, ToolUseBlock
from ...types.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolResultMessage,
    UserImageMessage,
    UserMessage,
)
from ...types.pairing import missing_result, normalize_pairing
from ...types.requests import MessageRequest
from ..base import Profile
from ..structured_output import response_format_of
from ..wire import orphan_error
from .vendor import SOURCE, TOOL_CALL_KEYS, vendor_data

__all__ = ["CONTINUE", "CONTINUE_AFTER_CUT", "ToolIdMap", "messages_to_wire", "request_body", "tool_call_to_wire"]

CONTINUE_AFTER_CUT = "Your previous answer was cut off before it finished; continue from where it stopped."
"""The user turn that follows an interrupted answer at the end of a request (the driver's wording)."""
CONTINUE = "Continue."


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
            if k not in TOOL_CALL_KEYS:
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


def request_body(request: MessageRequest, prof: Profile, *, model: str | None, vendor: str | None,
                 provider: str, stream: bool) -> dict[str, Any]:
    """The ``/chat/completions`` body of ``request`` for ``model`` under the wire rules of ``prof`` (the
    profile with the model's rules applied): the messages (:func:`messages_to_wire`, sent back to
    ``vendor`` only what it produced), tools, limits, ``response_format``, the profile's thinking
    switch (``thinking_param``: ``enable_thinking``, ``thinking``, ``reasoning``,
    ``chat_template_kwargs``, else ``reasoning_effort``) and stream options; ``request.extra["body"]``
    is merged over the result.

    Raises:
        InvalidHistoryError: a tool result answers no earlier call (:func:`messages_to_wire`).
    """
    body: dict[str, Any] = {
        "model": model,
        "messages": messages_to_wire(
            request.messages,
            system_role=prof.option("system_role", "system"),
            reasoning_field=prof.reasoning_field,
            echo_reasoning=prof.echo_reasoning,
            vendor=vendor,
            tool_ids=prof.option("tool_ids"),
            foreign_call_signature=prof.option("foreign_call_signature"),
            provider=provider,
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
