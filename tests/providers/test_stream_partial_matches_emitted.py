"""A stream that fails partway through one network read: what the consumer saw equals the error's partial.

``HttpProvider._stream_batches`` decodes the events of each network read as one batch. When
``parser.feed`` raised on an event of a read, the events that read had decoded before it were
dropped, although the parser had already folded them into the ``partial`` the error carries: the
consumer and the error disagreed (seen on ``groq_stream_error_event.yaml.0``: the last reasoning
deltas before ``event: error`` were in ``partial`` only). Now they are yielded before the error.
"""

from __future__ import annotations

from typing import Any

import pytest

import corpus
from fsm_agent.errors import ProviderError, ProviderProtocolError
from fsm_agent.providers import ProviderConfig, RetryPolicy, create_provider
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import MessageRequest, PartialMessageResponse, UserMessage
from fsm_agent.types.stream import ErrorEvent

REQUEST = MessageRequest(model="m", messages=(UserMessage("hi"),))
PROFILES = {"openai-chat": "openai-compatible", "openai-responses": "openai-responses", "anthropic": "anthropic"}


async def _consume(protocol: str, body: bytes, chunk_sizes: list[int] | None) -> tuple[list[Any], ProviderError]:
    server = ReplayServer([RecordedResponse(200, body, "text/event-stream")], chunk_sizes=chunk_sizes)
    base = await server.start()
    provider = create_provider(PROFILES[protocol], ProviderConfig(base_url=base, model="m", api_key="k",
                                                                  retry=RetryPolicy(max_attempts=1)))
    events: list[Any] = []
    try:
        with pytest.raises(ProviderError) as info:
            async for ev in provider.chat_stream(REQUEST):
                events.append(ev)
    finally:
        await provider.aclose()
        await server.close()
    return events, info.value


def _fold(events: list[Any]) -> Any:
    p = PartialMessageResponse()
    for ev in events:
        if not isinstance(ev, ErrorEvent):
            p.apply(ev)
    return p.snapshot()


def _same(seen: Any, partial: Any) -> None:
    assert partial is not None
    assert seen.text == partial.text
    assert seen.thinking == partial.thinking
    assert [(c.id, c.name) for c in seen.tool_calls] == [(c.id, c.name) for c in partial.tool_calls]
    assert [b.kind if hasattr(b, "kind") else type(b).__name__ for b in seen.message.content] == \
        [b.kind if hasattr(b, "kind") else type(b).__name__ for b in partial.message.content]


GROQ = "other_openai_compatible/pydantic-ai__groq_stream_error_event.yaml.0.body"


@pytest.mark.parametrize("chunk_sizes", [None, [4096], [1000, 7, 20000]], ids=["whole", "4k", "mixed"])
async def test_groq_error_event_the_reasoning_seen_is_the_reasoning_kept(chunk_sizes: list[int] | None) -> None:
    body = next(b for b in corpus.bodies() if b.path == GROQ)
    events, err = await _consume("openai-chat", body.data, chunk_sizes)
    assert err.kind == "invalid_request"
    assert isinstance(events[-1], ErrorEvent)
    seen = _fold(events)
    _same(seen, err.partial)
    assert seen.thinking.endswith(" Let's do that.")  # the last deltas, in the read that held the error


def _sse(frames: list[tuple[str | None, str]]) -> bytes:
    out = ""
    for event, data in frames:
        out += (f"event: {event}\n" if event else "") + f"data: {data}\n\n"
    return out.encode()


BAD_STREAMS = {
    "openai-chat": _sse([
        (None, '{"id":"c1","model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"Hello"}}]}'),
        (None, '{"id":"c1","model":"m","choices":[{"index":0,"delta":{"content":" world"}}]}'),
        (None, '{"id":"c1","model":"m","choices":[{"index":0,"delta":{"content":{"oops":1}}}]}'),
        (None, '{"id":"c1","model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'),
        (None, "[DONE]"),
    ]),
    "anthropic": _sse([
        ("message_start", '{"type":"message_start","message":{"id":"msg","model":"m","usage":{"input_tokens":3}}}'),
        ("content_block_start", '{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}'),
        ("content_block_delta", '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}'),
        ("content_block_delta", '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" world"}}'),
        ("content_block_delta", '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":7}}'),
        ("message_stop", '{"type":"message_stop"}'),
    ]),
    "openai-responses": _sse([
        ("response.created", '{"type":"response.created","response":{"id":"r","model":"m","output":[]}}'),
        ("response.output_item.added",
         '{"type":"response.output_item.added","output_index":0,"item":{"type":"message","id":"m1","content":[]}}'),
        ("response.output_text.delta",
         '{"type":"response.output_text.delta","output_index":0,"content_index":0,"item_id":"m1","delta":"Hello"}'),
        ("response.output_text.delta",
         '{"type":"response.output_text.delta","output_index":0,"content_index":0,"item_id":"m1","delta":" world"}'),
        ("response.output_text.delta",
         '{"type":"response.output_text.delta","output_index":0,"content_index":0,"item_id":"m1","delta":["x"]}'),
        ("response.completed", '{"type":"response.completed","response":{"id":"r","model":"m","status":"completed"}}'),
    ]),
}


@pytest.mark.parametrize("protocol", list(BAD_STREAMS))
async def test_a_wrong_typed_frame_in_the_same_read_as_good_ones(protocol: str) -> None:
    events, err = await _consume(protocol, BAD_STREAMS[protocol], None)  # one write: one read, most likely
    assert isinstance(err, ProviderProtocolError)
    assert "expected string" in str(err)
    seen = _fold(events)
    assert seen.text == "Hello world"
    _same(seen, err.partial)
