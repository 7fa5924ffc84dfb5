"""Retries (Retry-After seconds / HTTP-date / ms, backoff with jitter, the run's deadline, no replay
after content, one retry on an empty answer), streaming timeouts, the fallback chain, B20's error
classification, B06's reasoning echo, and usage/cost per call and per session."""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any

import orjson
import pytest

from corpus import CASES, case_messages
from fsm_agent import Agent, RunConfig, StopReason
from fsm_agent.errors import (
    EmptyResponseError,
    ProviderConnectionError,
    ProviderError,
    ProviderTimeoutError,
    RateLimitError,
    ServerError,
)
from fsm_agent.pricing import PRICES, Price, cost_usd, price_for, register_price
from fsm_agent.providers import (
    FallbackProvider,
    ProviderConfig,
    RetryPolicy,
    call_deadline,
    classify_error,
    create_provider,
    first_token_timeout_for,
    parse_retry_after,
)
from fsm_agent.providers.openai_chat import messages_to_wire
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import (
    CostUpdate,
    MessageRequest,
    Usage,
    UserMessage,
)

REQ = MessageRequest(model="m", messages=(UserMessage("hi"),))


def chunk(delta: dict, finish: str | None = None, usage: dict | None = None, model: str = "m") -> bytes:
    c: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "model": model,
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        c["usage"] = usage
    return b"data: " + orjson.dumps(c) + b"\n\n"


def stream(text: str, usage: dict | None = None, model: str = "m") -> bytes:
    return (chunk({"role": "assistant", "content": text}, model=model) + chunk({}, "stop", usage, model=model)
            + b"data: [DONE]\n\n")


OK = RecordedResponse(200, stream("hello", {"prompt_tokens": 5, "completion_tokens": 1}), "text/event-stream")
RATE = b'{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}'


async def serve(*responses: RecordedResponse, **kw: Any) -> tuple[ReplayServer, str]:
    server = ReplayServer(list(responses), **kw)
    return server, await server.start()


def provider(base: str, **cfg: Any) -> Any:
    return create_provider("openai-compatible", ProviderConfig(base_url=base, model="m", api_key="k", **cfg))


async def collect(p: Any, req: MessageRequest = REQ) -> list[Any]:
    return [ev async for ev in p.chat_stream(req)]


# -- Retry-After and backoff ---------------------------------------------------------------------
def test_parse_retry_after_variants() -> None:
    now = 1_767_225_600.0
    date = email.utils.formatdate(now + 7, usegmt=True)
    assert parse_retry_after({"retry-after": "3"}) == 3.0
    assert parse_retry_after({"retry-after": "1.5"}) == 1.5
    assert parse_retry_after({"retry-after": date}, now=now) == pytest.approx(7.0, abs=1)
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25  # ms wins
    assert parse_retry_after({"retry-after": "-1"}) is None
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after({}) is None


def test_backoff_grows_with_jitter_above_its_base_and_caps() -> None:
    policy = RetryPolicy(max_attempts=6, initial_delay=0.5, max_delay=3.0)
    err = ServerError("x", status=500)
    assert [policy.delay(err, n, rng=lambda: 0.0) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]  # the bases
    assert [policy.delay(err, n, rng=lambda: 1.0) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 3.0, 3.0, 3.0]
    assert policy.delay(err, 2, rng=lambda: 0.25) == 1.25
    assert policy.delay(err, 6) is None  # attempts spent
    assert policy.delay(ServerError("x", status=500, retryable=False), 1) is None


def test_server_wait_is_honoured_capped_and_never_past_the_deadline() -> None:
    policy = RetryPolicy(max_retry_after=10)
    assert policy.delay(RateLimitError("x", retry_after=2.0), 1) == 2.0
    assert policy.delay(ServerError("x", headers={"Retry-After-Ms": "120"}), 1) == 0.12
    assert policy.delay(RateLimitError("x", retry_after=30.0), 1) is None  # longer than we are willing to wait
    token = call_deadline.set(time.monotonic() + 1.0)
    try:
        assert policy.delay(RateLimitError("x", retry_after=2.0), 1) is None  # would end past the run's budget
        assert policy.delay(RateLimitError("x", retry_after=0.2), 1) == 0.2
    finally:
        call_deadline.reset(token)


