"""Cases C01, C02, C03, C04, C05 and C09 (../shared/cases) through the real HTTP path, and the Chat
Completions vendor profiles beyond them: each vendor's reasoning round trip and id rules, fields that
never leak to another vendor, a stop reason that tells the truth, repeated calls sent once, resumed
requests that never end in a prefill, and call fragments matched by id.

A local aiohttp server (``ReplayServer``) answers each request; where the real service validates the
request, the server here answers that service's 400 when the rule is broken, so the run fails exactly
as it would against the vendor. The verdict rests on the request bodies fsm_agent sent.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

import orjson
import pytest
from aiohttp import web
from attrs import define

from corpus import CASES
from fsm_agent import Agent, RunConfig, StopReason, tool
from fsm_agent.providers import ProviderConfig, ProviderType, create_provider
from fsm_agent.providers.openai_chat import (
    CONTINUE,
    CONTINUE_AFTER_CUT,
    OpenAIChatStreamParser,
    ToolIdMap,
    messages_to_wire,
)
from fsm_agent.providers.profiles import detect_profile
from fsm_agent.providers.sse import SSEDecoder
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.testing.replay import ReceivedRequest
from fsm_agent.types import (
    AssistantMessage,
    MessageComplete,
    MessageRequest,
    ModelStopReason,
    PartialMessageResponse,
    TextBlock,
    ThinkingBlock,
    ThinkingConfig,
    ToolDefinition,
    ToolResultMessage,
    ToolUseBlock,
    UserMessage,
)
from fsm_agent.types.codec import structure, unstructure
from fsm_agent.types.pairing import MISSING_RESULT


# ----------------------------------------------------------------------------------------- helpers
def expected(name: str) -> dict[str, Any]:
    return json.loads((CASES / f"{name}.expected.json").read_text())


def body_of(name: str) -> bytes:
    return (CASES / name).read_bytes()


SSE = "text/event-stream"
Rule = Callable[[dict[str, Any]], "tuple[int, Any] | None"]


@define
class RuleServer(ReplayServer):
    """A ReplayServer that first checks each request against the vendor's rule and answers the
    vendor's error when it is broken (recorded in ``requests`` all the same)."""

    rule: Rule | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        bad = self.rule(orjson.loads(raw)) if self.rule is not None and raw else None
        if bad is not None:
            self.requests.append(ReceivedRequest(request.method, request.path_qs, dict(request.headers), raw))
            return web.Response(status=bad[0], body=orjson.dumps(bad[1]), content_type="application/json")
        return await super()._handle(request)


async def run_agent(kind: str, responses: list[RecordedResponse], tools: list[Any], *, rule: Rule | None = None,
                    config: RunConfig | None = None, model: str = "test-model", task: str = "go",
                    seed: int | None = 3) -> tuple[Any, RuleServer]:
    server = RuleServer(responses, seed=seed, rule=rule)
    base = await server.start()
    p = create_provider(kind, ProviderConfig(base_url=base, model=model, api_key="k"))
    try:
        result = await Agent(p, tools=tools, config=config or RunConfig()).run(task)
    finally:
        await p.aclose()
        await server.close()
    return result, server


async def stream_once(kind: str, body: bytes, *, seed: int = 1, request: MessageRequest | None = None,
                      base_suffix: str = "") -> tuple[Any, list[Any], Any]:
    server = ReplayServer([RecordedResponse(200, body, SSE)], seed=seed)
    base = await server.start()
    p = create_provider(kind, ProviderConfig(base_url=base + base_suffix, model="m", api_key="k"))
    try:
        events = [ev async for ev in p.chat_stream(request or MessageRequest("m", (UserMessage("hi"),)))]
    finally:
        await p.aclose()
        await server.close()
    final = events[-1]
    assert isinstance(final, MessageComplete)
    fold = PartialMessageResponse(provider=final.full_response.provider, source="openai-chat")
    for ev in events:
        fold.apply(ev)
    assert fold.finalize().message == final.full_response.message  # the events hold the whole message
    return final.full_response, events, p


def sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}


def assistant_calls(req: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in req["messages"] if m["role"] == "assistant" and m.get("tool_calls")]


def calls_of(resp: Any) -> list[dict[str, Any]]:
    return [{"name": c.name, "arguments": c.input} for c in resp.tool_calls]


def provider_for(kind: str, base: str = "http://127.0.0.1:9/v1") -> Any:
    return create_provider(kind, ProviderConfig(base_url=base, model="m", api_key="k"))


def wire(p: Any, messages: tuple[Any, ...], stream: bool = False) -> list[dict[str, Any]]:
    return p.build_body(p.prepare(MessageRequest("m", messages)), stream)["messages"]


