"""Anthropic Messages protocol (``fsm_agent.providers.anthropic``).

* Every recorded Anthropic response body replayed through ``AnthropicProvider``'s real HTTP
  path (streams in irregular pieces), checked against an independent, deliberately naive
  reading of the recorded events written here (split frames on blank lines, load each
  ``data:``, fold blocks by their wire index), never against the module under test.
* Follow-up requests of the multi-turn recordings rebuilt from the decoded first answer and
  compared with the recorded request.
* Cases B02 and B04 (serializer part), the request mapping, and the stream parser's edges.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import orjson
import pytest
from attrs import evolve

import corpus
from corpus import case_messages
from fsm_agent.errors import (
    AuthenticationError,
    ConfigurationError,
    InvalidHistoryError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    ProviderConnectionError,
    ProviderError,
    ProviderProtocolError,
    RateLimitError,
    RequestTooLargeError,
    ServerError,
)
from fsm_agent.providers import ProviderConfig, ProviderType, RetryPolicy, create_provider
from fsm_agent.providers.anthropic import (
    DEFAULT_MAX_TOKENS,
    AnthropicProvider,
    AnthropicStreamParser,
    messages_to_wire,
    parse_message,
    tool_choice_to_wire,
)
from fsm_agent.providers.base import HttpProvider
from fsm_agent.providers.sse import ServerSentEvent
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import (
    AssistantMessage,
    AudioBlock,
    ContentBlockStart,
    CostUpdate,
    ErrorEvent,
    ExtensionBlock,
    FileBlock,
    ImageBlock,
    MessageComplete,
    MessageRequest,
    MessageResponse,
    ModelStopReason,
    PartialMessageResponse,
    SystemMessage,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingConfig,
    ToolCallEnd,
    ToolDefinition,
    ToolResultBlock,
    ToolResultMessage,
    ToolUseBlock,
    UserImageMessage,
    UserMessage,
)

BODIES = [b for b in corpus.bodies() if b.protocol == "anthropic"]
SUCCESS_STREAMS = [b for b in BODIES if b.streaming and b.status == 200 and b"event: error" not in b.data]
STREAM_ERRORS = [b for b in BODIES if b.streaming and b.status == 200 and b"event: error" in b.data]
SUCCESS_JSON = [b for b in BODIES if not b.streaming and b.status == 200]
ERRORS = [b for b in BODIES if b.status >= 400]
REQUEST = MessageRequest(model="claude-sonnet-4-5", messages=(UserMessage("hi"),))


# ---------------------------------------------------------------------------- reference reading
def frames(data: bytes) -> list[dict[str, Any]]:
    """The JSON payload of every SSE frame, in order."""
    out = []
    for frame in data.decode("utf-8").replace("\r\n", "\n").split("\n\n"):
        lines = [ln[6:] if ln.startswith("data: ") else ln[5:] for ln in frame.split("\n") if ln.startswith("data:")]
        if lines:
            out.append(json.loads("\n".join(lines)))
    return out


def naive_message(data: bytes) -> dict[str, Any]:
    """The message object a non-streaming call would have returned, rebuilt from the raw events."""
    msg: dict[str, Any] = {}
    blocks: dict[int, dict[str, Any]] = {}
    args: dict[int, str] = {}
    for ev in frames(data):
        kind = ev["type"]
        if kind == "message_start":
            msg = dict(ev["message"])
            msg["usage"] = dict(msg.get("usage") or {})
        elif kind == "content_block_start":
            blocks[ev["index"]] = dict(ev["content_block"])
            args[ev["index"]] = ""
        elif kind == "content_block_delta":
            block, d = blocks[ev["index"]], ev["delta"]
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                block["signature"] = (block.get("signature") or "") + d["signature"]
            elif d["type"] == "input_json_delta":
                args[ev["index"]] += d["partial_json"]
            elif d["type"] == "citations_delta":
                block["citations"] = (block.get("citations") or []) + [d["citation"]]
        elif kind == "content_block_stop":
            if args[ev["index"]].strip():
                blocks[ev["index"]]["input"] = json.loads(args[ev["index"]])
        elif kind == "message_delta":
            msg.update(ev["delta"])
            msg["usage"].update({k: v for k, v in (ev.get("usage") or {}).items() if v is not None})
    msg["content"] = [blocks[i] for i in sorted(blocks)]
    return msg


def summary(msg: dict[str, Any]) -> dict[str, Any]:
    """What a decoded response must hold, read from a wire message object by hand."""
    content, u = msg["content"], msg.get("usage") or {}
    read, write = u.get("cache_read_input_tokens") or 0, u.get("cache_creation_input_tokens") or 0
    refusal = None
    if msg.get("stop_reason") == "refusal" and msg.get("stop_details"):
        refusal = msg["stop_details"]["explanation"]
    return {
        "id": msg["id"],
        "model": msg["model"],
        "text": "".join(b["text"] for b in content if b["type"] == "text"),
        "calls": [(b["id"], b["name"], b.get("input") or {}) for b in content if b["type"] == "tool_use"],
        "thinking": [(b["thinking"], b.get("signature") or None) for b in content if b["type"] == "thinking"],
        "redacted": [b["data"] for b in content if b["type"] == "redacted_thinking"],
        "extensions": [b for b in content if b["type"] not in ("text", "tool_use", "thinking", "redacted_thinking")],
        "citations": [c for b in content if b["type"] == "text" for c in b.get("citations") or []],
        "stop": msg.get("stop_reason"),
        "refusal": refusal,
        "usage": (u["input_tokens"] + read + write, u["output_tokens"], read, write),
    }


def decoded(resp: MessageResponse) -> dict[str, Any]:
    """The same fields, taken from a decoded response."""
    thinking = [b for b in resp.content if isinstance(b, ThinkingBlock)]
    u = resp.usage
    assert u is not None
    return {
        "id": resp.id,
        "model": resp.model,
        "text": resp.text,
        "calls": [(c.id, c.name, c.input) for c in resp.tool_calls],
        "thinking": [(b.thinking, b.signature) for b in thinking if not b.redacted],
        "redacted": [b.redacted_data for b in thinking if b.redacted],
        "extensions": [b.data for b in resp.content if isinstance(b, ExtensionBlock)],
        "citations": [c for b in resp.content if isinstance(b, TextBlock) for c in b.citations],
        "stop": resp.raw_stop_reason,
        "refusal": resp.refusal,
        "usage": (u.input_tokens, u.output_tokens, u.cache_read_tokens, u.cache_write_tokens),
    }




# ---------------------------------------------------------------------------- plumbing
def _provider(base: str, **config: Any) -> HttpProvider:
    config.setdefault("retry", RetryPolicy(max_attempts=1))
    provider = create_provider(ProviderType.ANTHROPIC, ProviderConfig(base_url=base + "/v1", api_key="test", **config))
    assert isinstance(provider, AnthropicProvider)
    return provider


async def _stream(responses: list[RecordedResponse], seed: int | None = None,
                  request: MessageRequest = REQUEST, **config: Any) -> tuple[list[Any], ReplayServer]:
    server = ReplayServer(responses, seed=seed)
    provider = _provider(await server.start(), **config)
    events: list[Any] = []
    try:
        async for ev in provider.chat_stream(request):
            events.append(ev)
    finally:
        await provider.aclose()
        await server.close()
    return events, server


async def _chat(responses: list[RecordedResponse], seed: int | None = None,
                request: MessageRequest = REQUEST, **config: Any) -> tuple[MessageResponse, ReplayServer]:
    server = ReplayServer(responses, seed=seed)
    provider = _provider(await server.start(), **config)
    try:
        return await provider.chat(request), server
    finally:
        await provider.aclose()
        await server.close()


def _served(body: corpus.Body, **kw: Any) -> RecordedResponse:
    return RecordedResponse(body.status, body.data, body.content_type, **kw)


# ---------------------------------------------------------------------------- recorded successes
@pytest.mark.parametrize("body", SUCCESS_STREAMS, ids=lambda b: b.path)
@pytest.mark.parametrize("seed", [1, 2])
async def test_streamed_recording_decodes_to_the_recorded_message(body: corpus.Body, seed: int) -> None:
    ref = naive_message(body.data)
    events, server = await _stream([_served(body)], seed=seed)
    assert isinstance(events[-1], MessageComplete)
    assert sum(isinstance(e, MessageComplete) for e in events) == 1
    resp = events[-1].full_response
    assert decoded(resp) == summary(ref)
    assert resp.stop_reason is ModelStopReason(ref["stop_reason"])
    assert resp.provider == "anthropic"
    # no empty deltas: the empty first partial_json of a tool call and empty text make no event
    assert all(getattr(e, "text", "x") and getattr(e, "arguments", "x") for e in events)
    # the events, folded again into a fresh aggregate, give the same answer (the thinking
    # signature rides in its block's ContentBlockEnd)
    again = PartialMessageResponse(provider="anthropic", source="anthropic")
    for ev in events:
        again.apply(ev)
    rebuilt = again.finalize()
    assert rebuilt.message == resp.message
    assert (rebuilt.id, rebuilt.model, rebuilt.usage, rebuilt.refusal) == (resp.id, resp.model, resp.usage, resp.refusal)
    # what went over the wire
    (sent,) = server.requests
    assert sent.path == "/v1/messages"
    assert sent.headers["x-api-key"] == "test" and sent.headers["anthropic-version"] == "2023-06-01"
    assert sent.json()["stream"] is True


@pytest.mark.parametrize("body", SUCCESS_STREAMS, ids=lambda b: b.path)
async def test_streamed_recording_equals_the_non_streaming_decode(body: corpus.Body) -> None:
    events, _ = await _stream([_served(body)], seed=7)
    streamed = events[-1].full_response
    # the same event-stream body answered to a non-streaming call (the base class decodes it)
    via_chat, _ = await _chat([_served(body)], seed=8)
    assert via_chat == streamed
    # and the message object rebuilt by hand, served as a plain JSON response
    as_json = RecordedResponse(200, json.dumps(naive_message(body.data)).encode())
    plain, _ = await _chat([as_json])
    assert plain == streamed


@pytest.mark.parametrize("body", SUCCESS_JSON, ids=lambda b: b.path)
async def test_non_streamed_recording_decodes(body: corpus.Body) -> None:
    ref = json.loads(body.data)
    resp, server = await _chat([_served(body)], seed=3)
    assert decoded(resp) == summary(ref)
    assert resp.stop_reason is ModelStopReason(ref["stop_reason"])
    assert "stream" not in server.requests[0].json()
    # the same answer, streamed as the API would stream it, decodes to the same response
    events, _ = await _stream([RecordedResponse(200, as_stream(ref), "text/event-stream")], seed=3)
    assert events[-1].full_response == resp


def as_stream(msg: dict[str, Any]) -> bytes:
    """A message object as the event stream the API sends for it (text and JSON in two pieces)."""
    def event(payload: dict[str, Any]) -> str:
        return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"

    head = {k: v for k, v in msg.items() if k not in ("content", "stop_reason", "stop_sequence", "usage")}
    out = [event({"type": "message_start", "message": {**head, "content": [], "stop_reason": None,
                                                        "usage": {"input_tokens": msg["usage"]["input_tokens"],
                                                                  "output_tokens": 1}}})]
    for i, b in enumerate(msg["content"]):
        if b["type"] == "text":
            start, pieces = {**b, "text": ""}, [{"type": "text_delta", "text": b["text"][:3]},
                                                {"type": "text_delta", "text": b["text"][3:]}]
        elif b["type"] == "tool_use":
            args = json.dumps(b["input"])
            start, pieces = {**b, "input": {}}, [{"type": "input_json_delta", "partial_json": ""},
                                                 {"type": "input_json_delta", "partial_json": args[:4]},
                                                 {"type": "input_json_delta", "partial_json": args[4:]}]
        else:
            start, pieces = b, []
        out.append(event({"type": "content_block_start", "index": i, "content_block": start}))
        out += [event({"type": "content_block_delta", "index": i, "delta": d}) for d in pieces]
        out.append(event({"type": "content_block_stop", "index": i}))
    out.append(event({"type": "message_delta", "delta": {"stop_reason": msg["stop_reason"],
                                                         "stop_sequence": msg.get("stop_sequence")},
                      "usage": msg["usage"]}))
    out.append(event({"type": "message_stop"}))
    return "".join(out).encode()


SPOT_CHECKS: dict[str, dict[str, Any]] = {
    "anthropic/anthropic-sdk-python__429_twice_then_stream.json.2.body": {
        "text": "[12345,67890]", "stop_reason": ModelStopReason.END_TURN, "usage": (135, 10)},
    "anthropic/anthropic-sdk-python__tool_runner_stream.json.0.body": {
        "calls": [("toolu_018acGYLtfR52q9yDbWaEdQZ", "get_weather", {"location": "San Francisco, CA", "units": "f"})],
        "stop_reason": ModelStopReason.TOOL_USE, "usage": (656, 74)},
    "anthropic/anthropic-sdk-python__tool_use_response.sse.0.body": {
        "text": "I'll check the current weather in Paris for you.",
        "calls": [("toolu_01NRLabsLyVHZPKxbKvkfSMn", "get_weather", {"location": "Paris"})], "usage": (377, 65)},
    "anthropic/dd-trace-py__stream_max_tokens.yaml.0.body": {
        "text": 'The phrase "I think, therefore I am" (originally in Latin as',
        "stop_reason": ModelStopReason.MAX_TOKENS, "usage": (27, 15)},
    "anthropic/fantasy__parallel_tool_use.yaml.0.body": {
        "text": "I'll add and multiply the numbers 2 and 3 for you.",
        "calls": [("toolu_01StBeRxDEwsqcc3arbDgpS9", "add", {"a": 2, "b": 3}),
                  ("toolu_01AC6WQhj2iRkdYHgTAGMpVQ", "multiply", {"a": 2, "b": 3})]},
    "anthropic/fantasy__parallel_tool_use_streaming.yaml.0.body": {
        "calls": [("toolu_01UYxUYC2zRPY8wiutnF48eP", "add", {"a": 2, "b": 3}),
                  ("toolu_01VaRx1jpWCvPhi7L4kywAcd", "multiply", {"a": 2, "b": 3})], "usage": (502, 137)},
    "anthropic/fantasy__thinking_tool_streaming.yaml.0.body": {
        "calls": [("toolu_01Js4AMfx5qpTLhwTusnvT68", "weather", {"location": "Florence, Italy"})],
        "signature_prefix": "EtYDCkYICxgC", "thinking_prefix": "The user is asking for weather information"},
    "anthropic/langchaingo__create_message_stream.httprr.0.body": {"text": "1\n2\n3\n4\n5", "usage": (15, 13)},
    "anthropic/pydantic-ai__pause_turn_web_search_stream.yaml.0.body": {
        "stop_reason": ModelStopReason.PAUSE_TURN, "usage": (404500, 943), "reasoning": 261,
        "kinds": ["server_tool_use"] * 11 + ["web_search_tool_result"] * 10,
        "extra": {"server_tool_use": {"web_search_requests": 10, "web_fetch_requests": 0}},
        "signature_prefix": "EuwJCm4IDxgC"},
    "anthropic/pydantic-ai__redacted_thinking_stream.yaml.0.body": {
        "redacted_prefixes": ["EqkECkYIBxgC", "EtgBCkYIBxgC"], "usage": (92, 189)},
    "anthropic/pydantic-ai__thinking_stream.yaml.0.body": {"signature_prefix": "EvMCCkYICxgC", "usage": (43, 282)},
    "anthropic/simonw-llm-anthropic__stream_refusal.yaml.0.body": {
        "stop_reason": ModelStopReason.REFUSAL, "usage": (97, 0),
        "refusal_prefix": "This request was blocked as it seems to violate Anthropic's Terms of Service",
        "category": "reasoning_extraction"},
    "anthropic/simonw-llm-anthropic__stream_thinking.yaml.0.body": {
        "signature_prefix": "EuYDCmMIDBgC", "text_prefix": "1. **Pouch**"},
    "anthropic/simonw-llm-anthropic__thinking_tool_chain_stream.yaml.0.body": {
        "calls": [("toolu_01825dXWLSoJwCst1qTsiWdb", "fixed_version", {})], "reasoning": 53,
        "signature_prefix": "EoQDCm0IDhgC"},
    "anthropic/simonw-llm-anthropic__tools_stream.yaml.0.body": {
        "calls": [("toolu_01LtHJmixrs9NcWQkK8hu8hj", "pelican_name_generator", {}),
                  ("toolu_01N8a4jWyf116qKTMqKKmjyt", "pelican_name_generator", {})]},
    "anthropic/simonw-llm-anthropic__web_search_stream.yaml.0.body": {
        "kinds": ["server_tool_use", "web_search_tool_result"], "n_citations": 5, "usage": (10423, 341),
        "first_input": {"query": "San Francisco weather today"}},
}


@pytest.mark.parametrize("path", sorted(SPOT_CHECKS))
async def test_spot_check_exact_values(path: str) -> None:
    (body,) = [b for b in BODIES if b.path == path]
    want = SPOT_CHECKS[path]
    if body.streaming:
        events, _ = await _stream([_served(body)], seed=11)
        resp = events[-1].full_response
    else:
        resp, _ = await _chat([_served(body)])
    assert resp.usage is not None
    thinking = [b for b in resp.content if isinstance(b, ThinkingBlock)]
    checks = {
        "text": lambda v: resp.text == v,
        "text_prefix": lambda v: resp.text.startswith(v),
        "calls": lambda v: [(c.id, c.name, c.input) for c in resp.tool_calls] == v,
        "stop_reason": lambda v: resp.stop_reason is v,
        "usage": lambda v: (resp.usage.input_tokens, resp.usage.output_tokens) == v,
        "reasoning": lambda v: resp.usage.reasoning_tokens == v,
        "signature_prefix": lambda v: thinking[0].signature.startswith(v) and len(thinking[0].signature) > 200,
        "thinking_prefix": lambda v: thinking[0].thinking.startswith(v),
        "redacted_prefixes": lambda v: [b.redacted_data[:12] for b in thinking] == v and resp.thinking == "",
        "kinds": lambda v: sorted(b.kind for b in resp.content if isinstance(b, ExtensionBlock)) == v,
        "extra": lambda v: all(resp.extra[k] == x for k, x in v.items()),
        "refusal_prefix": lambda v: resp.refusal.startswith(v) and resp.content == (),
        "category": lambda v: resp.extra["stop_details"]["category"] == v,
        "n_citations": lambda v: sum(len(b.citations) for b in resp.content if isinstance(b, TextBlock)) == v,
        "first_input": lambda v: next(b for b in resp.content if isinstance(b, ExtensionBlock)).data["input"] == v,
    }
    for key, value in want.items():
        assert checks[key](value), (key, value)


# ---------------------------------------------------------------------------- recorded errors
ERROR_KINDS = {
    "anthropic/anthropic-sdk-python__429_twice_then_stream.json.0.body": (RateLimitError, "rate_limited"),
    "anthropic/anthropic-sdk-python__429_twice_then_stream.json.1.body": (RateLimitError, "rate_limited"),
    "anthropic/anthropic-sdk-python__tool_result_mismatch_400.json.1.body": (InvalidHistoryError, "invalid_history"),
    "anthropic/dd-trace-py__400_invalid_request.yaml.0.body": (InvalidRequestError, "invalid_request"),
    "anthropic/dd-trace-py__401_authentication_error.yaml.0.body": (AuthenticationError, "authentication"),
    "anthropic/observed__error_payloads.jsonl.0.body": (OverloadedError, "overloaded"),
    "anthropic/observed__error_payloads.jsonl.2.body": (ServerError, "server_error"),
    "anthropic/observed__error_payloads.jsonl.3.body": (RequestTooLargeError, "request_too_large"),
    "anthropic/pydantic-ai__404_not_found_model.yaml.0.body": (NotFoundError, "not_found"),
}
RETRYABLE = {"rate_limited", "overloaded", "server_error"}


@pytest.mark.parametrize("body", ERRORS, ids=lambda b: b.path)
@pytest.mark.parametrize("streaming", [False, True])
async def test_error_recording_raises_the_right_class(body: corpus.Body, streaming: bool) -> None:
    cls, kind = ERROR_KINDS[body.path]
    with pytest.raises(cls) as info:
        if streaming:
            await _stream([_served(body)])
        else:
            await _chat([_served(body)])
    err = info.value
    assert err.kind == kind, str(err)
    assert err.status == body.status
    assert err.retryable is (kind in RETRYABLE)
    assert err.provider == "anthropic"
    assert err.code == json.loads(body.data)["error"]["type"]  # e.g. rate_limit_error, not_found_error
    assert err.body is not None and json.loads(err.body) == json.loads(body.data)


async def test_rate_limit_carries_retry_after() -> None:
    (body,) = [b for b in BODIES if b.path.endswith("429_twice_then_stream.json.0.body")]
    # the recording has no retry-after header; the API sends one with 429s, added here
    with pytest.raises(RateLimitError) as info:
        await _chat([_served(body, headers={"retry-after": "7"})])
    assert info.value.retry_after == 7.0
    assert "20,000,000 prompt bytes per hour" in info.value.message


async def test_429_twice_then_stream_is_retried_to_success() -> None:
    recording = "anthropic/anthropic-sdk-python__429_twice_then_stream.json"
    responses = [RecordedResponse(ex.status, ex.body, ex.headers.get("content-type", "application/json"),
                                  headers={"retry-after": "0"} if ex.status == 429 else {})
                 for ex in corpus.exchanges(recording)]
    events, server = await _stream(responses, seed=4, retry=RetryPolicy(max_attempts=3))
    assert not any(isinstance(e, ErrorEvent) for e in events)
    assert events[-1].full_response.text == "[12345,67890]"
    assert len(server.requests) == 3
    assert server.requests[0].body == server.requests[2].body


@pytest.mark.parametrize("body", STREAM_ERRORS, ids=lambda b: b.path)
async def test_error_event_inside_a_200_stream_is_never_a_success(body: corpus.Body) -> None:
    events: list[Any] = []
    server = ReplayServer([_served(body)], seed=5)
    provider = _provider(await server.start())
    try:
        with pytest.raises(OverloadedError) as info:
            async for ev in provider.chat_stream(REQUEST):
                events.append(ev)
    finally:
        await provider.aclose()
        await server.close()
    assert not any(isinstance(e, MessageComplete) for e in events)
    assert isinstance(events[-1], ErrorEvent) and events[-1].kind == "overloaded"
    assert info.value.retryable is True


async def test_error_event_after_content_keeps_the_partial() -> None:
    (ok,) = [b for b in BODIES if b.path.endswith("dd-trace-py__stream_max_tokens.yaml.0.body")]
    (bad,) = STREAM_ERRORS
    head = ok.data[: ok.data.index(b"event: content_block_stop")]
    with pytest.raises(OverloadedError) as info:
        await _stream([RecordedResponse(200, head + bad.data, "text/event-stream")], seed=6)
    partial = info.value.partial
    assert partial is not None
    assert partial.text == 'The phrase "I think, therefore I am" (originally in Latin as'


# ---------------------------------------------------------------------------- broken streams
@pytest.mark.parametrize("cut", [0.3, 0.55, 0.8])
async def test_dropped_connection_keeps_the_text_decoded_so_far(cut: float) -> None:
    (body,) = [b for b in BODIES if b.path.endswith("pydantic-ai__thinking_stream.yaml.0.body")]
    drop = int(len(body.data) * cut)
    complete = body.data[:drop]
    complete = complete[: complete.rindex(b"\n\n") + 2]  # only whole events can have been decoded
    want = naive_message(complete)
    want_text = "".join(b["text"] for b in want["content"] if b["type"] == "text")
    want_thinking = "".join(b["thinking"] for b in want["content"] if b["type"] == "thinking")
    events: list[Any] = []
    server = ReplayServer([_served(body, drop_after=drop)], seed=9)
    provider = _provider(await server.start())
    try:
        with pytest.raises(ProviderConnectionError) as info:
            async for ev in provider.chat_stream(REQUEST):
                events.append(ev)
    finally:
        await provider.aclose()
        await server.close()
    partial = info.value.partial
    assert partial is not None
    assert want_thinking and partial.thinking == want_thinking
    assert partial.text == want_text
    assert isinstance(events[-1], ErrorEvent) and events[-1].kind == "connection"


async def test_stream_without_message_stop() -> None:
    (body,) = [b for b in BODIES if b.path.endswith("tool_use_response.sse.0.body")]
    cut = body.data[: body.data.index(b"event: message_delta")]
    with pytest.raises(ProviderConnectionError) as info:
        await _stream([RecordedResponse(200, cut, "text/event-stream")])
    partial = info.value.partial
    assert partial is not None and partial.text == "I'll check the current weather in Paris for you."
    assert [(c.name, c.input) for c in partial.tool_calls] == [("get_weather", {"location": "Paris"})]
    # nothing at all, or only message_start: a protocol error, never an empty success
    start = body.data[: body.data.index(b"event: content_block_start")]
    for data in (b"", start, b": keep-alive\n\n"):
        with pytest.raises(ProviderProtocolError):
            await _stream([RecordedResponse(200, data, "text/event-stream")])


# ---------------------------------------------------------------------------- follow-up requests
FOLLOW_UPS = [
    "anthropic/anthropic-sdk-python__tool_runner_stream.json",
    "anthropic/fantasy__parallel_tool_use.yaml",
    "anthropic/fantasy__parallel_tool_use_streaming.yaml",
    "anthropic/fantasy__thinking_tool_streaming.yaml",
    "anthropic/simonw-llm-anthropic__thinking_tool_chain_stream.yaml",
    "anthropic/simonw-llm-anthropic__tools_stream.yaml",
    "anthropic/pydantic-ai__pause_turn_web_search_stream.yaml",
]
_KEPT = {"tool_use": ("id", "name", "input"), "server_tool_use": ("id", "name", "input"),
         "thinking": ("thinking", "signature"), "redacted_thinking": ("data",)}
_ASCII = str.maketrans({"\u2013": "-", "\u2019": "'"})


def norm_content(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Blocks on the fields the protocol defines; a string is one text block."""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    out = []
    for b in content:
        kind = b["type"]
        if kind == "text":
            if b["text"].strip():  # blank text is never sent (B04); llm-anthropic recorded a " "
                out.append({"type": "text", "text": b["text"]})
        elif kind == "tool_result":
            out.append({"type": kind, "tool_use_id": b["tool_use_id"], "content": norm_content(b.get("content") or []),
                        "is_error": bool(b.get("is_error"))})
        elif kind == "web_search_tool_result":
            # pydantic-ai's recorded request has ASCII "-" and "'" where the answer's result
            # titles have "\u2013" and "\u2019": compare titles with those folded
            out.append({"type": kind, "tool_use_id": b["tool_use_id"],
                        "content": [{**r, "title": r["title"].translate(_ASCII)} if "title" in r else r
                                    for r in b["content"]]})
        else:
            out.append({"type": kind, **{k: b[k] for k in _KEPT.get(kind, tuple(b))}})
    return out