async def test_retry_after_from_a_real_429_is_waited_for() -> None:
    server, base = await serve(RecordedResponse(429, RATE, headers={"retry-after-ms": "300"}), OK)
    p = provider(base)
    t = time.monotonic()
    try:
        events = await collect(p)
    finally:
        await p.aclose()
        await server.close()
    assert time.monotonic() - t >= 0.29
    assert len(server.requests) == 2
    assert events[-1].full_response.text == "hello"


async def test_retries_are_spent_then_the_typed_error_is_raised() -> None:
    fail = RecordedResponse(503, b'{"error":{"message":"upstream down","type":"server_error"}}')
    server, base = await serve(fail, fail, fail, OK)
    p = provider(base, retry=RetryPolicy(max_attempts=3, initial_delay=0.01))
    try:
        with pytest.raises(ServerError, match="upstream down") as info:
            await p.chat(REQ)
    finally:
        await p.aclose()
        await server.close()
    assert len(server.requests) == 3 and info.value.status == 503 and info.value.retryable


async def test_no_replay_once_a_stream_produced_content() -> None:
    body = stream("partial answer that is cut")
    cut = RecordedResponse(200, body, "text/event-stream", drop_after=body.index(b"\n\n") + 2)
    server, base = await serve(cut, OK)
    p = provider(base)
    try:
        with pytest.raises(ProviderConnectionError) as info:
            await collect(p)
    finally:
        await p.aclose()
        await server.close()
    assert len(server.requests) == 1
    assert info.value.partial.text == "partial answer that is cut"
    # allowed replay: the stream is retried
    server, base = await serve(cut, OK)
    p = provider(base, allow_stream_replay=True, retry=RetryPolicy(initial_delay=0.01))
    try:
        events = await collect(p)
    finally:
        await p.aclose()
        await server.close()
    assert len(server.requests) == 2 and events[-1].full_response.text == "hello"


async def test_one_retry_on_an_empty_response() -> None:
    empty = RecordedResponse(200, chunk({"role": "assistant", "content": ""}) + chunk({}, "stop") + b"data: [DONE]\n\n",
                             "text/event-stream")
    server, base = await serve(empty, OK)
    p = provider(base, retry=RetryPolicy(initial_delay=0.01))
    try:
        assert (await p.chat(REQ)).text == "hello"
    finally:
        await p.aclose()
        await server.close()
    server, base = await serve(empty, empty, OK)
    p = provider(base, retry=RetryPolicy(initial_delay=0.01))
    try:
        with pytest.raises(EmptyResponseError):
            await collect(p)
    finally:
        await p.aclose()
        await server.close()
    assert len(server.requests) == 2  # exactly one retry


# -- streaming timeouts (seed 000 §5.2.7) -----------------------------------------------------------
def test_first_token_timeout_formula() -> None:
    assert first_token_timeout_for(0) == 30
    assert first_token_timeout_for(100_000) == 130
    assert first_token_timeout_for(1_000_000) == 180


async def test_no_first_token_in_time_is_a_typed_timeout() -> None:
    server, base = await serve(RecordedResponse(200, stream("late"), "text/event-stream", delay=2.0))
    p = provider(base, first_token_timeout=0.3, retry=RetryPolicy(max_attempts=1))
    t = time.monotonic()
    try:
        with pytest.raises(ProviderTimeoutError, match="no first token within 0.3 s"):
            await collect(p)
        took = time.monotonic() - t
    finally:
        await p.aclose()
        await server.close()
    assert took < 1.5  # did not wait for the server's 2 s