# ------------------------------------------------------------------------------------------- C01
async def test_c01_tool_calls_finish_with_no_call_is_end_turn_decoded_and_in_an_agent_run() -> None:
    exp = expected("C01")
    server = ReplayServer([RecordedResponse(200, body_of("C01.json"))])
    base = await server.start()
    p = create_provider("openai-compatible", ProviderConfig(base_url=base, model="m", api_key="k"))
    try:
        resp = await p.chat(MessageRequest("m", (UserMessage("hi"),)))
    finally:
        await p.aclose()
        await server.close()
    assert [c.id for c in resp.tool_calls] == exp["decode"]["tool_calls"]
    assert resp.text == exp["decode"]["text"]
    assert resp.stop_reason.value == exp["decode"]["stop_reason"] == "end_turn"
    assert resp.raw_stop_reason == "tool_calls"  # what the server said stays visible

    runs: list[Any] = []

    @tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        runs.append(city)
        return "sunny"

    ag = exp["agent"]
    result, srv = await run_agent("openai-compatible", [RecordedResponse(200, body_of("C01.json"))], [get_weather],
                                  config=RunConfig(stream=False, tool_choice="required"))
    assert result.stop.reason is StopReason.COMPLETED and ag["stop_reason"] == "COMPLETED"
    assert result.output == ag["output"]
    assert len(runs) == ag["tool_executions"] == 0
    assert len(srv.requests) == ag["model_requests"] == 1
    assert result.model_stop_reason is ModelStopReason.END_TURN and ag["model_stop_reason"] == "end_turn"
    sent = srv.requests[0].json()
    assert sent["tool_choice"] == ag["request"]["tool_choice"] and "stream" not in sent


@pytest.mark.parametrize("finish", ["tool_calls", "function_call", "tool_use"])
@pytest.mark.parametrize("shape", ["stream", "json_null_calls", "json_no_key"])
async def test_a_message_without_calls_never_reports_tool_use(finish: str, shape: str) -> None:
    """Other wordings of C01: each tool finish reason, streamed or not, with ``tool_calls`` null or absent."""
    if shape == "stream":
        resp, _, _ = await stream_once("openai-compatible", sse(chunk({"role": "assistant", "content": "Plain prose."}),
                                                                chunk({}, finish)))
    else:
        msg: dict[str, Any] = {"role": "assistant", "content": "Plain prose."}
        if shape == "json_null_calls":
            msg["tool_calls"] = None
        data = {"id": "x", "model": "m", "choices": [{"index": 0, "message": msg, "finish_reason": finish}]}
        resp = provider_for("vllm").decode_body(orjson.dumps(data))
    assert resp.tool_calls == ()
    assert resp.stop_reason is ModelStopReason.END_TURN
    assert resp.raw_stop_reason == finish


# ------------------------------------------------------------------------------------------- C02
@pytest.mark.parametrize("name", ["C02.sse", "C02.ollama.sse"])
async def test_c02_the_calls_decide_over_a_trailing_stop(name: str) -> None:
    exp = expected("C02")
    want = exp["decode"][name]
    resp, _, _ = await stream_once("openai-compatible", body_of(name), seed=2)
    assert resp.text == want["text"]
    assert calls_of(resp) == want["tool_calls"]
    assert resp.stop_reason.value == want["stop_reason"] == "tool_use"

    runs: list[Any] = []

    @tool
    def fetch_articles(topic: str, limit: int) -> str:
        """Find articles."""
        runs.append({"topic": topic, "limit": limit})
        return "a, b, c"

    kind = "ollama" if "ollama" in name else "openai-compatible"
    result, srv = await run_agent(kind, [RecordedResponse(200, body_of(name), SSE),
                                         RecordedResponse(200, body_of("C02.turn2.sse"), SSE)], [fetch_articles])
    ag = exp["agent"]
    assert result.stop.reason is StopReason.COMPLETED
    assert result.output == ag["output"]
    assert runs == [t["arguments"] for t in ag["tool_executions"]]
    second = srv.requests[1].json()["messages"]
    (asst,) = assistant_calls({"messages": second})
    (call,) = asst["tool_calls"]
    results = [m for m in second if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == [call["id"]]
    assert second.index(results[0]) == second.index(asst) + 1


@pytest.mark.parametrize("kind", ["vllm", "sglang", "ollama", "openai-compatible"])
@pytest.mark.parametrize("trailing", ["stop", "eos", None])
async def test_several_calls_then_a_trailing_finish_keep_every_call(kind: str, trailing: str | None) -> None:
    """The trailing-stop habit with parallel calls: tool_calls, then a second finish chunk (or the
    only finish is ``stop``, Ollama's way)."""
    frags = [
        chunk({"role": "assistant", "content": "Checking both."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "lookup", "arguments": "{\"k\": "}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "lookup", "arguments": "{\"k\": 2}"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        chunk({}, "tool_calls" if trailing else "stop"),
    ]
    if trailing:
        frags.append(chunk({}, trailing))
    resp, _, _ = await stream_once(kind, sse(*frags), seed=11)
    assert [(c.id, c.input) for c in resp.tool_calls] == [("call_a", {"k": 1}), ("call_b", {"k": 2})]
    assert resp.stop_reason is ModelStopReason.TOOL_USE
    assert resp.text == "Checking both."


# ------------------------------------------------------------------------------------------- C03
def gemini_rule(req: dict[str, Any]) -> tuple[int, Any] | None:
    for m in assistant_calls(req):
        first = m["tool_calls"][0]
        if not ((first.get("extra_content") or {}).get("google") or {}).get("thought_signature"):
            return 400, [{"error": {"code": 400, "message": "Function call is missing a thought_signature in "
                                    "functionCall parts. This is required for tools to work correctly ...",
                                    "status": "INVALID_ARGUMENT"}}]
    return None


@pytest.mark.parametrize("kind", ["gemini", "openai-compatible"])
async def test_c03_gemini_thought_signature_goes_back_on_the_tool_call(kind: str) -> None:
    exp = expected("C03")
    resp, _, _ = await stream_once(kind, body_of("C03.sse"), seed=3)
    assert [{"id": c.id, "name": c.name, "arguments": c.input} for c in resp.tool_calls] == exp["decode"]["tool_calls"]

    @tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        return {"Lisbon": "21 C", "Porto": "17 C"}[city]

    result, srv = await run_agent(kind, [RecordedResponse(200, body_of("C03.sse"), SSE),
                                         RecordedResponse(200, body_of("C03.turn2.sse"), SSE)], [get_weather],
                                  rule=gemini_rule, model="gemini-3-flash-preview")
    assert result.stop.reason is StopReason.COMPLETED, result.stop
    assert result.output == exp["agent"]["output"]
    (asst,) = assistant_calls(srv.requests[1].json())
    want = exp["second_request"]["assistant_tool_calls"]
    assert [c["id"] for c in asst["tool_calls"]] == [w["id"] for w in want]
    assert asst["tool_calls"][0]["extra_content"] == want[0]["extra_content"]
    assert "extra_content" not in asst["tool_calls"][1] and want[1]["extra_content"] is None


async def test_gemini_signature_on_every_parallel_call_and_in_a_json_answer() -> None:
    """Fields shaped otherwise than C03: indexed fragments, the signature in a later fragment, and a
    non-streamed answer."""
    body = sse(
        chunk({"role": "assistant", "tool_calls": [
            {"index": 0, "id": "g1", "type": "function", "function": {"name": "f", "arguments": ""}},
            {"index": 1, "id": "g2", "type": "function", "function": {"name": "f", "arguments": "{}"},
             "extra_content": {"google": {"thought_signature": "SIG_B"}}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":1}"},
                               "extra_content": {"google": {"thought_signature": "SIG_A"}}}]}),
        chunk({}, "tool_calls"))
    resp, events, p = await stream_once("gemini", body, seed=5)
    out = wire(p, (UserMessage("q"), resp.message, ToolResultMessage("g1", "1"), ToolResultMessage("g2", "2")))
    sigs = [c.get("extra_content") for c in out[1]["tool_calls"]]
    assert sigs == [{"google": {"thought_signature": "SIG_A"}}, {"google": {"thought_signature": "SIG_B"}}]
    ends = [e for e in events if type(e).__name__ == "ToolCallEnd"]
    assert ends[0].call.provider_data == resp.tool_calls[0].provider_data  # the end event is complete too
    data = {"id": "x", "model": "gemini-3-pro-preview", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "tool_calls": [{"id": "j1", "type": "function", "function": {"name": "f", "arguments": "{}"},
                                             "extra_content": {"google": {"thought_signature": "SIG_J"}}}]}}]}
    decoded = p.decode_body(orjson.dumps(data))
    again = wire(p, (UserMessage("q"), decoded.message, ToolResultMessage("j1", "ok")))
    assert again[1]["tool_calls"][0]["extra_content"] == {"google": {"thought_signature": "SIG_J"}}