def norm_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": m["role"], "content": norm_content(m["content"])} for m in messages]


def _text_of(content: str | list[dict[str, Any]]) -> str:
    return "".join(b["text"] for b in norm_content(content) if b["type"] == "text")


def request_like(recorded: dict[str, Any], history: list[Any]) -> MessageRequest:
    """A neutral request asking for what the recorded request asked for (besides its messages)."""
    tools = [ToolDefinition(t["name"], t.get("description", ""), t["input_schema"])
             for t in recorded.get("tools") or [] if "input_schema" in t]
    server_tools = [t for t in recorded.get("tools") or [] if "input_schema" not in t]
    choice = recorded.get("tool_choice") or {}
    thinking = recorded.get("thinking") or {}
    return MessageRequest(
        model=recorded["model"], messages=tuple(history), tools=tuple(tools),
        tool_choice=choice.get("type"), max_tokens=recorded["max_tokens"], temperature=recorded.get("temperature"),
        parallel_tool_calls=(not choice["disable_parallel_tool_use"]) if "disable_parallel_tool_use" in choice else None,
        thinking=ThinkingConfig(budget_tokens=thinking["budget_tokens"]) if thinking.get("type") == "enabled" else None,
        extra={"body": {"tools": server_tools}} if server_tools else {},
    )