async def test_a_stalled_stream_times_out_and_keeps_the_partial() -> None:
    body = chunk({"role": "assistant", "content": "so far"}) + chunk({"content": " more"}) + chunk({}, "stop")
    server, base = await serve(RecordedResponse(200, body, "text/event-stream", chunk_delay=1.0),
                               chunk_sizes=[len(chunk({"role": "assistant", "content": "so far"}))])
    p = provider(base, chunk_timeout=0.3, retry=RetryPolicy(max_attempts=1))
    try:
        with pytest.raises(ProviderTimeoutError, match="stream stalled: no data for 0.3 s") as info:
            await collect(p)
    finally:
        await p.aclose()
        await server.close()
    assert info.value.partial.text == "so far"


# -- fallback chain ---------------------------------------------------------------------------------
async def test_fallback_chain_answers_from_the_next_provider() -> None:
    down = RecordedResponse(503, b'{"error":{"message":"overloaded","type":"server_error"}}')
    s1, b1 = await serve(down, repeat_last=True)
    s2, b2 = await serve(OK)
    primary = provider(b1, retry=RetryPolicy(max_attempts=2, initial_delay=0.01))
    backup = create_provider("llamacpp", ProviderConfig(base_url=b2, model="backup-model"))
    chain = FallbackProvider([primary, backup])
    try:
        events = await collect(chain)
    finally:
        await chain.aclose()
        await s1.close()
        await s2.close()
    final = events[-1].full_response
    assert final.text == "hello" and final.provider == "llamacpp"
    assert not any(e.TAG == "error" for e in events)
    assert s2.requests[0].json()["model"] == "backup-model"
    assert len(s1.requests) == 2


async def test_fallback_does_not_hide_a_bad_request() -> None:
    bad = RecordedResponse(400, b'{"error":{"message":"Invalid value for temperature","type":"invalid_request_error"}}')
    s1, b1 = await serve(bad)
    s2, b2 = await serve(OK)
    chain = FallbackProvider([provider(b1), provider(b2)])
    try:
        with pytest.raises(ProviderError, match="Invalid value for temperature"):
            await chain.chat(REQ)
    finally:
        await chain.aclose()
        await s1.close()
        await s2.close()
    assert s2.requests == []


# -- B20: context-window errors across wordings --------------------------------------------------------
def test_b20_every_case_is_classified() -> None:
    cases = json.loads((CASES / "B20.json").read_text())["cases"]
    expected = json.loads((CASES / "B20.expected.json").read_text())["per_case"]
    for case in cases:
        status = case["status"]
        payload = case.get("body", case.get("sse_data"))
        err = classify_error(None if status == 200 else status, payload, provider=case["provider"], in_stream=status == 200)
        want = expected[case["name"]]
        assert err.kind == want["kind"], (case["name"], str(err))
        for key, attr in (("limit", "limit"), ("requested", "requested"), ("input", "input_tokens"),
                          ("max_tokens", "max_tokens_requested")):
            if key in want:
                assert getattr(err, attr) == want[key], (case["name"], key)
        if "retryable" in want:
            assert err.retryable is want["retryable"]
    lower = classify_error(400, cases[3]["body"])
    assert "Lowering max_tokens to 20587 or less is enough" in str(lower)


# -- B06: DeepSeek reasoning_content goes back verbatim, only to providers that take it --------------------
def b06_messages() -> tuple[Any, ...]:
    return tuple(case_messages(json.loads((CASES / "B06.json").read_text())["messages"]))


def test_b06_deepseek_echoes_reasoning_content_verbatim() -> None:
    exp = json.loads((CASES / "B06.expected.json").read_text())
    msgs = b06_messages()
    p = create_provider("deepseek", ProviderConfig(api_key="k", model="deepseek-reasoner"))
    wire = p.build_body(MessageRequest("deepseek-reasoner", msgs), False)["messages"]
    assert wire[5]["reasoning_content"] == exp["must_have"]["messages[5].reasoning_content"]
    for i in (1, 3):
        assert wire[i].get("reasoning_content", "absent") in exp["allowed_either"][f"messages[{i}].reasoning_content"]
    for m in wire:
        if m["role"] == "assistant":
            assert "R1" not in (m["content"] or "") and "R2" not in (m["content"] or "")  # never merged into content
            assert m.get("reasoning_content", "x") != ""
    qwen = create_provider("qwen", ProviderConfig(api_key="k")).build_body(MessageRequest("q", msgs), False)
    assert qwen["messages"][5]["reasoning_content"] == "R3: look up training."
    plain = messages_to_wire(msgs)  # plain OpenAI: never sent
    assert all("reasoning_content" not in m for m in plain)
    openai = create_provider("openai", ProviderConfig(api_key="k")).build_body(MessageRequest("gpt-4o", msgs), False)
    assert all("reasoning_content" not in m for m in openai["messages"])


