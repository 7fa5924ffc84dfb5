"""Issue 9 item 5: a tool call cut off by the output-token limit is never executed and never shown to
the model; the turn is retried once with a larger limit (bounded by the budget), then the run stops
FAILED_RETRYABLE with error code ``tool_call_truncated``. The driver decides on the model stop reason
``max_tokens`` with tool calls, so it holds for every protocol; two protocols are driven over HTTP."""

from __future__ import annotations

import orjson
from attrs import evolve

from fsm_agent import Agent, ScriptedProvider, StopReason, tool
from fsm_agent.providers import ProviderConfig, create_provider, tool_call_response
from fsm_agent.store import MemoryStore
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import ModelStopReason

RAN: list[dict] = []


@tool
def write_file(path: str, text: str) -> str:
    """Write a file.

    Args:
        path: where.
        text: what.
    """
    RAN.append({"path": path, "text": text})
    return "written"


def cut(**args: object):
    """A tool-use turn the output limit cut: stop reason max_tokens, arguments incomplete."""
    r = tool_call_response(("write_file", dict(args)))
    return evolve(r, stop_reason=ModelStopReason.MAX_TOKENS, raw_stop_reason="length")


async def test_cut_off_call_is_discarded_and_retried_once_with_twice_the_limit() -> None:
    RAN.clear()
    provider = ScriptedProvider([cut(path="a.txt"), tool_call_response(("write_file", {"path": "a.txt", "text": "hi"})),
                                 "done"])
    store = MemoryStore()
    result = await Agent(provider, tools=[write_file], store=store).run("write", max_output_tokens=300)
    assert result.stop.reason is StopReason.COMPLETED
    assert [r.max_tokens for r in provider.requests] == [300, 600, 300]  # the larger limit was for that turn only
    assert RAN == [{"path": "a.txt", "text": "hi"}]  # the cut call never ran
    sent = provider.requests[1].messages
    assert [m.role for m in sent] == ["user"]  # the cut turn was never shown to the model
    events = [e.payload for e in await store.read_events(result.session_id) if e.type == "model_call"]
    assert events[0]["discarded"] == "tool_call_truncated" and "discarded" not in events[1]
    assert result.turns == 3 and result.usage.output_tokens == 15  # the discarded call's tokens still count


async def test_cut_off_twice_stops_retryable_with_a_code_and_nothing_ran() -> None:
    RAN.clear()
    provider = ScriptedProvider([cut(path="a"), cut(path="a", text="partial"), "never"])
    result = await Agent(provider, tools=[write_file]).run("write", max_output_tokens=100)
    assert result.stop.reason is StopReason.FAILED_RETRYABLE and result.stop.resumable
    assert result.stop.error["code"] == "tool_call_truncated" and result.stop.error["max_tokens"] == 200
    assert RAN == [] and len(provider.requests) == 2
    assert not any(m.role == "assistant" and m.tool_calls for m in result.messages)


async def test_no_retry_when_the_token_budget_leaves_no_room() -> None:
    RAN.clear()
    provider = ScriptedProvider([cut(path="a"), "never"])
    result = await Agent(provider, tools=[write_file]).run("write", max_output_tokens=100, max_tokens=110)  # 15 used: 95 left
    assert result.stop.reason is StopReason.FAILED_RETRYABLE
    assert "cannot grow within the budget" in result.stop.detail and len(provider.requests) == 1 and RAN == []


def _chat_cut() -> bytes:
    def chunk(delta: dict, finish: str | None = None) -> bytes:
        return b"data: " + orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "model": "m",
                                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"
    return (chunk({"role": "assistant", "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                         "function": {"name": "write_file", "arguments": ""}}]})
            + chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"path": "a.txt", "te'}}]})
            + chunk({}, "length") + b"data: [DONE]\n\n")


def _anthropic_cut() -> bytes:
    def ev(name: str, data: dict) -> bytes:
        return f"event: {name}\n".encode() + b"data: " + orjson.dumps(data) + b"\n\n"
    return (ev("message_start", {"type": "message_start", "message": {
                "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "content": [],
                "stop_reason": None, "usage": {"input_tokens": 10, "output_tokens": 1}}})
            + ev("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {
                "type": "tool_use", "id": "toolu_1", "name": "write_file", "input": {}}})
            + ev("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
                "type": "input_json_delta", "partial_json": '{"path": "a.txt", "te'}})
            + ev("content_block_stop", {"type": "content_block_stop", "index": 0})
            + ev("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                                   "usage": {"output_tokens": 50}})
            + ev("message_stop", {"type": "message_stop"}))


async def _over_http(kind: str, body: bytes) -> tuple:
    RAN.clear()
    server = ReplayServer([RecordedResponse(200, body, "text/event-stream")] * 2)
    base = await server.start()
    try:
        provider = create_provider(kind, ProviderConfig(base_url=base, api_key="k", model="m"))
        try:
            result = await Agent(provider, tools=[write_file]).run("write", max_output_tokens=64)
        finally:
            await provider.aclose()
    finally:
        await server.close()
    return result, server


async def test_cut_off_calls_over_http_on_chat_and_anthropic() -> None:
    for kind, body in (("openai", _chat_cut()), ("anthropic", _anthropic_cut())):
        result, server = await _over_http(kind, body)
        assert result.stop.reason is StopReason.FAILED_RETRYABLE, (kind, result.stop.detail)
        assert result.stop.error["code"] == "tool_call_truncated", kind
        assert RAN == [], kind
        assert len(server.requests) == 2, kind
        second = orjson.loads(server.requests[1].body)
        assert second.get("max_tokens", second.get("max_completion_tokens")) == 128, (kind, second)
        assert not any(m.get("role") == "assistant" for m in second["messages"]), kind
