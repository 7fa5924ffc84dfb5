"""An output schema on the wire, per protocol and profile, through the real HTTP path.

Every provider here talks to a local :class:`ReplayServer`; the assertions read the request body
the server received and the answer the provider decoded, then check it with ``parse_output``.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from attrs import evolve

from fsm_agent.errors import ConfigurationError
from fsm_agent.providers import PROFILES, ProviderConfig, RetryPolicy, ToolMode, create_provider
from fsm_agent.providers.base import HttpProvider
from fsm_agent.providers.constrained import tool_call_schema
from fsm_agent.structured import parse_output, structured_call
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import (
    AssistantMessage,
    MessageComplete,
    MessageRequest,
    MessageResponse,
    ModelStopReason,
    OutputSchema,
    SystemMessage,
    TextBlock,
    TextDelta,
    ThinkingConfig,
    ToolCallEnd,
    ToolDefinition,
    ToolUseBlock,
    UserMessage,
)

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}
SCHEMA = OutputSchema("city_info", CITY, "The largest city of the country")
ANSWER = {"city": "Paris", "population": 2100000}
REQ = MessageRequest("", (SystemMessage("Be brief."), UserMessage("Largest city of France?")), output_schema=SCHEMA)
WEATHER = ToolDefinition("get_weather", "Weather for a city",
                         {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


# ---------------------------------------------------------------------------- wire bodies of the answers
def chat_json(content: str | None = None, tool_calls: list[dict[str, Any]] | None = None) -> RecordedResponse:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    body = {"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "message": msg,
                                                           "finish_reason": "tool_calls" if tool_calls else "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5}}
    return RecordedResponse(200, orjson.dumps(body))


def chat_sse(content: str) -> RecordedResponse:
    chunks = [{"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    for i in range(0, len(content), 7):
        chunks.append({"id": "chatcmpl-1", "model": "m",
                       "choices": [{"index": 0, "delta": {"content": content[i:i + 7]}}]})
    chunks.append({"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    data = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    return RecordedResponse(200, data, "text/event-stream")


def responses_json(text: str) -> RecordedResponse:
    body = {"id": "resp_1", "object": "response", "model": "m", "status": "completed",
            "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "usage": {"input_tokens": 10, "output_tokens": 5}}
    return RecordedResponse(200, orjson.dumps(body))


def anthropic_json(content: list[dict[str, Any]], stop: str = "end_turn") -> RecordedResponse:
    body = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude", "content": content,
            "stop_reason": stop, "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 5}}
    return RecordedResponse(200, orjson.dumps(body))


def anthropic_tool_sse(name: str, args: dict[str, Any], preamble: str = "") -> RecordedResponse:
    def ev(kind: str, data: dict[str, Any]) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"

    out = [ev("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude",
                                            "content": [], "stop_reason": None,
                                            "usage": {"input_tokens": 10, "output_tokens": 1}}})]
    idx = 0
    if preamble:
        out += [ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
                ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": preamble}}),
                ev("content_block_stop", {"index": 0})]
        idx = 1
    text = orjson.dumps(args).decode()
    out.append(ev("content_block_start", {"index": idx, "content_block": {"type": "tool_use", "id": "toolu_1",
                                                                          "name": name, "input": {}}}))
    for i in range(0, len(text), 5):
        out.append(ev("content_block_delta", {"index": idx, "delta": {"type": "input_json_delta",
                                                                      "partial_json": text[i:i + 5]}}))
    out += [ev("content_block_stop", {"index": idx}),
            ev("message_delta", {"delta": {"stop_reason": "tool_use", "stop_sequence": None},
                                 "usage": {"output_tokens": 9}}),
            ev("message_stop", {})]
    return RecordedResponse(200, b"".join(out), "text/event-stream")


# ---------------------------------------------------------------------------- plumbing
def _provider(kind: str, base: str, profile_caps: dict[str, Any] | None = None, **config: Any) -> HttpProvider:
    config.setdefault("retry", RetryPolicy(max_attempts=1))
    provider = create_provider(kind, ProviderConfig(base_url=base + "/v1", api_key="k", model="m", **config))
    assert isinstance(provider, HttpProvider)
    if profile_caps:
        provider.profile = evolve(provider.profile, capabilities=evolve(provider.profile.capabilities, **profile_caps))
    return provider


async def _call(kind: str, responses: list[RecordedResponse], request: MessageRequest = REQ, *,
                stream: bool = False, caps: dict[str, Any] | None = None,
                **config: Any) -> tuple[MessageResponse, list[Any], list[dict[str, Any]]]:
    """(final response, streamed events, request bodies the server received)."""
    server = ReplayServer(responses, seed=11)
    provider = _provider(kind, await server.start(), caps, **config)
    events: list[Any] = []
    try:
        if stream:
            async for ev in provider.chat_stream(request):
                events.append(ev)
            final = events[-1].full_response
        else:
            final = await provider.chat(request)
    finally:
        await provider.aclose()
        await server.close()
    return final, events, [r.json() for r in server.requests]


# ---------------------------------------------------------------------------- OpenAI Chat Completions
@pytest.mark.parametrize("stream", [False, True])
async def test_chat_sends_json_schema_response_format(stream: bool) -> None:
    text = orjson.dumps(ANSWER).decode()
    final, _, bodies = await _call("openai", [chat_sse(text) if stream else chat_json(text)], stream=stream)
    assert bodies[0]["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "city_info", "schema": CITY, "strict": True, "description": "The largest city of the country"}}
    assert bodies[0]["messages"][0] == {"role": "system", "content": "Be brief."}  # no prompt added
    assert parse_output(final, SCHEMA).value == ANSWER


async def test_chat_strict_false_and_tools_alongside() -> None:
    req = evolve(REQ, output_schema=evolve(SCHEMA, strict=False, description=""), tools=(WEATHER,))
    _, _, bodies = await _call("openai", [chat_json("{}")], req)
    assert bodies[0]["response_format"]["json_schema"] == {"name": "city_info", "schema": CITY, "strict": False}
    assert bodies[0]["tools"][0]["function"]["name"] == "get_weather"  # native tools are untouched


async def test_an_explicit_response_format_wins_on_the_wire() -> None:
    req = evolve(REQ, response_format={"type": "json_object"})
    _, _, bodies = await _call("openai", [chat_json("{}")], req)
    assert bodies[0]["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize("kind", ["qwen", "openai-compatible", "llamacpp"])
async def test_other_chat_profiles_with_json_schema_send_it_natively(kind: str) -> None:
    _, _, bodies = await _call(kind, [chat_json(orjson.dumps(ANSWER).decode())])
    assert bodies[0]["response_format"]["type"] == "json_schema"
    assert bodies[0]["response_format"]["json_schema"]["schema"] == CITY


@pytest.mark.parametrize("stream", [False, True])
async def test_deepseek_falls_back_to_json_mode_with_the_schema_in_the_system_prompt(stream: bool) -> None:
    assert PROFILES["deepseek"].capabilities.structured_output is False
    text = "```json\n" + orjson.dumps(ANSWER).decode() + "\n```"
    final, _, bodies = await _call("deepseek", [chat_sse(text) if stream else chat_json(text)], stream=stream)
    body = bodies[0]
    assert body["response_format"] == {"type": "json_object"}
    system = body["messages"][0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n")
    assert "JSON" in system["content"] and orjson.dumps(CITY).decode() in system["content"]
    assert "The largest city of the country" in system["content"]
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert parse_output(final, SCHEMA).value == ANSWER


async def test_json_mode_fallback_adds_a_system_message_when_there_is_none() -> None:
    req = evolve(REQ, messages=(UserMessage("Largest city of France?"),))
    _, _, bodies = await _call("deepseek", [chat_json("{}")], req)
    assert [m["role"] for m in bodies[0]["messages"]] == ["system", "user"]
    assert "city_info" in bodies[0]["messages"][0]["content"]


# ---------------------------------------------------------------------------- OpenAI Responses
async def test_responses_sends_text_format_json_schema() -> None:
    final, _, bodies = await _call("openai-responses", [responses_json(orjson.dumps(ANSWER).decode())])
    assert bodies[0]["text"] == {"format": {"type": "json_schema", "name": "city_info", "schema": CITY,
                                            "strict": True, "description": "The largest city of the country"}}
    assert parse_output(final, SCHEMA).value == ANSWER


async def test_responses_json_mode_fallback() -> None:
    _, _, bodies = await _call("openai-responses", [responses_json("{}")], caps={"structured_output": False})
    assert bodies[0]["text"] == {"format": {"type": "json_object"}}
    assert orjson.dumps(CITY).decode() in bodies[0]["instructions"]


# ---------------------------------------------------------------------------- Anthropic Messages
async def test_anthropic_sends_output_config_format() -> None:
    text = orjson.dumps(ANSWER).decode()
    final, _, bodies = await _call("anthropic", [anthropic_json([{"type": "text", "text": text}])])
    assert bodies[0]["output_config"] == {"format": {"type": "json_schema", "schema": CITY}}
    assert "tools" not in bodies[0] and "tool_choice" not in bodies[0]
    assert parse_output(final, SCHEMA).value == ANSWER


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_without_output_config_forces_an_answer_tool_mapped_back_to_text(stream: bool) -> None:
    reply = (anthropic_tool_sse("city_info", ANSWER, preamble="Here you go.") if stream else
             anthropic_json([{"type": "text", "text": "Here you go."},
                             {"type": "tool_use", "id": "toolu_1", "name": "city_info", "input": ANSWER}], "tool_use"))
    final, events, bodies = await _call("anthropic", [reply], stream=stream, caps={"structured_output": False})
    body = bodies[0]
    assert "output_config" not in body
    assert body["tools"] == [{"name": "city_info", "description": "The largest city of the country",
                              "input_schema": CITY}]
    assert body["tool_choice"] == {"type": "tool", "name": "city_info"}
    system = body["system"] if isinstance(body["system"], str) else body["system"][-1]["text"]
    assert system.startswith("Be brief.") and "'city_info'" in system
    # the caller sees a text answer, exactly as with a native format
    assert final.tool_calls == () and final.stop_reason is ModelStopReason.END_TURN
    assert orjson.loads(final.text) == ANSWER and final.extra["answer_preamble"] == "Here you go."
    assert parse_output(final, SCHEMA).value == ANSWER
    if stream:
        assert not any(isinstance(e, ToolCallEnd) for e in events)
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == final.text
        assert isinstance(events[-1], MessageComplete)


async def test_anthropic_answer_tool_with_other_tools_and_with_thinking() -> None:
    caps = {"structured_output": False}
    call = [{"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"city": "Paris"}}]
    final, _, bodies = await _call("anthropic", [anthropic_json(call, "tool_use")], evolve(REQ, tools=(WEATHER,)),
                                   caps=caps)
    assert [t["name"] for t in bodies[0]["tools"]] == ["get_weather", "city_info"]
    assert bodies[0]["tool_choice"] == {"type": "any"}  # a real tool or the answer
    assert final.tool_calls[0].name == "get_weather" and final.stop_reason is ModelStopReason.TOOL_USE

    _, _, bodies = await _call("anthropic", [anthropic_json([{"type": "text", "text": "{}"}])],
                               evolve(REQ, thinking=ThinkingConfig(budget_tokens=2048)), caps=caps)
    assert bodies[0]["tool_choice"] == {"type": "auto"}  # the API refuses a forced tool with thinking

    with pytest.raises(ConfigurationError, match="also the name of a tool"):
        await _call("anthropic", [anthropic_json([])],
                    evolve(REQ, tools=(evolve(WEATHER, name="city_info"),)), caps=caps)


# ---------------------------------------------------------------------------- constrained mode (llama.cpp)
async def test_constrained_mode_carries_the_output_schema_in_the_final_answer_branch() -> None:
    req = evolve(REQ, tools=(WEATHER,))
    reply = orjson.dumps({"final_answer": ANSWER}).decode()
    final, _, bodies = await _call("llamacpp", [chat_json(reply)], req)
    rf = bodies[0]["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["name"] == "tool_call_or_final_answer"
    branches = rf["json_schema"]["schema"]["anyOf"]
    assert branches[0]["properties"] == {"final_answer": CITY}
    assert branches[1]["properties"]["tool"] == {"type": "string", "enum": ["get_weather"]}
    assert "tools" not in bodies[0]
    assert orjson.dumps(CITY).decode() in bodies[0]["messages"][0]["content"]  # the prompt names the schema
    assert final.message.content == (TextBlock(orjson.dumps(ANSWER).decode()),)
    assert parse_output(final, SCHEMA).value == ANSWER
    assert tool_call_schema(req)["anyOf"][0]["properties"]["final_answer"] == CITY


async def test_constrained_mode_structured_answer_streams_as_one_json_text() -> None:
    req = evolve(REQ, tools=(WEATHER,))
    reply = orjson.dumps({"final_answer": ANSWER}).decode()
    final, events, _ = await _call("llamacpp", [chat_sse(reply)], req, stream=True)
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert deltas == [orjson.dumps(ANSWER).decode()] and final.text == deltas[0]
    assert parse_output(final, SCHEMA).value == ANSWER


async def test_constrained_mode_tool_call_still_works_and_history_keeps_the_value() -> None:
    req = evolve(REQ, tools=(WEATHER,), messages=(
        *REQ.messages,
        # an earlier structured answer goes back as a value, not as a string holding JSON
        AssistantMessage(orjson.dumps(ANSWER).decode()),
        UserMessage("And Germany?"),
    ))
    reply = orjson.dumps({"tool": "get_weather", "arguments": {"city": "Berlin"}}).decode()
    final, _, bodies = await _call("llamacpp", [chat_json(reply)], req)
    assert isinstance(final.message.content[0], ToolUseBlock) and final.tool_calls[0].input == {"city": "Berlin"}
    history = [m["content"] for m in bodies[0]["messages"] if m["role"] == "assistant"]
    assert orjson.loads(history[0]) == {"final_answer": ANSWER}


async def test_structured_call_over_http_repairs_once() -> None:
    server = ReplayServer([chat_json('{"city": "Paris"}'), chat_json(orjson.dumps(ANSWER).decode())])
    provider = _provider("openai", await server.start())
    try:
        result = await structured_call(provider, MessageRequest("", (UserMessage("Largest city of France?"),)),
                                       SCHEMA)
    finally:
        await provider.aclose()
        await server.close()
    assert result.value == ANSWER and len(server.requests) == 2
    second = server.requests[1].json()["messages"]
    assert second[-2] == {"role": "assistant", "content": '{"city": "Paris"}'}
    assert "'population' is a required property" in second[-1]["content"]
    assert second[-1]["role"] == "user"


def test_a_forced_constrained_mode_sends_json_schema_even_without_the_capability() -> None:
    p = create_provider("openai-compatible", ProviderConfig(base_url="http://127.0.0.1:1/v1", model="m",
                                                            api_key="k", tool_mode=ToolMode.CONSTRAINED))
    p.profile = evolve(p.profile, capabilities=evolve(p.profile.capabilities, structured_output=False))
    body = p.build_body(p.prepare(REQ), stream=False)
    assert body["response_format"]["type"] == "json_schema"
