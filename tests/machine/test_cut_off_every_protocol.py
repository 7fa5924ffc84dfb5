"""Issue 19 item 3: an answer cut by the output limit inside a tool call reaches the same stop on
every protocol and profile, streamed and not.

Each server below cuts the answer in the middle of a tool call's arguments the way its protocol
says so (Chat ``finish_reason: "length"`` with a partial ``tool_calls`` entry, DeepSeek and Qwen
after their ``reasoning_content``; Responses ``status: "incomplete"`` /
``incomplete_details.reason: "max_output_tokens"`` with a partial ``function_call``; Anthropic
``stop_reason: "max_tokens"`` with a partial ``tool_use``; llama.cpp's constrained tool mode, whose
call is JSON text cut mid-way). Every one: nothing of the cut call runs or is sent back, the run
asks once more with twice the limit, then stops FAILED_RETRYABLE, kind ``output_truncated``, the
limit named, and the next step said. When the model's own maximum is already used, it stops at once.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from fsm_agent import Agent, RetryPolicy, StopReason, tool
from fsm_agent.providers import ProviderConfig, create_provider
from fsm_agent.testing import RecordedResponse, ReplayServer

RAN: list[dict[str, Any]] = []
CUT = '{"path": "notes.md", "text": "First line\\nSecond li'


@tool
def write_file(path: str, text: str) -> str:
    """Write a file.

    Args:
        path: where.
        text: what.
    """
    RAN.append({"path": path, "text": text})
    return "written"


def _sse(*events: tuple[str | None, Any]) -> bytes:
    return b"".join((f"event: {n}\n".encode() if n else b"") + b"data: " +
                    (d if isinstance(d, bytes) else json.dumps(d).encode()) + b"\n\n" for n, d in events)


# ------------------------------------------------------------------------------ Chat Completions
def _chat_chunk(delta: dict[str, Any], finish: str | None = None) -> tuple[None, dict[str, Any]]:
    return None, {"id": "c1", "object": "chat.completion.chunk", "model": "m",
                  "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def chat(stream: bool, reasoning: str | None = None, used: int = 64) -> RecordedResponse:
    usage = {"prompt_tokens": 30, "completion_tokens": used, "total_tokens": 30 + used}
    if not stream:
        msg: dict[str, Any] = {"role": "assistant", "content": "I will write it.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "write_file", "arguments": CUT}}]}
        if reasoning:
            msg["reasoning_content"] = reasoning
        return RecordedResponse(200, json.dumps({"id": "c1", "object": "chat.completion", "model": "m", "choices": [
            {"index": 0, "message": msg, "finish_reason": "length"}], "usage": usage}).encode())
    head = [_chat_chunk({"role": "assistant", "content": ""})]
    if reasoning:
        head.append(_chat_chunk({"reasoning_content": reasoning}))
    body = _sse(*head, _chat_chunk({"content": "I will write it."}),
                _chat_chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                             "function": {"name": "write_file", "arguments": ""}}]}),
                _chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": CUT[:20]}}]}),
                _chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": CUT[20:]}}]}),
                _chat_chunk({}, "length"),
                (None, {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [], "usage": usage}),
                (None, b"[DONE]"))
    return RecordedResponse(200, body, "text/event-stream")


def constrained(stream: bool, used: int = 64) -> RecordedResponse:
    """llama.cpp in the constrained tool mode: the call is the JSON text the grammar allows, cut."""
    text = '{"tool": "write_file", "arguments": ' + CUT
    usage = {"prompt_tokens": 30, "completion_tokens": used, "total_tokens": 30 + used}
    if not stream:
        return RecordedResponse(200, json.dumps({"id": "c1", "object": "chat.completion", "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
            "usage": usage}).encode())
    body = _sse(_chat_chunk({"role": "assistant", "content": ""}),
                *(_chat_chunk({"content": text[i:i + 9]}) for i in range(0, len(text), 9)),
                _chat_chunk({}, "length"),
                (None, {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [], "usage": usage}),
                (None, b"[DONE]"))
    return RecordedResponse(200, body, "text/event-stream")


# ------------------------------------------------------------------------------ Responses
def responses(stream: bool, used: int = 64) -> RecordedResponse:
    call = {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "write_file", "arguments": CUT,
            "status": "incomplete"}
    final = {"id": "resp_1", "object": "response", "model": "m", "status": "incomplete",
             "incomplete_details": {"reason": "max_output_tokens"}, "output": [call],
             "usage": {"input_tokens": 30, "output_tokens": used, "total_tokens": 30 + used}}
    if not stream:
        return RecordedResponse(200, json.dumps(final).encode())
    created = {**final, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    body = _sse(("response.created", {"type": "response.created", "response": created}),
                ("response.output_item.added", {"type": "response.output_item.added", "output_index": 0,
                                                "item": {**call, "arguments": "", "status": "in_progress"}}),
                ("response.function_call_arguments.delta", {"type": "response.function_call_arguments.delta",
                                                            "item_id": "fc_1", "output_index": 0,
                                                            "delta": CUT[:25]}),
                ("response.function_call_arguments.delta", {"type": "response.function_call_arguments.delta",
                                                            "item_id": "fc_1", "output_index": 0,
                                                            "delta": CUT[25:]}),
                ("response.incomplete", {"type": "response.incomplete", "response": final}))
    return RecordedResponse(200, body, "text/event-stream")


# ------------------------------------------------------------------------------ Anthropic
def anthropic(stream: bool, used: int = 64) -> RecordedResponse:
    if not stream:
        return RecordedResponse(200, json.dumps({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
            "content": [{"type": "text", "text": "I will write it."},
                        {"type": "tool_use", "id": "toolu_1", "name": "write_file", "input": {}}],
            "stop_reason": "max_tokens", "stop_sequence": None,
            "usage": {"input_tokens": 30, "output_tokens": used}}).encode())
    body = _sse(
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "content": [],
            "stop_reason": None, "usage": {"input_tokens": 30, "output_tokens": 1}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "I will write it."}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": {
            "type": "tool_use", "id": "toolu_1", "name": "write_file", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                 "delta": {"type": "input_json_delta", "partial_json": CUT}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                           "usage": {"output_tokens": used}}),
        ("message_stop", {"type": "message_stop"}))
    return RecordedResponse(200, body, "text/event-stream")


CASES: dict[str, Any] = {
    "openai": lambda stream: chat(stream),
    "openai-compatible": lambda stream: chat(stream),
    "vllm": lambda stream: chat(stream),
    "ollama": lambda stream: chat(stream),
    "deepseek": lambda stream: chat(stream, reasoning="The user wants a file. "),
    "qwen": lambda stream: chat(stream, reasoning="Write notes.md. "),
    "llamacpp": constrained,
    "openai-responses": responses,
    "anthropic": anthropic,
}


async def _run(kind: str, responses_: list[RecordedResponse], stream: bool, **limits: Any) -> tuple[Any, Any]:
    RAN.clear()
    server = ReplayServer(responses_, repeat_last=True, seed=7)
    base = await server.start()
    p = create_provider(kind, ProviderConfig(base_url=base, api_key="k", model="m",
                                             retry=RetryPolicy(max_attempts=1)))
    try:
        result = await Agent(p, tools=[write_file]).run("Write my notes to notes.md", stream=stream, **limits)
    finally:
        await p.aclose()
        await server.close()
    return result, [r.json() for r in server.requests]


def _limit(body: dict[str, Any]) -> Any:
    return next((body[k] for k in ("max_tokens", "max_completion_tokens", "max_output_tokens") if k in body), None)


def _history(body: dict[str, Any]) -> list[dict[str, Any]]:
    return body.get("messages") or body.get("input") or []


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
@pytest.mark.parametrize("kind", list(CASES))
async def test_a_cut_call_never_runs_is_asked_again_once_then_stops(kind: str, stream: bool) -> None:
    result, bodies = await _run(kind, [CASES[kind](stream)], stream, max_output_tokens=64)
    stop = result.stop
    assert stop.reason is StopReason.FAILED_RETRYABLE and stop.resumable, (kind, stop.detail)
    assert stop.error["kind"] == "output_truncated" and stop.error["code"] == "tool_call_truncated"
    assert stop.error["max_tokens"] == 128  # the limit named: the larger one of the one retry
    assert "(128)" in stop.detail and "write_file" in stop.detail and "raise max_output_tokens" in stop.detail
    assert RAN == []  # nothing of the cut call ran
    assert [_limit(b) for b in bodies] == [64, 128]  # asked again once, with twice the limit
    assert not any(m.role == "assistant" for m in result.messages)  # nothing of it is history
    sent = json.dumps(_history(bodies[1]))
    assert "Second li" not in sent and "I will write it" not in sent


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
async def test_the_model_maximum_already_used_stops_at_once_and_says_what_to_do(stream: bool) -> None:
    """Anthropic's profile knows the model's output maximum (8192) and sends it when the run sets no
    limit: a call cut there cannot get a larger limit, so there is no retry."""
    result, bodies = await _run("anthropic", [anthropic(stream, used=8192)], stream)
    stop = result.stop
    assert stop.reason is StopReason.FAILED_RETRYABLE and len(bodies) == 1 and RAN == []
    assert stop.error["kind"] == "output_truncated" and stop.error["max_tokens"] == 8192
    assert "model's own maximum (8192)" in stop.detail and "larger output limit" in stop.detail


def _no_usage(r: RecordedResponse) -> RecordedResponse:
    body = json.loads(r.body)
    body.pop("usage")
    return RecordedResponse(r.status, json.dumps(body).encode())


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
async def test_without_a_limit_the_retry_doubles_the_limit_the_server_used(stream: bool) -> None:
    """No ``max_output_tokens`` in the run: the server's own default cut the call, and the reported
    output shows how large it was; the one retry asks for twice that, not for a guess below it."""
    result, bodies = await _run("openai", [chat(stream, used=16000)], stream)
    assert [_limit(b) for b in bodies] == [None, 32000]
    assert result.stop.error["max_tokens"] == 32000 and RAN == []


async def test_without_a_limit_or_usage_the_retry_doubles_what_the_profile_sent() -> None:
    """llama.cpp's profile sends ``max_tokens`` 1024 when the run sets none; a cut reported without
    usage is asked again with 2048 (not with twice a guess)."""
    result, bodies = await _run("llamacpp", [_no_usage(constrained(False))], False)
    assert [_limit(b) for b in bodies] == [1024, 2048]
    assert result.stop.error["max_tokens"] == 2048 and RAN == []


async def test_the_retry_that_fits_runs_the_whole_call_once() -> None:
    whole = json.dumps({"id": "c2", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_2", "type": "function", "function": {
                "name": "write_file", "arguments": json.dumps({"path": "notes.md", "text": "all"})}}]}}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 90}}).encode()
    done = json.dumps({"id": "c3", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Done."}}]}).encode()
    result, bodies = await _run("deepseek", [chat(False, reasoning="r"), RecordedResponse(200, whole),
                                             RecordedResponse(200, done)], False, max_output_tokens=64)
    assert result.stop.reason is StopReason.COMPLETED and RAN == [{"path": "notes.md", "text": "all"}]
    assert [_limit(b) for b in bodies] == [64, 128, 64]
