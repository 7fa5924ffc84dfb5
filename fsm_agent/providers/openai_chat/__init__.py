"""OpenAI Chat Completions wire protocol (also DeepSeek, Qwen, llama.cpp, vLLM, OpenRouter ... as profiles).

Reference: https://platform.openai.com/docs/api-reference/chat/create and
https://platform.openai.com/docs/api-reference/chat-streaming.

One protocol, one package, by concern (every name below is importable from here):

* :mod:`.request`: neutral messages and a request as the ``/chat/completions`` body, with each
  vendor's quirks from its profile (:func:`messages_to_wire`, :class:`ToolIdMap`, :func:`request_body`);
* :mod:`.response`: ``finish_reason``, ``usage`` and a ``chat.completion`` body decoded
  (:func:`parse_completion`), and the wire shapes the decoders check;
* :mod:`.stream`: ``chat.completion.chunk`` events into stream events, tool-call fragments
  assembled into calls (:class:`OpenAIChatStreamParser`; its docstring lists the stream rules it
  keeps, each from a public bug report);
* :mod:`.vendor`: the vendor record (C03-C05): what fsm_agent does not model is kept on the block it
  came with, under ``provider_data["openai-chat"]`` with the ``vendor`` that produced it
  (:attr:`OpenAIChatProvider.vendor`), and sent back to that vendor only: a tool call's extra keys
  (Gemini's ``extra_content``), OpenRouter's ``reasoning_details`` (on the thinking block), and the
  field reasoning text came under (``reasoning_content`` or ``reasoning``), echoed on tool-call turns;
* :mod:`.provider`: :class:`OpenAIChatProvider`, the HTTP endpoint that puts them together.
"""

from __future__ import annotations

from .provider import OpenAIChatProvider
from .request import CONTINUE, CONTINUE_AFTER_CUT, ToolIdMap, messages_to_wire, request_body, tool_call_to_wire
from .response import (CHUNK_SHAPE, COMPLETION_SHAPE, map_finish_reason, parse_choice_message, parse_completion,
                       parse_usage)
from .stream import OpenAIChatStreamParser
from .vendor import SOURCE, merge_reasoning_details, merge_vendor_fields, vendor_data

__all__ = [
    "CHUNK_SHAPE",
    "COMPLETION_SHAPE",
    "CONTINUE",
    "CONTINUE_AFTER_CUT",
    "OpenAIChatProvider",
    "OpenAIChatStreamParser",
    "SOURCE",
    "ToolIdMap",
    "map_finish_reason",
    "merge_reasoning_details",
    "merge_vendor_fields",
    "messages_to_wire",
    "parse_choice_message",
    "parse_completion",
    "parse_usage",
    "request_body",
    "tool_call_to_wire",
    "vendor_data",
]
