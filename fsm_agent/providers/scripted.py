"""ScriptedProvider: a deterministic, public test double for agents and middleware.

It answers each call with the next item of its script: a
:class:`~fsm_agent.types.MessageResponse`, a string (an end-of-turn text
answer), a :class:`~fsm_agent.errors.ProviderError` (raised), or a callable
``(request) -> item``. No I/O; the streamed form is synthesized from the same
response, so both paths agree. Requests are recorded in ``requests``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Union

from ..errors import ProviderError
from ..types.content import TextBlock, ToolUseBlock
from ..types.messages import AssistantMessage, ModelStopReason, Usage
from ..types.requests import MessageRequest, MessageResponse
from ..types.stream import StreamEvent, TextDelta
from .base import Provider, ProviderCapabilities
from .costs import events_for

__all__ = ["ScriptItem", "ScriptedProvider", "text_response", "tool_call_response"]

ScriptItem = Union[MessageResponse, str, ProviderError, Callable[[MessageRequest], Any]]

_ids = itertools.count(1)


def text_response(text: str, *, usage: Usage | None = Usage(10, 5), model: str = "scripted") -> MessageResponse:
    """An end-of-turn answer."""
    return MessageResponse(f"resp_{next(_ids)}", model, AssistantMessage((TextBlock(text),)),
                           ModelStopReason.END_TURN, "stop", usage, "scripted")


def tool_call_response(*calls: tuple[str, dict[str, Any]] | ToolUseBlock, text: str = "",
                       usage: Usage | None = Usage(10, 5), model: str = "scripted") -> MessageResponse:
    """A tool-use turn; each call is ``(name, arguments)`` or a ready :class:`ToolUseBlock`."""
    blocks: list[Any] = [TextBlock(text)] if text else []
    for c in calls:
        blocks.append(c if isinstance(c, ToolUseBlock) else ToolUseBlock(f"call_{next(_ids)}", c[0], dict(c[1])))
    return MessageResponse(f"resp_{next(_ids)}", model, AssistantMessage(tuple(blocks)),
                           ModelStopReason.TOOL_USE, "tool_calls", usage, "scripted")


class ScriptedProvider(Provider):
    """Answers calls from a script, in order.

    Args:
        script: the items to answer with, in call order.
        repeat_last: answer with the last item once the script is used up, instead of failing.
        delay: seconds to wait before each answer.
        stream_delay: seconds to wait before each streamed event.
        chunk_chars: stream text in deltas of this many characters (default: one delta per block).
        capabilities: what to report (defaults: everything on).
    """

    def __init__(self, script: Iterable[ScriptItem], *, repeat_last: bool = False, delay: float = 0.0,
                 stream_delay: float = 0.0, chunk_chars: int | None = None,
                 capabilities: ProviderCapabilities | None = None, model: str = "scripted") -> None:
        self.script = list(script)
        self.repeat_last = repeat_last
        self.delay = delay
        self.stream_delay = stream_delay
        self.chunk_chars = chunk_chars
        self._caps = capabilities or ProviderCapabilities(thinking=True, images=True)
        self.name = "scripted"
        self.model = model
        self.requests: list[MessageRequest] = []
        self._pos = 0

    @property
    def capabilities(self) -> ProviderCapabilities:
        return self._caps

    def _next(self, request: MessageRequest) -> MessageResponse:
        self.requests.append(request)
        if self._pos < len(self.script):
            item = self.script[self._pos]
            self._pos += 1
        elif self.repeat_last and self.script:
            item = self.script[-1]
        else:
            raise ProviderError(f"ScriptedProvider: script exhausted after {self._pos} calls", provider="scripted")
        if callable(item) and not isinstance(item, (MessageResponse, ProviderError)):
            item = item(request)
        if isinstance(item, ProviderError):
            raise item
        if isinstance(item, str):
            return text_response(item)
        return item

    async def chat(self, request: MessageRequest) -> MessageResponse:
        if self.delay:
            await asyncio.sleep(self.delay)
        return self._next(request)

    async def chat_stream(self, request: MessageRequest) -> AsyncIterator[StreamEvent]:
        # a stream's first event comes after the request went out: the event loop turns at least once
        # (as with a real server), so other tasks (a stream's subscriber) run before the deltas do
        await asyncio.sleep(self.delay)
        response = self._next(request)
        for event in events_for(response):
            parts = [event]
            if self.chunk_chars and isinstance(event, TextDelta):
                n = self.chunk_chars
                parts = [TextDelta(event.index, event.text[i:i + n]) for i in range(0, len(event.text), n)]
            for part in parts:
                await asyncio.sleep(self.stream_delay)  # each read of a real stream lets the loop turn
                yield part