# ------------------------------------------------------------------------------------------- C04
def openrouter_rule(req: dict[str, Any]) -> tuple[int, Any] | None:
    for m in assistant_calls(req):
        if not m.get("reasoning_details"):
            return 400, {"error": {"code": 400, "message": "Gemini models require OpenRouter reasoning details to be "
                                   "preserved in each request. Please refer to our docs: ..."}}
    return None


@pytest.mark.parametrize("kind", ["openrouter", "openai-compatible"])
async def test_c04_openrouter_reasoning_details_go_back_unchanged(kind: str) -> None:
    exp = expected("C04")
    resp, _, _ = await stream_once(kind, body_of("C04.sse"), seed=4)
    assert [{"id": c.id, "name": c.name, "arguments": c.input} for c in resp.tool_calls] == exp["decode"]["tool_calls"]
    assert resp.thinking == exp["decode"]["thinking"]

    @tool
    def get_forecast(city: str) -> str:
        """Forecast."""
        return "4 C, snow"

    result, srv = await run_agent(kind, [RecordedResponse(200, body_of("C04.sse"), SSE),
                                         RecordedResponse(200, body_of("C04.turn2.sse"), SSE)], [get_forecast],
                                  rule=openrouter_rule, model="google/gemini-3-pro-preview")
    assert result.stop.reason is StopReason.COMPLETED, result.stop
    assert result.output == exp["agent"]["output"]
    (asst,) = assistant_calls(srv.requests[1].json())
    assert asst["reasoning_details"] == exp["second_request"]["assistant_reasoning_details"]


