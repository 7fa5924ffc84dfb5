"""Constrained tool calling: tools as one JSON-Schema ``response_format``.

For models and servers without native tool calls (SmolLM2-135M under
llama.cpp emits none, even with ``tool_choice: "required"``). The request
carries a schema whose every valid instance is either

* ``{"tool": "<name>", "arguments": {...}}`` — one tool call, with that tool's
  own argument schema, or
* ``{"final_answer": "<text>"}`` — the answer; when the request declares an
  ``output_schema``, ``{"final_answer": <a value of that schema>}``,

and a server that enforces ``response_format`` by grammar (llama.cpp does)
can only produce one of them. The reply is mapped back to an ordinary
:class:`~fsm_agent.types.ToolUseBlock` or :class:`~fsm_agent.types.TextBlock`,
so the rest of the runtime never knows the difference. A structured final answer
becomes a text block holding the value as JSON, the same shape a native
JSON-Schema response format gives.

The history is rewritten in the same shape: earlier tool calls become
assistant JSON, tool results become user messages that name the tool, because
chat templates of such models have no tool role.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from attrs import evolve

from ..types.content import TextBlock, ThinkingBlock, ToolUseBlock
from ..types.messages import AssistantMessage, Message, ModelStopReason, SystemMessage, ToolResultMessage, UserMessage
from ..types.requests import MessageRequest, MessageResponse
from ..types.stream import (
    ContentBlockEnd,
    ContentBlockStart,
    MessageComplete,
    MessageStart,
    StreamEvent,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    CostUpdate,
)

__all__ = ["ConstrainedStream", "constrain_request", "interpret_response", "tool_call_schema"]

SCHEMA_NAME = "tool_call_or_final_answer"


def tool_call_schema(request: MessageRequest) -> dict[str, Any]:
    """The JSON Schema that admits exactly one tool call or a final answer."""
    options: list[dict[str, Any]] = []
    if request.tool_choice != "required":
        answer = request.output_schema.schema if request.output_schema is not None else {"type": "string"}
        options.append({
            "type": "object",
            "properties": {"final_answer": answer},
            "required": ["final_answer"],
            "additionalProperties": False,
        })
    for t in request.tools:
        params = t.parameters or {"type": "object", "properties": {}}
        options.append({
            "type": "object",
            "properties": {"tool": {"type": "string", "enum": [t.name]}, "arguments": params},
            "required": ["tool", "arguments"],
            "additionalProperties": False,
        })
    return options[0] if len(options) == 1 else {"anyOf": options}


def _instructions(request: MessageRequest) -> str:
    schema = request.output_schema
    answer = '{"final_answer": <your answer as JSON matching the answer schema>}' if schema else \
        '{"final_answer": "<your answer>"}'
    lines = [
        "You can use tools. Answer with exactly one JSON object:",
        '- to call a tool: {"tool": "<tool name>", "arguments": {<arguments>}}',
        f"- when you can answer the user: {answer}",
    ]
    if schema is not None:
        lines.append(f"Answer schema ({schema.name}{': ' + schema.description if schema.description else ''}): "
                     + orjson.dumps(schema.schema).decode())
    lines.append("Available tools:")
    for t in request.tools:
        props = (t.parameters or {}).get("properties") or {}
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
        lines.append(f"- {t.name}({args}): {t.description}".rstrip())
    lines.append("After a tool result, give the final answer unless another tool call is needed.")
    return "\n".join(lines)


def _answer_value(text: str, structured: bool) -> Any:
    if structured:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return text


def _rewrite(messages: tuple[Message, ...], structured: bool = False) -> list[Message]:
    names: dict[str, str] = {}
    out: list[Message] = []
    for m in messages:
        if isinstance(m, AssistantMessage):
            calls = m.tool_calls
            if calls:
                parts = []
                for c in calls:
                    names[c.id] = c.name
                    parts.append(orjson.dumps({"tool": c.name, "arguments": c.input}).decode())
                out.append(AssistantMessage("\n".join(parts)))
            elif m.text.strip():
                value = _answer_value(m.text, structured)
                out.append(AssistantMessage(orjson.dumps({"final_answer": value}).decode()))
        elif isinstance(m, ToolResultMessage):
            name = m.name or names.get(m.tool_call_id, "tool")
            status = "failed" if m.is_error else "returned"
            out.append(UserMessage(
                f"Tool {name} {status}: {m.text}\n"
                'If this answers the question, reply with {"final_answer": "..."} now; '
                "do not repeat the same tool call."
            ))
        else:
            out.append(m)
    return out


def constrain_request(request: MessageRequest) -> MessageRequest:
    """The request with tools moved into instructions and a ``response_format`` schema."""
    messages = _rewrite(request.messages, request.output_schema is not None)
    instructions = _instructions(request)
    if messages and isinstance(messages[0], SystemMessage):
        messages[0] = SystemMessage(messages[0].text + "\n\n" + instructions)
    else:
        messages.insert(0, SystemMessage(instructions))
    return evolve(
        request,
        messages=tuple(messages),
        tools=(),
        tool_choice=None,
        parallel_tool_calls=None,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": SCHEMA_NAME, "strict": True, "schema": tool_call_schema(request)},
        },
    )


def interpret_response(response: MessageResponse, request: MessageRequest) -> MessageResponse:
    """Map the JSON reply back to a tool-use or text block.

    A reply cut by the output limit (``max_tokens``) while it wrote a tool call becomes a cut call,
    as every native protocol reports one: a tool-use block whose arguments are incomplete
    (``raw_input``), stop reason still ``max_tokens``, so the runtime never runs it and asks again
    with a larger limit. Any other reply that is not one of the two shapes (a server that ignored
    the schema, an answer cut by ``max_tokens``) is kept as text, so the run still ends with a
    clear answer or stop reason instead of a crash.
    """
    text = response.text.strip()
    thinking = [b for b in response.message.content if isinstance(b, ThinkingBlock)]
    try:
        value = orjson.loads(text) if text else None
    except orjson.JSONDecodeError:
        value = None
    if value is None and response.stop_reason is ModelStopReason.MAX_TOKENS and _CALL_START.match(text):
        name = _CALL_NAME.search(text)
        args = _CALL_ARGS.search(text)
        cut = ToolUseBlock(f"call_{uuid.uuid4().hex[:12]}", name.group(1) if name else "", {},
                           text[args.end():] if args else "", {"constrained": True})
        return evolve(response, message=AssistantMessage((*thinking, cut)))
    known = {t.name for t in request.tools}
    if isinstance(value, dict) and isinstance(value.get("tool"), str) and value["tool"] in known:
        args = value.get("arguments")
        call = ToolUseBlock(
            f"call_{uuid.uuid4().hex[:12]}",
            value["tool"],
            args if isinstance(args, dict) else {},
            None if isinstance(args, dict) else orjson.dumps(args).decode(),
            {"constrained": True},
        )
        return evolve(response, message=AssistantMessage((*thinking, call)), stop_reason=ModelStopReason.TOOL_USE)
    if request.output_schema is not None and isinstance(value, dict) and "final_answer" in value:
        answer = orjson.dumps(value["final_answer"]).decode()  # the value as JSON text, as a native format gives
    elif isinstance(value, dict) and isinstance(value.get("final_answer"), str):
        answer = value["final_answer"]
    else:
        return response
    return evolve(
        response,
        message=AssistantMessage((*thinking, TextBlock(answer))),
        stop_reason=ModelStopReason.END_TURN if response.stop_reason is ModelStopReason.TOOL_USE else response.stop_reason,
    )


_ANSWER_START = re.compile(r'^\s*\{\s*"final_answer"\s*:\s*"')
_CALL_START = re.compile(r'^\{\s*"(?:tool|arguments)"\s*:')
"""A reply that began as a tool call (the schema admits a call or a final answer, nothing else)."""
_CALL_NAME = re.compile(r'"tool"\s*:\s*"((?:[^"\\]|\\.)*)')
_CALL_ARGS = re.compile(r'"arguments"\s*:\s*')


class ConstrainedStream:
    """Re-shapes a constrained-mode stream: the JSON text is hidden, the final answer is
    streamed as text as it arrives, and a tool call appears as tool-use events at the end."""

    def __init__(self, request: MessageRequest) -> None:
        self.request = request
        self._buf: list[str] = []
        self._emitted = 0  # characters of the decoded answer already emitted
        self._answer = False
        self._text_open = False
        self._live = request.output_schema is None  # a structured answer is emitted whole, as JSON text

    def _answer_delta(self) -> str:
        if not self._live:
            return ""
        raw = "".join(self._buf)
        m = _ANSWER_START.match(raw)
        if not m:
            return ""
        body = raw[m.end():]
        # take the longest prefix that is complete JSON string content
        out: list[str] = []
        i = 0
        n = len(body)
        while i < n:
            ch = body[i]
            if ch == '"':
                break
            if ch == "\\":
                if i + 1 >= n:
                    break
                if body[i + 1] == "u":
                    if i + 6 > n:
                        break
                    seq = body[i:i + 6]
                    # a surrogate pair needs the second half before decoding
                    if 0xD800 <= int(seq[2:], 16) <= 0xDBFF:
                        if i + 12 > n:
                            break
                        seq = body[i:i + 12]
                    try:
                        out.append(orjson.loads(f'"{seq}"'))
                    except orjson.JSONDecodeError:
                        break
                    i += len(seq)
                    continue
                try:
                    out.append(orjson.loads(f'"{body[i:i + 2]}"'))
                except orjson.JSONDecodeError:
                    break
                i += 2
                continue
            out.append(ch)
            i += 1
        decoded = "".join(out)
        new = decoded[self._emitted:]
        self._emitted = len(decoded)
        return new

    async def wrap(self, events: AsyncIterator[StreamEvent]) -> AsyncIterator[StreamEvent]:
        async for ev in events:
            if isinstance(ev, TextDelta):
                self._buf.append(ev.text)
                delta = self._answer_delta()
                if delta:
                    if not self._text_open:
                        self._text_open = True
                        yield ContentBlockStart(0, "text")
                    yield TextDelta(0, delta)
            elif isinstance(ev, (MessageStart, CostUpdate)):
                yield ev
            elif isinstance(ev, MessageComplete):
                final = interpret_response(ev.full_response, self.request)
                if self._text_open:
                    yield ContentBlockEnd(0)
                for i, block in enumerate(final.message.content):
                    if isinstance(block, ToolUseBlock):
                        yield ContentBlockStart(i, "tool_use", block.id, block.name)
                        yield ToolCallArgumentsDelta(i, orjson.dumps(block.input).decode())
                        yield ToolCallEnd(i, block)
                        yield ContentBlockEnd(i)
                    elif isinstance(block, TextBlock) and not self._text_open:
                        yield ContentBlockStart(i, "text")
                        yield TextDelta(i, block.text)
                        yield ContentBlockEnd(i)
                yield MessageComplete(final)
            # other block events of the raw JSON text are not meaningful to consumers
