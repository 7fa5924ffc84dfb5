"""Cases B07, B08, B10, B11, B12, B15, B16, B18 and B20 (../shared/cases) through the real HTTP path.

Each stream is served by a local aiohttp server (``ReplayServer``) and read by
``OpenAIChatProvider.chat_stream`` exactly as a live stream would be.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from corpus import CASES
from fsm_agent.errors import ContextLengthExceededError, ProviderProtocolError
from fsm_agent.providers import ProviderConfig, create_provider
from fsm_agent.providers.openai_chat import OpenAIChatStreamParser, messages_to_wire
from fsm_agent.providers.sse import SSEDecoder
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import (
    AssistantMessage,
    MessageComplete,
    MessageRequest,
    MessageResponse,
    ModelStopReason,
    PartialMessageResponse,
    TextBlock,
    ToolUseBlock,
    UserMessage,
)
from fsm_agent.types.stream import ContentBlockStart, TextDelta


def expected(name: str) -> dict[str, Any]:
    return json.loads((CASES / f"{name}.expected.json").read_text())


def sse(name: str) -> bytes:
    return (CASES / name).read_bytes()


REQUEST = MessageRequest(model="test-model", messages=(UserMessage("hi"),))


async def stream_through_http(body: bytes, *, chunk_sizes: list[int] | None = None, seed: int | None = None,
                              cuts: list[int] | None = None, config: ProviderConfig | None = None) -> tuple[MessageResponse, list[Any]]:
    if cuts is not None:
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, len(body)])]
        chunk_sizes = sizes
    server = ReplayServer([RecordedResponse(200, body, "text/event-stream")], chunk_sizes=chunk_sizes, seed=seed)
    base = await server.start()
    provider = create_provider("openai-compatible", config or ProviderConfig(base_url=base, model="test-model", api_key="k"))
    events = []
    try:
        async for ev in provider.chat_stream(REQUEST):
            events.append(ev)
    finally:
        await provider.aclose()
        await server.close()
    final = events[-1]
    assert isinstance(final, MessageComplete)
    # the events re-applied give the same response: MessageComplete is the aggregate of the deltas
    partial = PartialMessageResponse(provider=final.full_response.provider, source="openai-chat")
    for ev in events:
        partial.apply(ev)
    partial.set_stop_reason(final.full_response.stop_reason, final.full_response.raw_stop_reason)
    rebuilt = partial.finalize()
    assert rebuilt.message == final.full_response.message
    return final.full_response, events


def calls_of(resp: MessageResponse) -> list[dict[str, Any]]:
    return [{"id": c.id, "name": c.name, "arguments": c.input} for c in resp.tool_calls]


async def test_b07_index_starts_at_1_and_id_only_in_first_delta() -> None:
    exp = expected("B07")
    resp, events = await stream_through_http(sse("B07.sse"), seed=7)
    assert calls_of(resp) == exp["tool_calls"]
    assert resp.raw_stop_reason == exp["finish_reason"] == "tool_calls"
    assert resp.stop_reason is ModelStopReason.TOOL_USE
    assert resp.text == exp["text"]
    # empty-string content deltas create no text part
    assert not any(isinstance(b, TextBlock) for b in resp.message.content)
    assert not any(isinstance(e, ContentBlockStart) and e.block_type == "text" for e in events)


async def test_b08_same_index_new_id_starts_a_new_call() -> None:
    exp = expected("B08")
    resp, _ = await stream_through_http(sse("B08.sse"), chunk_sizes=[3, 11, 1])
    assert calls_of(resp) == exp["tool_calls"]
    assert [c.name for c in resp.tool_calls] == ["read_file", "search_text"]  # never "read_filesearch_text"
    assert resp.raw_stop_reason == exp["finish_reason"]


async def test_b10_argument_text_in_the_defining_delta_is_kept() -> None:
    exp = expected("B10")
    resp, _ = await stream_through_http(sse("B10.sse"), seed=10)
    assert calls_of(resp) == exp["tool_calls"]
    assert resp.tool_calls[0].input == {"query": "q3 budget", "limit": 5}


async def test_b11_null_arguments_mean_empty_object_and_serialize_back_as_json_string() -> None:
    exp = expected("B11")
    resp, _ = await stream_through_http(sse("B11.sse"), seed=11)
    assert calls_of(resp) == exp["tool_calls"]
    assert resp.tool_calls[0].raw_input is None  # a complete, valid call
    wire = messages_to_wire((UserMessage("time?"), resp.message))
    assert wire[1]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert wire[1]["content"] is None


async def test_b11_call_is_executed_exactly_once() -> None:
    from fsm_agent import Agent, tool
    from fsm_agent.providers.scripted import ScriptedProvider

    calls = []

    @tool
    def get_current_time() -> str:
        """Current time."""
        calls.append(1)
        return "12:00"

    resp, _ = await stream_through_http(sse("B11.sse"))
    agent = Agent(ScriptedProvider([resp, "It is noon."]), tools=[get_current_time])
    result = await agent.run("what time is it")
    assert calls == [1]
    assert result.output == "It is noon."


@pytest.mark.parametrize("variant", ["B12.sse", "B12.no_usage.sse"])
async def test_b12_empty_choices_chunks_never_fail(variant: str) -> None:
    exp = expected("B12")
    resp, _ = await stream_through_http(sse(variant), seed=12)
    assert resp.text == exp["text"]
    assert resp.raw_stop_reason == exp["finish_reason"]
    assert resp.model == exp["model"]  # the preamble's empty model does not overwrite it
    assert resp.id == "chatcmpl-PH_B12"
    if variant == "B12.sse":
        assert (resp.usage.input_tokens, resp.usage.output_tokens) == (21, 7)
    else:
        assert resp.usage is None  # unknown, never zero


async def test_b12_unknown_usage_is_estimated_and_flagged_in_the_run() -> None:
    from fsm_agent import Agent
    from fsm_agent.providers.scripted import ScriptedProvider

    resp, _ = await stream_through_http(sse("B12.no_usage.sse"))
    result = await Agent(ScriptedProvider([resp])).run("capital of France?", max_tokens=1000)
    assert result.usage.estimated is True
    assert result.usage.input_tokens > 0 and result.usage.output_tokens > 0
    assert result.output == "Paris is the capital."


async def test_b15_utf8_split_across_reads_given_cuts() -> None:
    exp = expected("B15")
    cuts = json.loads((CASES / "B15.chunks.json").read_text())["split_at_byte_offsets"]
    resp, _ = await stream_through_http(sse("B15.sse"), cuts=cuts)
    assert resp.text == exp["text"]
    assert calls_of(resp) == exp["tool_calls"]
    assert "\ufffd" not in resp.text and "\ufffd" not in orjson.dumps(resp.tool_calls[0].input).decode()


async def test_b15_byte_by_byte_over_http() -> None:
    exp = expected("B15")
    resp, _ = await stream_through_http(sse("B15.sse"), chunk_sizes=[1])
    assert resp.text == exp["text"]
    assert calls_of(resp) == exp["tool_calls"]


def test_b15_every_single_cut_point() -> None:
    exp = expected("B15")
    body = sse("B15.sse")
    for cut in range(len(body) + 1):
        d, p = SSEDecoder(), OpenAIChatStreamParser("t")
        events = []
        for part in (body[:cut], body[cut:]):
            for ev in d.feed(part):
                events += p.feed(ev)
        for ev in d.flush():
            events += p.feed(ev)
        events += p.finish()
        resp = events[-1].full_response
        assert resp.text == exp["text"], cut
        assert calls_of(resp) == exp["tool_calls"], cut


async def test_b16_comments_keepalives_multiline_data() -> None:
    exp = expected("B16")
    resp, events = await stream_through_http(sse("B16.sse"), seed=16)
    assert resp.text == exp["text"] == "Hello world"
    assert resp.raw_stop_reason == exp["finish_reason"]
    d = SSEDecoder()
    dispatched = d.feed(sse("B16.sse")) + d.flush()
    assert len(dispatched) == exp["dispatched_data_events_including_done"] == 5
    assert dispatched[2].data == exp["event_3_data_exact"]
    assert dispatched[-1].data == "[DONE]"
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["Hel", "lo", " world"]


async def test_b18_one_event_larger_than_aiohttp_line_limit() -> None:
    exp = expected("B18")["tool_calls"][0]
    resp, _ = await stream_through_http(sse("B18.sse"), chunk_sizes=[65536, 4093, 1])
    (call,) = resp.tool_calls
    assert (call.id, call.name) == (exp["id"], exp["name"])
    assert sorted(call.input) == sorted(exp["arguments_keys"])
    assert len(call.input["content"]) == exp["content_length"] == 655360


async def test_b18_above_the_configured_ceiling_is_a_clear_error() -> None:
    body = sse("B18.sse")
    server = ReplayServer([RecordedResponse(200, body, "text/event-stream")], chunk_sizes=[8192])
    base = await server.start()
    provider = create_provider("openai-compatible", ProviderConfig(base_url=base, model="m", api_key="k",
                                                                   max_event_bytes=256 * 1024))
    try:
        with pytest.raises(ProviderProtocolError, match="262144 byte limit"):
            async for _ in provider.chat_stream(REQUEST):
                pass
    finally:
        await provider.aclose()
        await server.close()


def test_b20_llama_cpp_error_inside_a_200_stream_is_context_length() -> None:
    case = next(c for c in json.loads((CASES / "B20.json").read_text())["cases"] if c["name"] == "llama_cpp_midstream")
    body = b"data: " + orjson.dumps(case["sse_data"]) + b"\n\n"
    p = OpenAIChatStreamParser("llamacpp")
    d = SSEDecoder()
    with pytest.raises(ContextLengthExceededError):
        for ev in d.feed(body):
            p.feed(ev)


def test_tool_call_without_text_serializes_content_null_and_blank_assistant_is_dropped() -> None:
    msgs = (
        UserMessage("q"),
        AssistantMessage((TextBlock(""), ToolUseBlock("c1", "f", {"x": 1}))),
        AssistantMessage(" \n"),
    )
    wire = messages_to_wire(msgs)
    # the call, never answered, gets the error result every protocol sends for it (the wire refuses
    # a call without one); the blank turn after it is dropped
    assert [m["role"] for m in wire] == ["user", "assistant", "tool"]
    assert wire[1]["content"] is None
    assert json.loads(wire[1]["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
