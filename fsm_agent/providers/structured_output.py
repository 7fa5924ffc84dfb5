"""How a request's ``output_schema`` reaches servers without a native JSON-Schema answer format.

Where the server has one (``ProviderCapabilities.structured_output``), each protocol's
``build_body`` sends the schema itself: Chat ``response_format: {"type": "json_schema",
"json_schema": {name, schema, strict}}``, Responses ``text: {"format": {"type": "json_schema",
name, schema, strict}}``, Anthropic ``output_config: {"format": {"type": "json_schema", schema}}``.
With the constrained tool mode and tools, the schema becomes the ``final_answer`` branch of the
constrained union (:mod:`fsm_agent.providers.constrained`). Otherwise:

* **JSON mode** (OpenAI Chat and Responses protocols; DeepSeek): ``{"type": "json_object"}`` plus
  the schema in the system prompt (:func:`json_object_request`). The server guarantees JSON, not
  the schema; the answer is checked by :func:`fsm_agent.structured.parse_output`.
* **Answer tool** (Anthropic models without ``output_config``): the schema becomes a tool the model
  must call (:func:`answer_tool_request`), and the call is mapped back to a text answer holding its
  input as JSON (:func:`interpret_answer_tool`, :class:`AnswerToolStream`), so callers see the same
  shape as with a native format.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from attrs import evolve

from ..errors import ConfigurationError
from ..types.content import TextBlock, ToolUseBlock
from ..types.messages import AssistantMessage, Message, ModelStopReason, SystemMessage
from ..types.requests import MessageRequest, MessageResponse, ToolDefinition
from ..types.stream import CostUpdate, MessageComplete, MessageStart, StreamEvent
from ..types.structured import OutputSchema
from .costs import events_for

__all__ = [
    "AnswerToolStream",
    "answer_tool_request",
    "interpret_answer_tool",
    "json_object_request",
    "response_format_of",
    "schema_instructions",
]


def response_format_of(request: MessageRequest) -> dict[str, Any] | None:
    """The Chat-shaped answer format a protocol sends: ``request.response_format`` when given, else
    the ``output_schema`` as ``json_schema``, else ``None``."""
    if request.response_format is not None:
        return request.response_format
    if request.output_schema is not None:
        return request.output_schema.response_format()
    return None


def schema_instructions(schema: OutputSchema) -> str:
    """The system-prompt text that asks for one JSON value matching ``schema``."""
    lines = ["Answer with one JSON value and nothing else (no prose, no code fences). It must match this "
             f"JSON Schema, named {schema.name!r}:"]
    if schema.description:
        lines.append(schema.description)
    lines.append(orjson.dumps(schema.schema).decode())
    return "\n".join(lines)


def _with_system(messages: tuple[Message, ...], text: str) -> tuple[Message, ...]:
    out = list(messages)
    if out and isinstance(out[0], SystemMessage):
        out[0] = SystemMessage(out[0].text + "\n\n" + text)
    else:
        out.insert(0, SystemMessage(text))
    return tuple(out)


def json_object_request(request: MessageRequest) -> MessageRequest:
    """JSON mode: ``response_format`` ``json_object`` and the schema in the system prompt.

    The prompt names JSON, as DeepSeek and DashScope require for ``json_object``.
    """
    schema = request.output_schema
    assert schema is not None
    return evolve(request, messages=_with_system(request.messages, schema_instructions(schema)),
                  response_format={"type": "json_object"}, output_schema=None)


def answer_tool_request(request: MessageRequest) -> MessageRequest:
    """The schema as a tool named ``schema.name`` whose input is the answer.

    ``tool_choice``: the answer tool alone is forced (``{"name": ...}``); with other tools the
    model must call one of them or the answer tool (``required``); a specific tool choice is
    kept. With thinking enabled the choice stays ``auto`` (Anthropic refuses a forced tool
    with thinking), and the system prompt asks for the tool.

    Raises:
        ConfigurationError: a tool of the request already has the schema's name.
    """
    schema = request.output_schema
    assert schema is not None
    if any(t.name == schema.name for t in request.tools):
        raise ConfigurationError(f"output schema name {schema.name!r} is also the name of a tool: rename one")
    tool = ToolDefinition(schema.name, schema.description or "Give your final answer: the input is the answer.",
                          schema.schema)
    choice: str | dict[str, Any] | None
    thinking = request.thinking is not None and request.thinking.enabled
    if thinking:
        choice = "auto"
    elif isinstance(request.tool_choice, dict):
        choice = request.tool_choice
    elif request.tools and request.tool_choice != "none":
        choice = "required"
    else:
        choice = {"name": schema.name}
    note = f"Give your final answer by calling the tool {schema.name!r}; its input is the answer."
    return evolve(request, messages=_with_system(request.messages, note), tools=(*request.tools, tool),
                  tool_choice=choice, output_schema=None)


def interpret_answer_tool(response: MessageResponse, schema: OutputSchema) -> MessageResponse:
    """A call of the answer tool as a text answer holding its input as JSON.

    Text the model wrote before the call moves to ``extra["answer_preamble"]`` so that the text is
    exactly the answer. Without an answer-tool call the response is returned unchanged.
    """
    blocks = response.message.content
    answer = next((b for b in blocks if isinstance(b, ToolUseBlock) and b.name == schema.name), None)
    if answer is None:
        return response
    text = answer.raw_input if answer.raw_input is not None else orjson.dumps(answer.input).decode()
    kept: list[Any] = []
    preamble: list[str] = []
    for b in blocks:
        if b is answer:
            kept.append(TextBlock(text))
        elif isinstance(b, TextBlock):
            preamble.append(b.text)
        elif not (isinstance(b, ToolUseBlock) and b.name == schema.name):
            kept.append(b)
    others = any(isinstance(b, ToolUseBlock) for b in kept)
    stop = response.stop_reason
    if not others and stop is ModelStopReason.TOOL_USE:
        stop = ModelStopReason.END_TURN
    extra = {**response.extra, "answer_preamble": "".join(preamble)} if "".join(preamble).strip() else response.extra
    return evolve(response, message=AssistantMessage(tuple(kept)), stop_reason=stop, extra=extra)


class AnswerToolStream:
    """Re-shapes a stream that may end in an answer-tool call.

    ``MessageStart`` and usage pass through at once; the content is held until the message is
    complete and then emitted as the stream of the interpreted response, so the events and
    ``MessageComplete.full_response`` agree (the answer arrives as one text block).
    """

    def __init__(self, schema: OutputSchema) -> None:
        self.schema = schema

    async def wrap(self, events: AsyncIterator[StreamEvent]) -> AsyncIterator[StreamEvent]:
        async for ev in events:
            if isinstance(ev, (MessageStart, CostUpdate)):
                yield ev
            elif isinstance(ev, MessageComplete):
                final = interpret_answer_tool(ev.full_response, self.schema)
                for out in events_for(final):
                    if not isinstance(out, (MessageStart, CostUpdate)):
                        yield out
