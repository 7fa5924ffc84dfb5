"""Every recorded body of the corpus (all 148, every protocol) through the real HTTP path: the
stream events, folded again into a fresh aggregate, give the response the stream ended with.

A streamed body is read by ``chat_stream``; a JSON body is answered to ``chat_stream`` too (the
server ignored ``stream: true``), so its events are synthesized from the decoded response. Block
data that has no delta of its own (a Responses reasoning item's summary and encrypted content, a
server-tool item, annotations, an Anthropic signature) rides in ``ContentBlockEnd``; before that,
four Responses bodies folded to blocks without them. The same bytes read by ``chat`` give the
same response. A failing body raises a typed error, never a MessageComplete.

The stop reason and Responses' message-level ``provider_data`` (text item ids, phases) are set on
the aggregate by the parser, not by an event, and are compared through ``chat`` instead.
"""

from __future__ import annotations

from typing import Any

import pytest

import corpus
from fsm_agent.errors import ProviderError
from fsm_agent.providers import ProviderConfig, RetryPolicy, create_provider
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import (ContentBlockEnd, ErrorEvent, MessageComplete, MessageRequest,
                             PartialMessageResponse, UserMessage)

PROVIDER = {"openai-chat": "openai-compatible", "openai-responses": "openai-responses", "anthropic": "anthropic"}
BODIES = corpus.bodies()
REQUEST = MessageRequest(model="m", messages=(UserMessage("hi"),))


def test_the_corpus_is_whole() -> None:
    assert len(BODIES) == 148
    assert {b.protocol for b in BODIES} == set(PROVIDER)


def _provider(body: corpus.Body, base: str) -> Any:
    suffix = "/v1" if body.protocol == "anthropic" else ""
    return create_provider(PROVIDER[body.protocol], ProviderConfig(
        base_url=base + suffix, model="m", api_key="k", retry=RetryPolicy(max_attempts=1)))


async def _calls(body: corpus.Body, seed: int) -> tuple[list[Any], ProviderError | None, Any, ProviderError | None]:
    """The body answered to ``chat_stream``, then to ``chat``, by one server and one provider:
    (events, stream error, response, chat error)."""
    rec = RecordedResponse(body.status, body.data, body.content_type)
    server = ReplayServer([rec, rec], seed=seed if body.status == 200 else None)
    provider = _provider(body, await server.start())
    events: list[Any] = []
    errors: list[ProviderError | None] = [None, None]
    plain: Any = None
    try:
        try:
            async for ev in provider.chat_stream(REQUEST):
                events.append(ev)
        except ProviderError as exc:
            errors[0] = exc
        try:
            plain = await provider.chat(REQUEST)
        except ProviderError as exc:
            errors[1] = exc
    finally:
        await provider.aclose()
        await server.close()
    return events, errors[0], plain, errors[1]


def _fold(events: list[Any], protocol: str, provider: str) -> Any:
    again = PartialMessageResponse(provider=provider, source=protocol)
    for ev in events:
        again.apply(ev)
    return again.finalize()


@pytest.mark.parametrize("body", BODIES, ids=lambda b: b.path)
async def test_folding_the_events_gives_the_final_response(body: corpus.Body) -> None:
    events, error, plain, plain_error = await _calls(body, seed=len(body.path))
    if error is not None:
        assert not any(isinstance(e, MessageComplete) for e in events)
        assert isinstance(events[-1], ErrorEvent) and events[-1].kind == error.kind
        assert plain_error is not None and plain_error.kind == error.kind
        return
    assert plain_error is None
    assert sum(isinstance(e, MessageComplete) for e in events) == 1 and isinstance(events[-1], MessageComplete)
    final = events[-1].full_response
    folded = _fold(events, body.protocol, final.provider)
    assert folded.message.content == final.message.content
    assert (folded.id, folded.model, folded.usage, folded.refusal) == (final.id, final.model, final.usage,
                                                                       final.refusal)
    # the non-streaming read of the same bytes is the same response, stop reason and all
    assert plain == final
    # a block is revised at most once, and only after it ended
    ends = [e.index for e in events if isinstance(e, ContentBlockEnd)]
    assert all(ends.count(i) <= 2 for i in set(ends))