@pytest.mark.parametrize("recording", FOLLOW_UPS)
async def test_follow_up_request_replays_the_decoded_answer(recording: str) -> None:
    first, second = corpus.exchanges(recording)[:2]
    streaming = bool(first.request.get("stream"))
    answer = RecordedResponse(first.status, first.body, first.headers.get("content-type", "application/json"))
    if streaming:
        events, _ = await _stream([answer], seed=12)
        response = events[-1].full_response
    else:
        response, _ = await _chat([answer], seed=12)
    recorded = second.request
    msgs = recorded["messages"]
    assert [m["role"] for m in msgs[:2]] == ["user", "assistant"]
    history: list[Any] = []
    system = recorded.get("system")
    if system:
        history.append(SystemMessage(_text_of(system)))
    history += [UserMessage(_text_of(msgs[0]["content"])), response.message]
    for m in msgs[2:]:
        for b in m["content"]:
            assert b["type"] == "tool_result"
            history.append(ToolResultMessage(b["tool_use_id"], _text_of(b.get("content") or ""),
                                             is_error=bool(b.get("is_error"))))
    provider = _provider("http://127.0.0.1:9")
    body = provider.build_body(request_like(recorded, history), stream=streaming)
    await provider.aclose()
    assert norm_messages(body["messages"]) == norm_messages(msgs)
    for key in ("model", "max_tokens", "temperature", "tool_choice", "tools", "stream"):
        assert body.get(key) == recorded.get(key), key
    if system:
        assert norm_content(body["system"]) == norm_content(system)
    if recorded.get("thinking"):
        assert body["thinking"] == {k: recorded["thinking"][k] for k in ("type", "budget_tokens")}
    # the replayed assistant turn really carries what the first answer had
    sent = body["messages"][1]["content"]
    kinds = [b["type"] for b in sent]
    assert kinds.count("tool_use") == len(response.tool_calls)
    if any(isinstance(b, ThinkingBlock) for b in response.content):
        assert sent[0]["type"] == "thinking" and sent[0]["signature"] == response.content[0].signature