async def test_openrouter_streamed_detail_pieces_join_and_encrypted_only_reasoning_is_kept() -> None:
    """The shape OpenRouter really streams: one ``reasoning.text`` entry a few tokens at a time (the
    same index), a summary, and an encrypted entry with no reasoning text at all."""
    body = sse(
        chunk({"role": "assistant", "reasoning": "Think", "reasoning_details": [
            {"type": "reasoning.text", "text": "Think", "format": "anthropic-claude-v1", "index": 0}]}),
        chunk({"reasoning": "ing.", "reasoning_details": [
            {"type": "reasoning.text", "text": "ing.", "index": 0, "signature": "SIG_OR"}]}),
        chunk({"tool_calls": [{"index": 0, "id": "toolu_1", "type": "function",
                               "function": {"name": "f", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"))
    resp, _, p = await stream_once("openrouter", body, seed=6)
    assert resp.thinking == "Thinking."
    out = wire(p, (UserMessage("q"), resp.message, ToolResultMessage("toolu_1", "ok")))
    assert out[1]["reasoning_details"] == [{"type": "reasoning.text", "text": "Thinking.", "format": "anthropic-claude-v1",
                                            "index": 0, "signature": "SIG_OR"}]
    assert "reasoning" not in out[1]  # the details carry the text: no second copy

    enc_only = sse(
        chunk({"role": "assistant", "reasoning_details": [{"type": "reasoning.encrypted", "data": "ENC==",
                                                           "id": "rs_1", "format": "openai-responses-v1", "index": 0}]}),
        chunk({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                               "function": {"name": "f", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"))
    resp2, _, p2 = await stream_once("openrouter", enc_only, seed=7)
    assert resp2.thinking == ""
    again = wire(p2, (UserMessage("q"), resp2.message, ToolResultMessage("call_9", "ok")))
    assert again[1]["reasoning_details"] == [{"type": "reasoning.encrypted", "data": "ENC==", "id": "rs_1",
                                              "format": "openai-responses-v1", "index": 0}]
    # a plain answer keeps its details too, sent back to the same vendor
    data = {"id": "x", "model": "m", "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "3", "reasoning": "count",
        "reasoning_details": [{"type": "reasoning.summary", "summary": "count", "index": 0}]}}]}
    plain = p2.decode_body(orjson.dumps(data))
    third = wire(p2, (UserMessage("q"), plain.message, UserMessage("sure?")))
    assert third[1]["reasoning_details"] == [{"type": "reasoning.summary", "summary": "count", "index": 0}]


# ------------------------------------------------------------------------------------------- C05
def kimi_rule(req: dict[str, Any]) -> tuple[int, Any] | None:
    for i, m in enumerate(req["messages"]):
        if m["role"] == "assistant" and m.get("tool_calls") and not m.get("reasoning_content"):
            return 400, {"error": {"message": f"thinking is enabled but reasoning_content is missing in assistant "
                                              f"tool call message at index {i}", "type": "invalid_request_error"}}
    return None


@pytest.mark.parametrize("kind", ["openai-compatible", "moonshot"])
async def test_c05_kimi_reasoning_content_goes_back_on_the_tool_call_turn(kind: str) -> None:
    exp = expected("C05")
    resp, _, _ = await stream_once(kind, body_of("C05.sse"), seed=5)
    assert resp.thinking == exp["decode"]["thinking"]
    assert [{"id": c.id, "name": c.name, "arguments": c.input} for c in resp.tool_calls] == exp["decode"]["tool_calls"]

    @tool
    def search_files(pattern: str) -> str:
        """Search."""
        return "a.py:3 TODO\nb.py:9 TODO"

    result, srv = await run_agent(kind, [RecordedResponse(200, body_of("C05.sse"), SSE),
                                         RecordedResponse(200, body_of("C05.turn2.sse"), SSE)], [search_files],
                                  rule=kimi_rule, model="kimi-k2.5")
    assert result.stop.reason is StopReason.COMPLETED, result.stop
    assert result.output == exp["agent"]["output"]
    (asst,) = assistant_calls(srv.requests[1].json())
    assert asst["reasoning_content"] == exp["second_request"]["assistant_reasoning_content"]


async def test_reasoning_goes_back_under_the_field_it_came_in_and_only_on_tool_call_turns() -> None:
    """vLLM >= 0.10 and Ollama stream ``delta.reasoning``; a generic server gets it back there, on
    tool-call turns only."""
    body = sse(chunk({"role": "assistant", "reasoning": "R."}),
               chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
               chunk({}, "tool_calls"))
    resp, _, p = await stream_once("vllm", body)
    text_turn = AssistantMessage((ThinkingBlock("T.", source="openai-chat",
                                                provider_data=resp.message.content[0].provider_data), TextBlock("x")))
    out = wire(p, (UserMessage("q"), resp.message, ToolResultMessage("c1", "1"), text_turn, UserMessage("q2")))
    assert out[1]["reasoning"] == "R." and "reasoning_content" not in out[1]
    assert "reasoning" not in out[3]


# ----------------------------------------------------------------------------- no leak to another vendor
LEAKY = ("extra_content", "reasoning_details", "reasoning_content", "reasoning")


async def _decoded_turns() -> dict[str, tuple[Any, Any]]:
    """vendor name -> (response, provider that decoded it)."""
    out = {}
    for name, kind, case in (("gemini", "gemini", "C03.sse"), ("openrouter", "openrouter", "C04.sse"),
                             ("kimi", "openai-compatible", "C05.sse")):
        resp, _, p = await stream_once(kind, body_of(case))
        out[name] = (resp, p)
    return out


async def test_a_vendor_field_never_reaches_another_vendor() -> None:
    turns = await _decoded_turns()
    others = {
        "openai": provider_for("openai", "https://api.openai.com/v1"),
        "deepseek": provider_for("deepseek", "https://api.deepseek.com"),
        "qwen": provider_for("qwen", "https://dashscope.aliyuncs.com/compatible-mode/v1"),
        "moonshot": provider_for("moonshot", "https://api.moonshot.ai/v1"),
        "mistral": provider_for("mistral", "https://api.mistral.ai/v1"),
        "groq": provider_for("openai-compatible", "https://api.groq.com/openai/v1"),
        "vllm": provider_for("vllm"),
        "llamacpp": provider_for("llamacpp", "http://127.0.0.1:8080/v1"),
    }
    for name, (resp, source) in turns.items():
        history = (UserMessage("q"), resp.message,
                   *(ToolResultMessage(c.id, "ok") for c in resp.tool_calls), UserMessage("and?"))
        same = wire(source, history)
        assert any(k in json.dumps(same[1]) for k in LEAKY), name  # the same vendor gets them back
        for other_name, other in others.items():
            for m in wire(other, history):
                for call in m.get("tool_calls") or ():
                    assert set(call) == {"id", "type", "function"}, (name, other_name)
                assert not set(m) & set(LEAKY), (name, other_name, m)


def test_a_same_named_profile_at_another_host_is_another_vendor() -> None:
    here = provider_for("openai-compatible", "http://10.0.0.1:8000/v1")
    there = provider_for("openai-compatible", "http://10.0.0.2:8000/v1")
    assert here.vendor != there.vendor
    data = {"id": "x", "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "reasoning_content": "why", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}, "x_vendor": {"k": 1}}]}}]}
    msg = here.decode_body(orjson.dumps(data)).message
    history = (UserMessage("q"), msg, ToolResultMessage("c1", "ok"))
    assert wire(here, history)[1]["reasoning_content"] == "why"
    assert wire(here, history)[1]["tool_calls"][0]["x_vendor"] == {"k": 1}
    assert "reasoning_content" not in wire(there, history)[1]
    assert "x_vendor" not in wire(there, history)[1]["tool_calls"][0]
    # a profile's own host is the profile: with or without an explicit base URL
    assert provider_for("gemini", "https://generativelanguage.googleapis.com/v1beta/openai").vendor == "gemini"


def test_vendor_records_survive_the_codec() -> None:
    block = ToolUseBlock("c1", "f", {}, None, {"openai-chat": {"vendor": "gemini", "fields": {
        "extra_content": {"google": {"thought_signature": "S"}}}}})
    think = ThinkingBlock("", source="openai-chat", provider_data={"openai-chat": {"vendor": "openrouter",
                                                                                 "reasoning_details": [{"type": "x"}]}})
    msg = AssistantMessage((think, block))
    assert structure(unstructure(msg), AssistantMessage) == msg


# ------------------------------------------------------------------------------------------- C09
def dashscope_rule(req: dict[str, Any]) -> tuple[int, Any] | None:
    case = json.loads(body_of("C09.json"))
    if not req.get("stream") and req.get("enable_thinking") is not False:
        return case["server_rule"]["status"], case["server_rule"]["body"]
    return None


async def test_c09_qwen3_on_dashscope_non_streaming_sends_enable_thinking_false() -> None:
    case = json.loads(body_of("C09.json"))
    exp = expected("C09")
    ok_stream = sse(chunk({"role": "assistant", "content": case["ok_stream_text"]}), chunk({}, "stop"))
    server = RuleServer([RecordedResponse(200, orjson.dumps(case["ok_body"]))], rule=dashscope_rule)
    base = await server.start()
    p = create_provider(case["provider"], ProviderConfig(base_url=base, model=case["model"], api_key="k"))
    try:
        resp = await p.chat(MessageRequest(case["model"], (UserMessage("hi"),)))
    finally:
        await p.aclose()
        await server.close()
    assert resp.text == exp["provider_chat"]["text"]
    assert server.requests[0].json()["enable_thinking"] is False

    result, srv = await run_agent("qwen", [RecordedResponse(200, orjson.dumps(case["ok_body"])),
                                           RecordedResponse(200, ok_stream, SSE)], [],
                                  rule=dashscope_rule, model=case["model"], config=RunConfig(stream=False))
    assert result.stop.reason is StopReason.COMPLETED and exp["agent_stream_false"]["stop_reason"] == "COMPLETED"
    assert result.output == exp["agent_stream_false"]["output"]


async def test_qwen_thinking_asked_for_without_streaming_is_streamed_and_read_whole() -> None:
    body = sse(chunk({"role": "assistant", "reasoning_content": "hm"}), chunk({"content": "Hello."}),
               chunk({}, "stop", usage={"prompt_tokens": 3, "completion_tokens": 2}))
    server = RuleServer([RecordedResponse(200, body, SSE)], rule=dashscope_rule)
    base = await server.start()
    p = create_provider("qwen", ProviderConfig(base_url=base, model="qwen3-32b", api_key="k"))
    try:
        resp = await p.chat(MessageRequest("qwen3-32b", (UserMessage("hi"),), thinking=ThinkingConfig(True, 256)))
    finally:
        await p.aclose()
        await server.close()
    sent = server.requests[0].json()
    assert sent["stream"] is True and sent["enable_thinking"] is True and sent["thinking_budget"] == 256
    assert (resp.text, resp.thinking) == ("Hello.", "hm")
    assert resp.usage is not None and resp.usage.output_tokens == 2
    # streamed calls are left as they were; other profiles never get the field
    q = provider_for("qwen")
    assert "enable_thinking" not in q.build_body(MessageRequest("m", (UserMessage("hi"),)), True)
    for other in ("openai-compatible", "deepseek", "vllm"):
        assert "enable_thinking" not in provider_for(other).build_body(MessageRequest("m", (UserMessage("hi"),)), False)


# ------------------------------------------------------------------------------------------- Mistral
def test_mistral_ids_over_a_long_history_with_parallel_calls() -> None:
    p = provider_for("mistral", "https://api.mistral.ai/v1")
    history: list[Any] = [UserMessage("start")]
    originals = []
    for turn in range(12):
        ids = [f"call_{turn}_{k}" if k else f"toolu_01{turn:02d}ABCDEFGHIJKLMNOP" for k in range(3)]
        if turn == 5:
            ids = ["Ab3dE6gH9", "", "call-with-dash"]  # a Mistral-form id, an empty one, illegal characters
        originals += ids
        history.append(AssistantMessage(tuple(ToolUseBlock(i, "f", {"n": turn, "k": k}) for k, i in enumerate(ids))))
        history += [ToolResultMessage(i, f"r{turn}.{k}") for k, i in enumerate(ids)]
        history.append(UserMessage(f"next {turn}"))
    out = wire(p, tuple(history))
    again = wire(p, tuple(history))
    assert out == again  # the same history maps to the same ids on every request
    sent_calls = [c["id"] for m in out if m["role"] == "assistant" for c in m["tool_calls"]]
    sent_results = [m["tool_call_id"] for m in out if m["role"] == "tool"]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in sent_calls + sent_results)
    assert sent_calls == sent_results  # each result answers its own call
    assert len(set(sent_calls)) == len(sent_calls) == 36
    assert "Ab3dE6gH9" in sent_calls  # already in Mistral's form: kept
    # the vendor's own ids come back unchanged
    own = (UserMessage("q"), AssistantMessage((ToolUseBlock("D681PevKs", "f", {}),)), ToolResultMessage("D681PevKs", "x"))
    assert [m.get("tool_call_id") or (m.get("tool_calls") or [{}])[0].get("id") for m in wire(p, own)[1:]] == [
        "D681PevKs", "D681PevKs"]
    # other vendors keep the ids as they are
    assert wire(provider_for("openai-compatible"), tuple(history))[2]["tool_call_id"] == "toolu_0100ABCDEFGHIJKLMNOP"


def test_mistral_id_map_never_hands_one_id_to_two_calls() -> None:
    m = ToolIdMap("mistral")
    m.reserve("AAAAAAAAA")
    got = {m(f"x{i}") for i in range(2000)} | {m("AAAAAAAAA")}
    assert len(got) == 2001 and m("x7") == m("x7")
    assert ToolIdMap(None)("anything-goes") == "anything-goes"


def test_mistral_profile_sends_no_stream_options() -> None:
    p = provider_for("mistral", "https://api.mistral.ai/v1")
    body = p.build_body(MessageRequest("m", (UserMessage("hi"),)), True)
    assert body["stream"] is True and "stream_options" not in body


# -------------------------------------------------------------------- a call given twice, sent once
def test_a_call_given_twice_is_sent_once_with_one_result() -> None:
    call = ToolUseBlock("call_1", "lookup", {"q": "x"})
    # once among the calls and once more as a block of the same turn (two results recorded)
    twice = (UserMessage("q"), AssistantMessage((TextBlock("Looking."), call, call)),
             ToolResultMessage("call_1", "found"), ToolResultMessage("call_1", "found again"), UserMessage("thanks"))
    # the same call repeated in a second assistant turn before its result
    repeated = (UserMessage("q"), AssistantMessage((call,)), AssistantMessage((call,)), ToolResultMessage("call_1", "found"))
    # and again after the result, with no result of its own
    after = (UserMessage("q"), AssistantMessage((call,)), ToolResultMessage("call_1", "found"), AssistantMessage((call,)),
             UserMessage("go on"))
    for history in (twice, repeated, after):
        out = messages_to_wire(history)
        calls = [c for m in out if m["role"] == "assistant" for c in m.get("tool_calls") or ()]
        results = [m for m in out if m["role"] == "tool"]
        assert [c["id"] for c in calls] == ["call_1"], out
        assert [r["content"] for r in results] == ["found"], out
        asst = next(m for m in out if m.get("tool_calls"))
        assert out[out.index(asst) + 1] is results[0]


def test_a_reused_id_with_its_own_result_is_a_new_call() -> None:
    """Servers that number calls per turn (``call_0`` every turn): polling the same call twice is
    two calls, each with its result."""
    poll = ToolUseBlock("call_0", "get_job_status", {"job_id": "J1"})
    history = (UserMessage("wait for J1"), AssistantMessage((poll,)), ToolResultMessage("call_0", "running"),
               AssistantMessage((poll,)), ToolResultMessage("call_0", "done"))
    out = messages_to_wire(history)
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "assistant", "tool"]
    assert [m["content"] for m in out if m["role"] == "tool"] == ["running", "done"]
    # distinct calls that share an empty id inside one turn are all kept
    a, b = ToolUseBlock("", "f", {"x": 1}), ToolUseBlock("", "f", {"x": 2})
    out2 = messages_to_wire((UserMessage("q"), AssistantMessage((a, b)), ToolResultMessage("", "1"),
                             ToolResultMessage("", "2")))
    assert len(out2[1]["tool_calls"]) == 2 and len([m for m in out2 if m["role"] == "tool"]) == 2


# -------------------------------------------------------------------------- resumed, never a prefill
@pytest.mark.parametrize("kind", ["openai", "openai-compatible", "deepseek", "qwen", "mistral", "moonshot", "vllm"])
def test_an_interrupted_answer_is_kept_unmarked_and_never_the_last_message(kind: str) -> None:
    p = provider_for(kind)
    cut = AssistantMessage((TextBlock("The first half of"),), {"interrupted": True})
    out = wire(p, (UserMessage("write"), cut))
    assert out[-2] == {"role": "assistant", "content": "The first half of"}  # no marker on the wire
    assert out[-1] == {"role": "user", "content": CONTINUE_AFTER_CUT}
    assert "interrupted" not in json.dumps(out)
    # the driver's own continuation is left alone: nothing added
    driven = wire(p, (UserMessage("write"), cut, UserMessage(CONTINUE_AFTER_CUT)))
    assert [m["role"] for m in driven] == ["user", "assistant", "user"]
    # any other plain assistant answer at the end is not sent as a prefill either
    plain = wire(p, (UserMessage("hi"), AssistantMessage("Hello")))
    assert plain[-1] == {"role": "user", "content": CONTINUE}
    # a tool-call turn at the end is not a prefill: no user turn; its call, never answered, gets the
    # error result every protocol sends for a call with no recorded result (the wire refuses it bare)
    calls = wire(p, (UserMessage("hi"), AssistantMessage((ToolUseBlock("abcdefghi", "f", {}),))))
    assert [m["role"] for m in calls] == ["user", "assistant", "tool"]
    assert calls[-1]["content"] == MISSING_RESULT


async def test_a_resumed_stream_after_an_interrupt_is_a_valid_chat_request() -> None:
    """The partial answer from a dropped stream, kept as the driver keeps it, goes out as plain text
    followed by a user turn; the server then answers normally."""
    body = sse(chunk({"role": "assistant", "content": "Part one, "}), chunk({"content": "part two"}), done=False)
    server = ReplayServer([RecordedResponse(200, body, SSE, drop_after=len(body) - 3),
                           RecordedResponse(200, sse(chunk({"content": "…and the rest."}), chunk({}, "stop")), SSE)])
    base = await server.start()
    p = create_provider("openai-compatible", ProviderConfig(base_url=base, model="m", api_key="k"))
    from fsm_agent.errors import ProviderError
    from fsm_agent.providers import RetryPolicy  # noqa: F401

    partial = None
    try:
        with pytest.raises(ProviderError) as info:
            async for _ in p.chat_stream(MessageRequest("m", (UserMessage("essay"),))):
                pass
        partial = info.value.partial
        assert partial is not None and partial.text
        kept = AssistantMessage((TextBlock(partial.text),), {"interrupted": True})
        resumed = MessageRequest("m", (UserMessage("essay"), kept))
        final = [e async for e in p.chat_stream(resumed)][-1]
    finally:
        await p.aclose()
        await server.close()
    sent = server.requests[-1].json()["messages"]
    assert sent[-1] == {"role": "user", "content": CONTINUE_AFTER_CUT}
    assert sent[-2] == {"role": "assistant", "content": partial.text}
    assert final.full_response.text == "…and the rest."


# ---------------------------------------------------------------------------- fragments matched by id
def parse(body: bytes) -> Any:
    d, p = SSEDecoder(), OpenAIChatStreamParser("t", "t@x")
    events = []
    for ev in d.feed(body) + d.flush():
        events += p.feed(ev)
    events += p.finish()
    return events[-1].full_response, events


def test_fragments_without_index_continue_the_call_their_id_names() -> None:
    body = sse(
        chunk({"role": "assistant", "tool_calls": [{"id": "A", "type": "function", "function": {"name": "read", "arguments": "{\"p"}}]}),
        chunk({"tool_calls": [{"id": "B", "type": "function", "function": {"name": "grep", "arguments": "{\"q\":"}}]}),
        chunk({"tool_calls": [{"id": "A", "function": {"arguments": "\":\"a.md\"}"}}]}),
        chunk({"tool_calls": [{"id": "B", "function": {"arguments": "\"x\"}"}}]}),
        chunk({}, "tool_calls"))
    resp, events = parse(body)
    assert [(c.id, c.name, c.input) for c in resp.tool_calls] == [("A", "read", {"p": "a.md"}), ("B", "grep", {"q": "x"})]
    assert [e.call.id for e in events if type(e).__name__ == "ToolCallEnd"] == ["A", "B"]  # each ends once, whole
    assert all(e.call.input for e in events if type(e).__name__ == "ToolCallEnd")


def test_fragments_with_ids_only_no_name_again_and_no_index() -> None:
    """Ids alone: the name only in the first fragment, later fragments with the id and text, one
    fragment with neither (it continues the latest call), byte by byte."""
    body = sse(
        chunk({"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": ""}}]}),
        chunk({"tool_calls": [{"id": "c2", "function": {"name": "g", "arguments": ""}}]}),
        chunk({"tool_calls": [{"id": "c1", "function": {"arguments": "{\"a\": 1}"}}]}),
        chunk({"tool_calls": [{"id": "c2", "function": {"arguments": "{\"b\""}}]}),
        chunk({"tool_calls": [{"function": {"arguments": ": 2}"}}]}),
        chunk({}, "tool_calls"))
    resp, _ = parse(body)
    assert [(c.id, c.name, c.input) for c in resp.tool_calls] == [("c1", "f", {"a": 1}), ("c2", "g", {"b": 2})]
    d, p = SSEDecoder(), OpenAIChatStreamParser("t")
    evs: list[Any] = []
    for i in range(len(body)):
        for ev in d.feed(body[i:i + 1]):
            evs += p.feed(ev)
    evs += p.finish()
    assert evs[-1].full_response.tool_calls == resp.tool_calls


def test_an_index_still_wins_over_an_id_and_b08_still_holds() -> None:
    body = sse(
        chunk({"tool_calls": [{"index": 0, "id": "x1", "function": {"name": "f", "arguments": "{}"}}]}),
        chunk({"tool_calls": [{"index": 0, "id": "x2", "function": {"name": "g", "arguments": "{}"}}]}),
        chunk({"tool_calls": [{"index": 0, "id": "", "function": {"arguments": ""}}]}),
        chunk({}, "tool_calls"))
    resp, _ = parse(body)
    assert [(c.id, c.name) for c in resp.tool_calls] == [("x1", "f"), ("x2", "g")]


# ---------------------------------------------------------------------------------- profile choice
@pytest.mark.parametrize("url,name", [
    ("https://generativelanguage.googleapis.com/v1beta/openai", "gemini"),
    ("https://openrouter.ai/api/v1", "openrouter"),
    ("https://api.moonshot.ai/v1", "moonshot"),
    ("https://api.moonshot.cn/v1", "moonshot"),
    ("https://api.mistral.ai/v1", "mistral"),
    ("https://api.deepseek.com", "deepseek"),
    ("https://dashscope-intl.aliyuncs.com/compatible-mode/v1", "qwen"),
    ("http://localhost:11434/v1", "ollama"),
    ("http://localhost:8000/v1", None),
    ("https://api.groq.com/openai/v1", None),
    ("https://evil.example/openrouter.ai/v1", None),
])
def test_the_profile_is_detected_from_the_base_url(url: str, name: str | None) -> None:
    assert detect_profile(url) == name
    for kind in ("openai-compatible", "openai"):
        p = create_provider(kind, ProviderConfig(base_url=url, model="m", api_key="k"))
        assert p.name == (name or kind)


@pytest.mark.parametrize("kind", ["gemini", "openrouter", "moonshot", "mistral", "vllm", "sglang", "ollama"])
def test_vendor_profiles_are_chosen_by_name(kind: str) -> None:
    p = create_provider(ProviderType(kind), ProviderConfig(api_key="k", model="m"))
    assert p.name == kind and p.profile.protocol == "openai-chat"
    assert p.base_url.startswith(("https://", "http://localhost"))


def test_vendor_thinking_parameters() -> None:
    req = MessageRequest("m", (UserMessage("hi"),), thinking=ThinkingConfig(True, 2048))
    def body(kind: str, r: MessageRequest = req) -> dict[str, Any]:
        return provider_for(kind).build_body(r, True)

    assert body("openrouter")["reasoning"] == {"max_tokens": 2048}
    assert body("openrouter", MessageRequest("m", (UserMessage("hi"),), thinking=ThinkingConfig(True, 2048, "high")))[
        "reasoning"] == {"effort": "high"}
    assert body("moonshot")["thinking"] == {"type": "enabled"}
    assert body("vllm")["chat_template_kwargs"] == {"enable_thinking": True, "thinking": True}
    assert body("sglang", MessageRequest("m", (UserMessage("hi"),), thinking=ThinkingConfig(False)))[
        "chat_template_kwargs"] == {"enable_thinking": False, "thinking": False}


def test_gemini_gets_the_documented_placeholder_for_a_call_it_did_not_sign() -> None:
    """A history whose tool calls another vendor made (a fallback, a switched session): Gemini needs a
    signature on the first call of each turn; its own calls go back exactly as they came (C03)."""
    gemini = provider_for("gemini", "https://generativelanguage.googleapis.com/v1beta/openai")
    foreign = (UserMessage("q"), AssistantMessage((ToolUseBlock("a", "f", {}), ToolUseBlock("b", "f", {}))),
               ToolResultMessage("a", "1"), ToolResultMessage("b", "2"))
    out = wire(gemini, foreign)
    assert out[1]["tool_calls"][0]["extra_content"] == {"google": {"thought_signature": "skip_thought_signature_validator"}}
    assert "extra_content" not in out[1]["tool_calls"][1]
    own = AssistantMessage((ToolUseBlock("a", "f", {}, None, {"openai-chat": {"vendor": "gemini"}}),))
    assert "extra_content" not in wire(gemini, (UserMessage("q"), own, ToolResultMessage("a", "1")))[1]["tool_calls"][0]
    assert "extra_content" not in wire(provider_for("openai-compatible"), foreign)[1]["tool_calls"][0]
