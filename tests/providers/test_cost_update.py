"""CostUpdate carries the call's cost in USD, the same as ``fsm_agent.pricing.cost_usd(model, usage)``,
on every protocol (OpenAI Chat, OpenAI Responses, Anthropic) and for synthesized streams; ``None``
when the model has no known price."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

import corpus
from fsm_agent.errors import ProviderError
from fsm_agent.pricing import PRICES, Price, cost_usd
from fsm_agent.providers import ProviderConfig, RetryPolicy, ScriptedProvider, create_provider, text_response
from fsm_agent.providers.costs import cost_update, events_for
from fsm_agent.types import CostUpdate, MessageComplete, MessageRequest, Usage, UserMessage

KIND = {"openai-chat": "openai-compatible", "openai-responses": "openai-responses", "anthropic": "anthropic"}
STREAMS = [b for b in corpus.bodies() if b.streaming and b.status == 200 and b.protocol in KIND]
REQ = MessageRequest(model="m", messages=(UserMessage("hi"),))


def make(protocol: str, base_url: str = "http://127.0.0.1:9") -> Any:
    if protocol == "anthropic":
        base_url += "/v1"
    return create_provider(KIND[protocol], ProviderConfig(base_url=base_url, model="m", api_key="k",
                                                          retry=RetryPolicy(max_attempts=1)))


def check(events: list[Any]) -> list[CostUpdate]:
    """Every CostUpdate's cost equals the pricing table's for the response's model and that usage."""
    final = [e for e in events if isinstance(e, MessageComplete)][-1].full_response
    updates = [e for e in events if isinstance(e, CostUpdate)]
    for ev in updates:
        assert ev.cost_usd == cost_usd(final.model, ev.usage), (final.model, ev)
    return updates


def _ends_in_error(body: corpus.Body) -> bool:
    try:
        make(body.protocol).decode_stream_bytes(body.data)
    except ProviderError:
        return True
    return False


COMPLETE = [b for b in STREAMS if not _ends_in_error(b)]
"""The recorded 200 streams that end with a whole message (the others end in an in-stream error and
have no final response to price against; tests/providers cover their typed errors)."""


@pytest.mark.parametrize("body", COMPLETE, ids=lambda b: b.path)
def test_every_recorded_stream_prices_its_cost_updates(body: corpus.Body) -> None:
    check(make(body.protocol).decode_stream_bytes(body.data))


def test_most_recorded_streams_end_with_a_whole_message() -> None:
    assert len(COMPLETE) >= len(STREAMS) - 4 and len(COMPLETE) > 40


def test_the_corpus_has_priced_and_unpriced_streams_on_every_protocol() -> None:
    seen: dict[tuple[str, bool], int] = {}
    for body in STREAMS:
        try:
            events = make(body.protocol).decode_stream_bytes(body.data)
        except Exception:  # noqa: BLE001
            continue
        for ev in check(events):
            key = (body.protocol, ev.cost_usd is not None)
            seen[key] = seen.get(key, 0) + 1
    for protocol in KIND:
        assert seen.get((protocol, True)), f"{protocol}: no priced CostUpdate in the corpus"
    assert seen.get(("openai-chat", False)) and seen.get(("anthropic", False))


def priced_body(protocol: str) -> tuple[corpus.Body, str]:
    """The first recorded stream of ``protocol`` whose model has a known price, and that model."""
    for body in STREAMS:
        if body.protocol != protocol:
            continue
        try:
            events = make(protocol).decode_stream_bytes(body.data)
        except Exception:  # noqa: BLE001
            continue
        final = events[-1].full_response
        if final.usage is not None and cost_usd(final.model, final.usage):
            return body, final.model
    raise AssertionError(f"no priced {protocol} stream in the corpus")


@pytest.mark.parametrize("protocol", list(KIND))
async def test_cost_update_over_real_http(protocol: str) -> None:
    from fsm_agent.testing import RecordedResponse, ReplayServer

    body, model = priced_body(protocol)
    async with ReplayServer([RecordedResponse(200, body.data, "text/event-stream")], seed=5) as server:
        p = make(protocol, server.base_url)
        try:
            events = [ev async for ev in p.chat_stream(REQ)]
        finally:
            await p.aclose()
    updates = check(events)
    final = events[-1].full_response
    assert updates and updates[-1].usage == final.usage
    assert updates[-1].cost_usd == cost_usd(model, final.usage) and updates[-1].cost_usd > 0


async def test_a_price_registered_for_the_model_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsm_agent.testing import RecordedResponse, ReplayServer

    monkeypatch.setitem(PRICES, "test-cost-model", Price(3.0, 12.0, cached_input=0.3, date="2026-12-01",
                                                         source="test"))
    chunks = [
        {"id": "c1", "object": "chat.completion.chunk", "model": "test-cost-model",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": None}]},
        {"id": "c1", "object": "chat.completion.chunk", "model": "test-cost-model",
         "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 1000, "completion_tokens": 200, "prompt_tokens_details": {"cached_tokens": 400}}},
    ]
    data = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    async with ReplayServer([RecordedResponse(200, data, "text/event-stream")]) as server:
        p = make("openai-chat", server.base_url)
        try:
            events = [ev async for ev in p.chat_stream(REQ)]
        finally:
            await p.aclose()
    [update] = check(events)
    assert update.cost_usd == pytest.approx((600 * 3.0 + 400 * 0.3 + 200 * 12.0) / 1e6)
    # a server that ignored stream: true (synthesized events) prices the same way
    body = orjson.dumps({"id": "c2", "object": "chat.completion", "model": "test-cost-model",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 1000, "completion_tokens": 200}})
    async with ReplayServer([RecordedResponse(200, body)]) as server:
        p = make("openai-chat", server.base_url)
        try:
            events = [ev async for ev in p.chat_stream(REQ)]
        finally:
            await p.aclose()
    [update] = check(events)
    assert update.cost_usd == pytest.approx((1000 * 3.0 + 200 * 12.0) / 1e6)


def test_synthesized_events_and_unknown_models() -> None:
    response = text_response("x", usage=Usage(100, 10), model="gpt-4o-2024-08-06")
    [update] = [e for e in events_for(response) if isinstance(e, CostUpdate)]
    assert update.cost_usd == cost_usd("gpt-4o-2024-08-06", Usage(100, 10)) == pytest.approx((250 + 100) / 1e6)
    unknown = text_response("x", usage=Usage(100, 10), model="no-such-model")
    [update] = [e for e in events_for(unknown) if isinstance(e, CostUpdate)]
    assert update.cost_usd is None  # unknown, never a guessed zero
    assert cost_update(Usage(1, 1), "").cost_usd is None  # a response that names no model


async def test_scripted_provider_streams_priced_cost_updates() -> None:
    p = ScriptedProvider([text_response("x", usage=Usage(2000, 100), model="claude-sonnet-4-5")])
    events = [ev async for ev in p.chat_stream(REQ)]
    [update] = check(events)
    assert update.cost_usd == pytest.approx((2000 * 3.0 + 100 * 15.0) / 1e6)