async def test_tool_result_without_its_call_is_rejected_as_invalid_history() -> None:
    """The recorded second request dropped the assistant turn. fsm_agent refuses it before sending,
    with the same InvalidHistoryError the API's recorded 400 maps to."""
    recording = "anthropic/anthropic-sdk-python__tool_result_mismatch_400.json"
    first, second = corpus.exchanges(recording)
    served = [RecordedResponse(ex.status, ex.body, "application/json") for ex in (first, second)]
    server = ReplayServer(served)
    provider = _provider(await server.start())
    try:
        answer = await provider.chat(REQUEST)
        assert [(c.id, c.input) for c in answer.tool_calls] == [
            ("toolu_01GHndag5wQmbzNihYmV2UBj", {"location": "San Francisco, CA", "units": "c"})]
        broken = [UserMessage("What's the weather in SF in Celsius?"),
                  ToolResultMessage("toolu_01GHndag5wQmbzNihYmV2UBj", "sunny, 20°C")]
        with pytest.raises(InvalidHistoryError) as info:
            await provider.chat(MessageRequest(model="claude-haiku-4-5", messages=tuple(broken)))
    finally:
        await provider.aclose()
        await server.close()
    assert info.value.retryable is False
    assert "toolu_01GHndag5wQmbzNihYmV2UBj" in str(info.value) and "answers no earlier tool call" in str(info.value)
    assert len(server.requests) == 1  # refused before it was sent
    # the API's own answer to that request is the same error
    from fsm_agent.providers.errors import classify_error

    assert isinstance(classify_error(second.status, orjson.loads(second.body), provider="anthropic"),
                      InvalidHistoryError)