async def test_b06_stream_keeps_reasoning_on_tool_call_turns() -> None:
    body = (chunk({"role": "assistant", "content": None, "reasoning_content": "R3: look "})
            + chunk({"reasoning_content": "up training."})
            + chunk({"tool_calls": [{"index": 0, "id": "call_PH_31", "type": "function",
                                     "function": {"name": "lookup_budget", "arguments": '{"line":"training"}'}}]})
            + chunk({}, "tool_calls") + b"data: [DONE]\n\n")
    server, base = await serve(RecordedResponse(200, body, "text/event-stream"), seed=6)
    p = create_provider("deepseek", ProviderConfig(base_url=base, api_key="k"))
    try:
        resp = (await collect(p))[-1].full_response
    finally:
        await p.aclose()
        await server.close()
    assert resp.thinking == "R3: look up training."
    assert resp.tool_calls[0].input == {"line": "training"}
    again = p.build_body(MessageRequest("deepseek-chat", (UserMessage("q"), resp.message)), False)
    assert again["messages"][1]["reasoning_content"] == "R3: look up training."


# -- usage and cost -----------------------------------------------------------------------------------
def test_every_price_has_a_date_and_a_source() -> None:
    for name, price in PRICES.items():
        assert price.date and price.source, name
    assert price_for("gpt-4o-2024-08-06") is PRICES["gpt-4o"]  # longest prefix
    assert price_for("gpt-4o-mini-2024-07-18") is PRICES["gpt-4o-mini"]
    assert price_for("unknown-model") is None
    assert cost_usd("unknown-model", Usage(10, 10)) is None


def test_cost_counts_cached_input_at_its_rate() -> None:
    register_price("test-priced", Price(2.0, 8.0, cached_input=0.5, cache_write=2.5, date="2026-11-30", source="test"))
    u = Usage(input_tokens=1_000_000, output_tokens=500_000, cache_read_tokens=400_000, cache_write_tokens=100_000)
    assert cost_usd("test-priced", u) == pytest.approx(0.6 * 2.0 + 0.4 * 0.5 + 0.1 * 2.5 + 0.5 * 8.0)


async def test_usage_and_cost_accumulate_per_call_and_per_session() -> None:
    register_price("test-session-model", Price(1.0, 2.0, date="2026-11-30", source="test"))
    calc_turn = (chunk({"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]},
        model="test-session-model")
        + chunk({}, "tool_calls", {"prompt_tokens": 1000, "completion_tokens": 100,
                                   "prompt_tokens_details": {"cached_tokens": 200}}, model="test-session-model")
        + b"data: [DONE]\n\n")
    answer = stream("It is late.", {"prompt_tokens": 1500, "completion_tokens": 50}, model="test-session-model")
    server, base = await serve(RecordedResponse(200, calc_turn, "text/event-stream"),
                               RecordedResponse(200, answer, "text/event-stream"))
    from fsm_agent.tools.demo import clock

    costs: list[Any] = []
    p = provider(base)
    agent = Agent(p, tools=[clock], observers=[lambda e: costs.append(e.event) if getattr(e, "event", None) is not None
                                               and isinstance(e.event, CostUpdate) else None],
                  config=RunConfig())
    try:
        result = await agent.run("time?")
    finally:
        await p.aclose()
        await server.close()
    assert result.stop.reason is StopReason.COMPLETED
    assert result.usage == Usage(2500, 150, cache_read_tokens=200)
    assert result.cost_usd == pytest.approx((2500 * 1.0 + 150 * 2.0) / 1e6)
    assert [c.usage.input_tokens for c in costs] == [1000, 1500]
    assert costs[-1].usage.output_tokens == 50