# ---------------------------------------------------------------------------- cases B02 / B04


def repaired(messages: list[Any], synthesized: list[dict[str, Any]]) -> list[Any]:
    """What the repair pipeline hands over: every call answered right after its turn, in call order."""
    texts = {"unavailable": "Tool result unavailable (the result was lost).",
             "cancelled": "Tool call cancelled before it finished."}
    notes = {s["tool_call_id"]: s for s in synthesized}
    results = {m.tool_call_id: m for m in messages if isinstance(m, ToolResultMessage)}
    out: list[Any] = []
    for m in messages:
        if isinstance(m, ToolResultMessage):
            continue
        out.append(m)
        for call in m.tool_calls if isinstance(m, AssistantMessage) else ():
            if call.id in results:
                out.append(results[call.id])
            else:
                note = notes[call.id]
                out.append(ToolResultMessage(call.id, texts[note["content_mentions"]], is_error=note["is_error"],
                                             metadata={"synthetic": note["content_mentions"]}))
    return out


def _types(message: dict[str, Any]) -> list[str]:
    return [b["type"] for b in message["content"]]


def _all_text_blocks(wire: list[dict[str, Any]]) -> list[str]:
    return [b["text"] for m in wire for b in m["content"] if b["type"] == "text"]


def test_b02_tool_results_filtered_out_of_history() -> None:
    case = json.loads(corpus.case("B02.json").read_text())["cases"][0]
    want = json.loads(corpus.case("B02.expected.json").read_text())[case["name"]]
    history = repaired(case_messages(case["messages"]), want["synthesized"])
    assert [m.role for m in history] == want["repaired_roles"]
    system, wire = messages_to_wire(history)
    assert system == "You help with accounts payable."
    assert [m["role"] for m in wire] == want["anthropic_body_roles"]
    assert _types(wire[2]) == want["anthropic_message_2_content_types"]
    assert wire[2]["content"][0]["tool_use_id"] == "toolu_PH_01" and wire[2]["content"][0]["is_error"] is True
    assert "unavailable" in wire[2]["content"][0]["content"]
    assert wire[1]["content"][0] == {"type": "text", "text": "Let me look that up."}
    assert wire[1]["content"][1] == {"type": "tool_use", "id": "toolu_PH_01", "name": "lookup_invoice",
                                     "input": {"invoice_id": "INV-PH-001"}}


def test_b02_interrupted_between_parallel_tools() -> None:
    case = json.loads(corpus.case("B02.json").read_text())["cases"][1]
    want = json.loads(corpus.case("B02.expected.json").read_text())[case["name"]]
    history = repaired(case_messages(case["messages"]), want["synthesized"])
    assert [m.role for m in history] == want["repaired_roles"]
    _, wire = messages_to_wire(history)
    assert [m["role"] for m in wire] == want["anthropic_body_roles"]
    assert _types(wire[-1]) == want["anthropic_merged_user_content_types"]
    results = wire[-1]["content"]
    assert [r["tool_use_id"] for r in results[:2]] == ["toolu_PH_10", "toolu_PH_11"]
    assert results[0] == {"type": "tool_result", "tool_use_id": "toolu_PH_10", "content": "build-a: 12 ms"}
    assert results[1]["is_error"] is True and "cancelled" in results[1]["content"]
    assert results[2] == {"type": "text", "text": "Stop, never mind. Just tell me what you found so far."}
    # results that arrive out of call order, after the user's text, still go first in call order
    shuffled = [history[0], history[1], history[4], history[3], history[2]]
    _, wire2 = messages_to_wire(shuffled)
    assert [b.get("tool_use_id", b["type"]) for b in wire2[-1]["content"]] == ["toolu_PH_10", "toolu_PH_11", "text"]


def test_b04_empty_text_blocks_and_empty_assistant_turns() -> None:
    case = json.loads(corpus.case("B04.json").read_text())
    want = json.loads(corpus.case("B04.expected.json").read_text())["anthropic"]
    history = case_messages(case["messages"])
    assert isinstance(history[1], AssistantMessage) and history[1].content[0] == TextBlock("")
    _, wire = messages_to_wire(history)
    assert [m["role"] for m in wire] == want["roles"]
    assert all(t.strip() for t in _all_text_blocks(wire)) is want["no_text_block_with_empty_or_whitespace_only_text"]
    assert _types(wire[1]) == want["assistant_1_content_types"]
    assert _types(wire[3]) == want["assistant_3_content_types"]
    assert _types(wire[-1]) == want["last_user_content_types"]
    assert wire[-1]["content"][0]["tool_use_id"] == "toolu_PH_21"
    assert wire[-1]["content"][1]["text"] == "Hello? Did you get that?"
    assert wire[3]["content"][0]["input"] == {"day": "2026-01-15"}


# ---------------------------------------------------------------------------- request mapping
def _body(**kw: Any) -> dict[str, Any]:
    provider = _provider("http://127.0.0.1:9")
    kw.setdefault("messages", (UserMessage("hi"),))
    return provider.build_body(MessageRequest(model="claude-x", **kw), stream=False)


def test_body_basics_and_max_tokens_default() -> None:
    body = _body(stop=("END",), temperature=0.2, top_p=0.9)
    assert body == {"model": "claude-x", "max_tokens": 8192, "stop_sequences": ["END"], "temperature": 0.2,
                    "top_p": 0.9, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert _body(max_tokens=100)["max_tokens"] == 100
    from fsm_agent.providers.profiles import PROFILES

    bare = AnthropicProvider(evolve(PROFILES["anthropic"], capabilities=evolve(PROFILES["anthropic"].capabilities,
                                                                                max_output_tokens=None)),
                             ProviderConfig(base_url="http://127.0.0.1:9/v1", api_key="k"))
    assert bare.build_body(REQUEST, stream=True)["max_tokens"] == DEFAULT_MAX_TOKENS == 4096
    assert bare.build_body(REQUEST, stream=True)["stream"] is True


def test_body_system_tools_thinking_and_extra() -> None:
    tool = ToolDefinition("get_weather", "Weather for a city",
                          {"type": "object", "properties": {"city": {"type": "string"}}}, strict=True)
    body = _body(messages=(SystemMessage("A"), UserMessage("hi"), SystemMessage("B")), tools=(tool,),
                 tool_choice="required", parallel_tool_calls=False, thinking=ThinkingConfig(budget_tokens=2048),
                 response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
                 extra={"body": {"metadata": {"user_id": "u1"}, "temperature": 1}})
    assert body["system"] == [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]
    assert body["tools"] == [{"name": "get_weather", "description": "Weather for a city",
                              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    assert body["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert body["output_config"] == {"format": {"type": "json_schema", "schema": {"type": "object"}}}
    assert body["metadata"] == {"user_id": "u1"} and body["temperature"] == 1
    assert _body(thinking=ThinkingConfig())["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert _body(thinking=ThinkingConfig(enabled=False))["thinking"] == {"type": "disabled"}
    assert "tool_choice" not in _body(tool_choice="auto")  # no tools: no tool_choice
    assert "system" not in _body(messages=(SystemMessage("  "), UserMessage("x")))


@pytest.mark.parametrize(("choice", "parallel", "want"), [
    (None, None, None),
    ("auto", None, {"type": "auto"}),
    ("any", None, {"type": "any"}),
    ("required", None, {"type": "any"}),
    ("none", False, {"type": "none"}),
    ({"name": "f"}, None, {"type": "tool", "name": "f"}),
    ({"type": "function", "function": {"name": "f"}}, True, {"type": "tool", "name": "f", "disable_parallel_tool_use": False}),
    ({"type": "tool", "name": "f"}, None, {"type": "tool", "name": "f"}),
    (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
])
def test_tool_choice_mapping(choice: Any, parallel: bool | None, want: Any) -> None:
    assert tool_choice_to_wire(choice, parallel) == want


@pytest.mark.parametrize("choice", ["sometimes", {"type": "tool"}, {"foo": 1}])
def test_unknown_tool_choice_is_a_configuration_error(choice: Any) -> None:
    with pytest.raises(ConfigurationError):
        tool_choice_to_wire(choice)


PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n0000").decode()
PDF = base64.b64encode(b"%PDF-1.4 ...").decode()


def test_user_images_and_documents() -> None:
    _, wire = messages_to_wire([
        UserMessage((TextBlock("look"), ImageBlock(data=PNG),
                     ImageBlock(url="https://example.com/cat.jpg"), ImageBlock(url=f"data:image/gif;base64,{PNG}"))),
        UserImageMessage(PNG, "image/png"),
        UserImageMessage("https://example.com/dog.png", "image/png"),
        UserMessage((FileBlock(data=PDF, media_type="application/pdf", filename="a.pdf"),
                     FileBlock(data=base64.b64encode("plain ü".encode()).decode(), media_type="text/plain"),
                     FileBlock(url="https://example.com/b.pdf"), FileBlock(file_id="file_011"))),
    ])
    assert len(wire) == 1  # four user turns in a row: one message
    sources = [b.get("source") for b in wire[0]["content"]]
    assert wire[0]["content"][0] == {"type": "text", "text": "look"}
    assert sources[1:] == [
        {"type": "base64", "media_type": "image/png", "data": PNG},
        {"type": "url", "url": "https://example.com/cat.jpg"},
        {"type": "base64", "media_type": "image/gif", "data": PNG},
        {"type": "base64", "media_type": "image/png", "data": PNG},
        {"type": "url", "url": "https://example.com/dog.png"},
        {"type": "base64", "media_type": "application/pdf", "data": PDF},
        {"type": "text", "media_type": "text/plain", "data": "plain ü"},
        {"type": "url", "url": "https://example.com/b.pdf"},
        {"type": "file", "file_id": "file_011"},
    ]
    assert wire[0]["content"][6]["title"] == "a.pdf"
    with pytest.raises(InvalidRequestError) as info:
        messages_to_wire([UserMessage((AudioBlock("AAAA", "wav"),))])
    assert info.value.retryable is False


def test_assistant_blocks_by_source() -> None:
    ext = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "q"}}
    cite = {"type": "web_search_result_location", "url": "https://a", "title": "A", "cited_text": "x",
            "encrypted_index": "E"}
    history = [
        UserMessage("q"),
        AssistantMessage((
            ThinkingBlock("mine", "sig", source="anthropic"),
            ThinkingBlock("", redacted_data="opaque", source="anthropic"),
            ThinkingBlock("other", source="openai-responses", provider_data={"id": "rs_1"}),
            ThinkingBlock("deepseek", source="openai-chat"),
            ThinkingBlock("foreign", signature="sig-x", source="openai-responses"),
            ThinkingBlock("", redacted_data="foreign", source="openai-chat"),
            ThinkingBlock("unsigned", source="anthropic"),
            ExtensionBlock("server_tool_use", {k: v for k, v in ext.items() if k != "type"}, "anthropic"),
            ExtensionBlock("web_search_call", {"id": "ws_1"}, "openai-responses"),
            TextBlock("answer", (cite, {"type": "url_citation", "url": "https://b"})),
            TextBlock("  "),
            ToolUseBlock("toolu_1", "f", {"a": 1}, provider_data={"anthropic": {"caller": {"type": "direct"}}}),
            ToolUseBlock("toolu_2", "g", {}, raw_input="{not json"),
        )),
        ToolResultMessage("toolu_2", "bad arguments", is_error=True),
        ToolResultMessage("toolu_1", ""),
    ]
    _, wire = messages_to_wire(history)
    assert wire[1]["content"] == [
        {"type": "thinking", "thinking": "mine", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"},
        ext,
        {"type": "text", "text": "answer", "citations": [cite]},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}, "caller": {"type": "direct"}},
        {"type": "tool_use", "id": "toolu_2", "name": "g", "input": {}},
    ]
    assert wire[2]["content"] == [{"type": "tool_result", "tool_use_id": "toolu_1"},
                                  {"type": "tool_result", "tool_use_id": "toolu_2", "content": "bad arguments",
                                   "is_error": True}]


def test_tool_result_blocks_with_images_and_whole_turn_dropping() -> None:
    history = [
        UserMessage("a"),
        AssistantMessage((ToolUseBlock("t1", "shot", {}),)),
        UserMessage((ToolResultBlock("t1", (TextBlock("here"), ImageBlock(data=PNG, media_type="image/png"))),)),
        AssistantMessage((TextBlock(""), ThinkingBlock("x", source="openai-chat"))),  # nothing sendable
        UserMessage("b"),
    ]
    _, wire = messages_to_wire(history)
    assert [m["role"] for m in wire] == ["user", "assistant", "user"]
    assert wire[2]["content"] == [
        {"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "here"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]},
        {"type": "text", "text": "b"},
    ]


# ---------------------------------------------------------------------------- response and parser
def test_parse_message_fields() -> None:
    data = {
        "id": "msg_1", "model": "claude-x", "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": ""}, {"type": "text", "text": "hi", "citations": None},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
                    {"type": "mcp_tool_use", "id": "m1", "name": "x", "server_name": "s", "input": {}}],
        "stop_reason": "stop_sequence", "stop_sequence": "END", "container": {"id": "c1"},
        "usage": {"input_tokens": 10, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 5,
                  "output_tokens": 7},
    }
    resp = parse_message(data, "anthropic")
    assert resp.content == (TextBlock("hi"), ToolUseBlock("toolu_1", "f", {"a": 1}),
                            ExtensionBlock("mcp_tool_use", data["content"][3], "anthropic"))
    assert resp.stop_reason is ModelStopReason.STOP_SEQUENCE and resp.raw_stop_reason == "stop_sequence"
    assert resp.extra == {"stop_sequence": "END", "container": {"id": "c1"}}
    u = resp.usage
    assert u is not None and (u.input_tokens, u.cache_read_tokens, u.cache_write_tokens, u.output_tokens) == (115, 100, 5, 7)
    assert parse_message({"id": "m", "model": "x", "content": []}).usage is None
    assert parse_message({"content": [], "stop_reason": "model_context_window_exceeded"}).stop_reason \
        is ModelStopReason.MAX_TOKENS
    assert parse_message({"content": [], "stop_reason": "something_new"}).stop_reason is ModelStopReason.END_TURN


def _feed(events: list[tuple[str, Any]]) -> tuple[AnthropicStreamParser, list[Any]]:
    parser = AnthropicStreamParser()
    out: list[Any] = []
    for name, payload in events:
        data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
        out += parser.feed(ServerSentEvent(data, name))
    return parser, out


START = ("message_start", {"type": "message_start", "message": {
    "id": "msg_x", "model": "claude-x", "usage": {"input_tokens": 5, "output_tokens": 1}}})
STOP = ("message_stop", {"type": "message_stop"})


def test_parser_edges() -> None:
    parser, out = _feed([
        START,
        ("ping", "not even json"),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": "Hel"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "lo"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "brand_new_delta", "x": 1}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("future_event", {"type": "future_event"}),
        ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": {
            "type": "tool_use", "id": "toolu_9", "name": "f", "input": {"given": True}}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ("content_block_start", {"type": "content_block_start", "index": 2, "content_block": {"type": "text", "text": ""}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 2}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                           "usage": {"output_tokens": 9, "cache_read_input_tokens": 20}}),
        STOP,
        ("content_block_start", {"type": "content_block_start", "index": 3, "content_block": {"type": "text"}}),
    ])
    resp = parser.finish()[-1].full_response
    assert resp.text == "Hello"
    assert resp.tool_calls == (ToolUseBlock("toolu_9", "f", {"given": True}),)
    assert [e for e in out if isinstance(e, ToolCallEnd)][0].call.input == {"given": True}
    assert len(resp.content) == 2 and len([e for e in out if isinstance(e, ContentBlockStart)]) == 2
    assert resp.usage is not None and (resp.usage.input_tokens, resp.usage.output_tokens) == (25, 9)
    assert [e.usage.output_tokens for e in out if isinstance(e, CostUpdate)] == [1, 9]
    with pytest.raises(ProviderProtocolError):
        _feed([START, ("content_block_delta", {"type": "content_block_delta", "index": 5,
                                               "delta": {"type": "text_delta", "text": "x"}})])
    with pytest.raises(ProviderProtocolError):
        _feed([("message_start", "{not json")])
    with pytest.raises(OverloadedError):  # an error payload without the event name is still an error
        _feed([START, ("message", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})])
    for data in ("upstream exploded", '"upstream exploded"'):  # not JSON; JSON but no object
        with pytest.raises(ProviderError) as info:
            _feed([START, ("error", data)])
        assert "upstream exploded" in str(info.value) and info.value.kind == "stream_error"
    with pytest.raises(ProviderProtocolError):
        _feed([START, ("message_delta", "[1, 2]")])


def test_parser_citations_before_text_travel_in_the_start_event() -> None:
    cite = {"type": "web_search_result_location", "url": "https://a", "title": "A", "cited_text": "c",
            "encrypted_index": "E"}
    parser, out = _feed([
        START,
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": "", "citations": []}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "citations_delta", "citation": cite}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "cited"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "citations_delta", "citation": {**cite, "url": "https://b"}}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}}),
        STOP,
    ])
    starts = [e for e in out if isinstance(e, ContentBlockStart)]
    assert starts == [ContentBlockStart(0, "text", data={"citations": [cite]})]
    assert isinstance(out[out.index(starts[0]) + 1], TextDelta)
    resp = parser.finish()[-1].full_response
    assert resp.content == (TextBlock("cited", (cite, {**cite, "url": "https://b"})),)
